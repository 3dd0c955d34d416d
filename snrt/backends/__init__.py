"""Backends: the only code that knows numpy from cupy (device arena, host store, streams)."""

from snrt.errors import SnrtError

BACKENDS = ("cpu",)


def make_backend(name, plan, check=False):
    """The backend called `name`, with the arena and host store that `plan` needs."""
    if name == "cpu":
        from snrt.backends.numpy_backend import NumpyBackend

        return NumpyBackend(plan.arena_bytes, plan.host_bytes, check=check)
    raise SnrtError(f"unknown backend {name!r}; expected one of {', '.join(BACKENDS)}")
