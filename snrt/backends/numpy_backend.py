"""The CPU backend: the device arena is one NumPy buffer with a hard capacity (on Linux in
transparent huge pages, `zeroed_memory`), the host store another (or a memory-mapped file on
disk: `host_folder`), and the device-to-host and host-to-device streams are worker threads."""

import mmap

import numpy as np

from snrt.backends.base import Backend
from snrt.backends.cpu_cast import add_into, convert
from snrt.backends.cpu_conv import describe_choices
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.backends.streams import CopyStream
from snrt.precision import DEFAULT as DEFAULT_PRECISION
from snrt.memory.arena import Arena
from snrt.memory.host import HostStore
from snrt.scheduler import cost
from snrt.threads import warn_if_blas_spins


INLINE_COPY_BYTES = 64 * 1024  # copies this small run on the compute thread (see CopyStream.submit)
HUGE_PAGE_BYTES = 2 << 20  # arenas from this size ask for transparent huge pages


def zeroed_memory(nbytes):
    """`nbytes` of zeros as a uint8 array for the arena: an anonymous mapping (zeroed by the
    kernel, as np.zeros's calloc is) that Linux is asked to back with transparent huge pages
    (MADV_HUGEPAGE; under the common 'madvise' setting only memory that asks gets them): every
    step of a plan reads and writes a different part of a 0.3-2 GB arena, which 2 MB pages
    cover with 512x fewer TLB entries than 4 KB ones. On the 2-core reference machine
    (`scripts/compare_speed.py --before <without> cifar_resnet110 32 32 --rounds 5 --policies
    none liveness --no-torch`) none took +1% and liveness -10% an iteration, within or near
    that machine's noise. np.zeros where the platform has no such advice."""
    if nbytes < HUGE_PAGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.zeros(max(nbytes, 1), dtype=np.uint8)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mapping.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(mapping, dtype=np.uint8)  # the array keeps the mapping alive


class NumpyBackend(Backend):
    """NumPy arrays stand in for device memory; kernels (the layers' own, or a compiled one
    from cpu_kernels.py) run on the calling thread."""

    name = "cpu"
    xp = np
    cost_model = cost.CPU
    precisions = ("fp32", "tf32", "bf16", "fp16")  # no TF32 on a CPU: fp32 math; 2 bytes staged (snrt/layers/staging.py)

    @classmethod
    def kernel_choice(cls, precision=DEFAULT_PRECISION, deterministic=True):
        return CPU_KERNELS  # one for every precision (2-byte tensors staged in fp32), always deterministic

    def __init__(self, arena_bytes, host_bytes=0, check=False, kernels=None, host_folder=None):
        super().__init__(arena_bytes, host_bytes, check, kernels)
        warn_if_blas_spins()
        self.arena = Arena(np, arena_bytes, check=check, data=zeroed_memory(arena_bytes))
        self.host = (HostStore.on_disk(host_bytes, host_folder) if host_folder
                     else HostStore(np.zeros(host_bytes, dtype=np.uint8)))
        self.to_host_stream = CopyStream("d2h", lazy=check)
        self.to_device_stream = CopyStream("h2d", lazy=check)

    def describe_kernels(self, executor):
        """Which dense convolutions run the direct kernel (cpu_conv.describe_choices)."""
        return describe_choices(executor)

    def offload(self, buffer):
        source, target, host = self.arena.bytes_of(buffer), self.host.slot(buffer), self.host

        def copy():
            np.copyto(target, source)
            host.settle(buffer)
        return self.to_host_stream.submit(copy, inline=buffer.nbytes <= INLINE_COPY_BYTES)

    def prefetch(self, buffer, source):
        data, target, host = self.host.slot(source), self.arena.bytes_of(buffer), self.host

        def copy():
            np.copyto(target, data)
            host.settle(source)
        return self.to_device_stream.submit(copy, inline=source.nbytes <= INLINE_COPY_BYTES)

    def to_host(self, array):
        return np.array(array, copy=True)

    def accumulate(self, total, part):
        add_into(total, part)

    def convert(self, out, array):
        convert(out, array)

    def upload(self, view, array):
        convert(view, np.asarray(array))

    def close(self):
        """Stop the copy threads."""
        self.to_host_stream.close()
        self.to_device_stream.close()
