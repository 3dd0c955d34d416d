"""The device arena: one allocation of the plan's size; every tensor is a view at its offset.

Reservations are checked against the capacity, and the live bytes are measured as the
executor reserves and releases buffers, so the peak it reports is observed, not copied from
the plan. With `check=True` every reservation is also checked against the live ones for
overlap, and memory is poisoned when it is reserved and when it is released, so a read before
the write or after the free shows up (`holds_poison`, and NaN in the results).
"""

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy: buffers of bf16 plans are views of that dtype)

# The poison of float buffers, by dtype: (itemsize, the bits of a quiet NaN whose payload is
# 0xA5...). Arithmetic makes NaNs without a payload (inf - inf, an fp16 gradient that
# overflows), so a buffer holding these bits was not written since it was poisoned; a NaN
# that training itself produced (which fp16's loss scaling skips) is not taken for poison.
POISON = {"float16": (2, 0x7EA5), "bfloat16": (2, 0x7FE5), "float32": (4, 0x7FE5A5A5),
          "float64": (8, 0x7FFDA5A5A5A5A5A5)}


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
        """Fill `buffer` with its dtype's POISON NaN (floats) or a marker pattern (integers)."""
        view = self.bytes_of(buffer)
        if buffer.dtype in POISON:
            size, bits = POISON[buffer.dtype]
            view.view(f"uint{8 * size}")[...] = bits
        else:
            view[...] = 0xA5

    def holds_poison(self, buffer):
        """Whether float `buffer` holds its POISON anywhere: a part not written since it was
        reserved or released (False for other dtypes, whose marker bytes may be data)."""
        if buffer.dtype not in POISON:
            return False
        size, bits = POISON[buffer.dtype]
        return bool((self.bytes_of(buffer).view(f"uint{8 * size}") == bits).any())
