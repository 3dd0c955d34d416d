"""The CPU backend: the device arena is one NumPy buffer with a hard capacity, the host
store another, and the device-to-host and host-to-device streams are worker threads."""

import numpy as np

from snrt.backends.streams import CopyStream
from snrt.memory.arena import Arena


class NumpyBackend:
    """NumPy arrays stand in for device memory; kernels run on the calling thread."""

    name = "cpu"
    xp = np

    def __init__(self, arena_bytes, host_bytes=0, check=False):
        self.arena = Arena(np, arena_bytes, check=check)
        self.host = np.zeros(host_bytes, dtype=np.uint8)
        self.to_host_stream = CopyStream("d2h", lazy=check)
        self.to_device_stream = CopyStream("h2d", lazy=check)

    def offload(self, buffer):
        """Queue the copy of `buffer`'s device bytes to its host slot; returns an event."""
        source = self.arena.data[buffer.offset:buffer.offset + buffer.nbytes]
        target = self.host[buffer.host_slot:buffer.host_slot + buffer.nbytes]
        return self.to_host_stream.submit(lambda: np.copyto(target, source))

    def prefetch(self, buffer, source):
        """Queue the copy of `source`'s host slot into `buffer` on the device; returns an event."""
        data = self.host[source.host_slot:source.host_slot + source.nbytes]
        target = self.arena.data[buffer.offset:buffer.offset + buffer.nbytes]
        return self.to_device_stream.submit(lambda: np.copyto(target, data))

    def to_host(self, array):
        """A host (NumPy) copy of a device array."""
        return np.array(array, copy=True)

    def synchronize(self):
        """Wait for all queued work (kernels are synchronous; copies are waited by the plan)."""

    def close(self):
        """Stop the copy threads."""
        self.to_host_stream.close()
        self.to_device_stream.close()
