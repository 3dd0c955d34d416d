"""The CPU backend: the device arena is one NumPy buffer with a hard capacity, the host
store another, and the device-to-host and host-to-device streams are worker threads."""

import numpy as np

from snrt.backends.base import Backend
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.backends.streams import CopyStream
from snrt.memory.arena import Arena
from snrt.memory.host import HostStore
from snrt.scheduler import cost


class NumpyBackend(Backend):
    """NumPy arrays stand in for device memory; kernels (the layers' own, or a compiled one
    from cpu_kernels.py) run on the calling thread."""

    name = "cpu"
    xp = np
    cost_model = cost.CPU

    @classmethod
    def kernel_choice(cls):
        return CPU_KERNELS

    def __init__(self, arena_bytes, host_bytes=0, check=False, kernels=None):
        super().__init__(arena_bytes, host_bytes, check, kernels)
        self.arena = Arena(np, arena_bytes, check=check)
        self.host = HostStore(np.zeros(host_bytes, dtype=np.uint8))
        self.to_host_stream = CopyStream("d2h", lazy=check)
        self.to_device_stream = CopyStream("h2d", lazy=check)

    def offload(self, buffer):
        source, target = self.arena.bytes_of(buffer), self.host.slot(buffer)
        return self.to_host_stream.submit(lambda: np.copyto(target, source))

    def prefetch(self, buffer, source):
        data, target = self.host.slot(source), self.arena.bytes_of(buffer)
        return self.to_device_stream.submit(lambda: np.copyto(target, data))

    def to_host(self, array):
        return np.array(array, copy=True)

    def close(self):
        """Stop the copy threads."""
        self.to_host_stream.close()
        self.to_device_stream.close()
