"""The host store: one byte array in host memory (pinned on CUDA) holding offloaded and
streamed tensors, each in the slot the plan gave it (`Buffer.host_slot`).

On the CPU the store may instead be a file on disk, memory-mapped (`HostStore.on_disk`), so a
run can hold more parameters and offloaded tensors than the machine has RAM, as
ZeRO-Infinity offloads to NVMe. After each copy into or out of a slot the slot's pages are
given back (`settle`): their data stays in the file (through the kernel's page cache, which
writes it back and reclaims it when memory runs short), not in the process's memory.
"""

import errno
import mmap
import os
import tempfile

import numpy as np


class HostStore:
    """`data` (a NumPy uint8 array, or None when the plan offloads nothing) carved into slots;
    `mapping` is the mmap behind `data` when the store is a file."""

    def __init__(self, data, mapping=None):
        self.data, self.mapping = data, mapping

    @classmethod
    def on_disk(cls, nbytes, folder):
        """A store of `nbytes` in a new file in `folder`, deleted at once (its space lives as long
        as the mapping: however the process ends, nothing is left behind)."""
        if os.path.exists(folder) and not os.path.isdir(folder):
            raise OSError(errno.ENOTDIR, "memory.host_store: expected a folder for the host store's file, this is "
                                         "a file", str(folder))
        os.makedirs(folder, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="snrt-host-store-", suffix=".bin", dir=folder)
        try:
            os.unlink(path)
            _reserve(fd, max(nbytes, 1), folder)
            mapping = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(np.frombuffer(mapping, dtype=np.uint8), mapping)

    def slot(self, buffer):
        """The bytes of `buffer`'s slot (a view of `data`)."""
        if self.data is None or buffer.host_slot < 0:
            raise ValueError(f"buffer {buffer.name} has no slot in the host store")
        return self.data[buffer.host_slot:buffer.host_slot + buffer.nbytes]

    def settle(self, buffer):
        """On disk: give back the memory pages wholly inside `buffer`'s slot (its data stays in the
        file). In memory: nothing to do."""
        if self.mapping is None:
            return
        start = -(-buffer.host_slot // mmap.PAGESIZE) * mmap.PAGESIZE
        end = (buffer.host_slot + buffer.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def _reserve(fd, nbytes, folder):
    """Give the file `fd` its `nbytes` on disk now: a full disk is an error naming `folder` at the
    start, not a crash when a copy first touches a page that has no room (a file system that
    cannot reserve space gets a sparse file instead)."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise OSError(e.errno, f"cannot hold a host store of {nbytes} bytes ({e.strerror})", str(folder)) from None
        os.ftruncate(fd, nbytes)
