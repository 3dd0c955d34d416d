"""The device arena: one allocation of the plan's size; every tensor is a view at its offset.

Reservations are checked against the capacity, and the live bytes are measured as the
executor reserves and releases buffers, so the peak it reports is observed, not copied from
the plan. With `check=True` every reservation is also checked against the live ones for
overlap, and memory is poisoned with NaN (float views) when it is reserved and when it is
released, so a read before the write or after the free shows up in the results.
"""

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy: buffers of bf16 plans are views of that dtype)

from snrt.precision import holds_floats


class ArenaError(RuntimeError):
    """A reservation outside the arena or on top of a live buffer: the plan is wrong."""


class Arena:
    """`nbytes` of device memory from `xp` (numpy or cupy), carved into planned views: `data`
    (zeroed uint8 memory of at least that size) where the backend allocates it, else
    xp.zeros."""

    def __init__(self, xp, nbytes, check=False, data=None):
        self.xp = xp
        self.capacity_bytes = nbytes
        self.data = xp.zeros(max(nbytes, 1), dtype=xp.uint8) if data is None else data
        self.check = check
        self.live = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    def view(self, buffer):
        """The array of `buffer` (shape and dtype) at its offset."""
        end = buffer.offset + buffer.nbytes
        if buffer.offset < 0 or end > self.capacity_bytes:
            raise ArenaError(f"buffer {buffer.name} [{buffer.offset}, {end}) is outside the {self.capacity_bytes}-byte arena")
        return self.data[buffer.offset:end].view(buffer.dtype).reshape(buffer.shape)

    def bytes_of(self, buffer):
        """The raw bytes of `buffer` (a uint8 view at its offset)."""
        return self.data[buffer.offset:buffer.offset + buffer.nbytes]

    def reserve(self, buffer):
        """Mark `buffer` alive (its bytes now count)."""
        if buffer.id in self.live:
            raise ArenaError(f"buffer {buffer.name} reserved twice")
        if self.check:
            start, end = buffer.offset, buffer.offset + buffer.nbytes
            for other in self.live.values():
                if other.offset < end and start < other.offset + other.nbytes and buffer.nbytes and other.nbytes:
                    raise ArenaError(f"buffer {buffer.name} overlaps live buffer {other.name}")
        if self.check:
            self.poison(buffer)  # nothing has been written yet: a read before the write shows
        self.live[buffer.id] = buffer
        self.live_bytes += buffer.nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def release(self, buffer):
        """Mark `buffer` dead; in check mode poison its bytes."""
        if self.live.pop(buffer.id, None) is None:
            raise ArenaError(f"buffer {buffer.name} released but not alive")
        self.live_bytes -= buffer.nbytes
        if self.check:
            self.poison(buffer)

    def poison(self, buffer):
        """Fill `buffer` with NaN (floats) or a marker pattern (integers)."""
        view = self.bytes_of(buffer)
        if holds_floats(buffer.dtype):
            view.view(buffer.dtype)[...] = self.xp.nan
        else:
            view[...] = 0xA5
