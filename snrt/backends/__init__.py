"""Backends: the only code that knows numpy from cupy (device arena, host store, streams)."""

from snrt.errors import SnrtError

BACKENDS = ("cpu",)


def make_backend(name, arena_bytes, check=False):
    """The backend called `name` with an arena of `arena_bytes`."""
    if name == "cpu":
        from snrt.backends.numpy_backend import NumpyBackend

        return NumpyBackend(arena_bytes, check=check)
    raise SnrtError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
