"""The CPU backend: the device arena is one NumPy buffer with a hard capacity."""

import numpy as np

from snrt.memory.arena import Arena


class NumpyBackend:
    """NumPy arrays stand in for device memory; kernels run on the calling thread."""

    name = "cpu"
    xp = np

    def __init__(self, arena_bytes, check=False):
        self.arena = Arena(np, arena_bytes, check=check)

    def to_host(self, array):
        """A host (NumPy) copy of a device array."""
        return np.array(array, copy=True)

    def synchronize(self):
        """Wait for all queued work (none on the CPU: kernels are synchronous)."""
