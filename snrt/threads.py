"""Thread pools: how many threads the CPU kernels use, set explicitly rather than guessed.

A CPU run uses two pools: BLAS's (numpy's OpenBLAS, for the GEMMs of Conv2d and Linear) and
the kernel threads of snrt's direct convolution (snrt/backends/cpu_conv.py; the other
compiled kernels are serial, and each copy stream is one thread), sized by
`kernel_threads()`. A BLAS library sizes its pool by the cores it sees, which is wrong in a
container with a CPU quota (it sees the host's cores) and when two runs share a machine;
more threads than cores then take turns and every GEMM slows down. `usable_cores()` counts
the cores this process may really use (its CPU affinity and its cgroup's CPU quota), and
`limit_threads(n)` caps every BLAS and OpenMP pool loaded in the process at n, through
threadpoolctl (which also finds the pools a library like scipy or torch brings along), and
snrt's kernel threads with them.
"""

import math
import multiprocessing
import os
import warnings
from pathlib import Path

from threadpoolctl import threadpool_info, threadpool_limits

from snrt.errors import SnrtError
from snrt.units import is_count

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root=CGROUP):
    """Cores allowed by the cgroup's CPU quota (a float), or None when there is none.

    Reads cgroup v2's `cpu.max` ("QUOTA PERIOD" or "max PERIOD") or, failing that, cgroup
    v1's `cpu/cpu.cfs_quota_us` and `cpu/cpu.cfs_period_us` (quota -1: none).
    """
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def usable_cores(root=CGROUP):
    """The cores this process may use: its CPU affinity, capped by the cgroup's quota (rounded
    up, at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


POOL_VARIABLES = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
MAX_THREADS = 4096  # more threads than this is a typo (the kernels' workspace grows with them)
_LIMIT = []  # [the count of the last limit_threads call], or [] before any


def kernel_threads():
    """Threads for snrt's own threaded CPU kernels: the count of the last `limit_threads`
    call, else this process's usable cores (counted once)."""
    if not _LIMIT:
        _LIMIT.append(usable_cores())
    return _LIMIT[0]


def limit_threads(count):
    """Cap every BLAS and OpenMP pool in this process at `count` threads, for the rest of the
    process: the pools loaded now through threadpoolctl, those a library loads later (numba
    loads scipy's OpenBLAS on its first compile) through the variables they read when they
    load. Returns `thread_pools()` after the change; a count that is not a positive int, or is
    over MAX_THREADS, is a SnrtError, and changes nothing."""
    if not is_count(count):
        raise SnrtError(f"limit_threads: expected a positive int, got {count!r}")
    if count > MAX_THREADS:
        raise SnrtError(f"limit_threads: expected at most {MAX_THREADS} threads, got {count}")
    _LIMIT[:] = [count]
    for variable in POOL_VARIABLES:
        os.environ[variable] = str(count)
    threadpool_limits(limits=count)
    return thread_pools()


def thread_pools():
    """[(library, threads), ...] of the thread pools loaded in this process, e.g.
    [("openblas", 2)]."""
    return [(pool["internal_api"], pool["num_threads"]) for pool in threadpool_info()]


def describe_pools(pools):
    """'openblas 2 threads' style text of `thread_pools()`'s answer ('none' when empty)."""
    return ", ".join(f"{name} {n} thread{'s' if n != 1 else ''}" for name, n in pools) or "none"


class Claims:
    """`groups` (lists of work items) that this process and a forked one (`in_a_child`) take
    turns to claim, each group once: iterating yields the groups not yet claimed by either."""

    def __init__(self, groups):
        self.groups = groups
        self.claimed = multiprocessing.get_context("fork").Value("i", 0)  # shared across the fork

    def __iter__(self):
        while True:
            with self.claimed.get_lock():
                k = self.claimed.value
                self.claimed.value = k + 1
            if k >= len(self.groups):
                return
            yield self.groups[k]


def in_a_child(work):
    """Run `work()` (its result must pickle) in a forked process while this one goes on; returns
    a function that waits for the result and returns it (or raises the child's error)."""
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def child():
        try:
            send.send(("result", work()))
        except BaseException as e:  # noqa: BLE001 - handed to the parent, which raises it
            send.send(("error", e))
        finally:  # no exit handlers or stream flushes: a lock another thread held at the fork would hang them
            os._exit(0)

    process = context.Process(target=child, daemon=True)
    process.start()
    send.close()

    def result():
        try:
            kind, value = receive.recv()
        except EOFError:
            raise SnrtError("planning in a second process failed: it ended without a result (out of memory?)") from None
        finally:
            process.join()
        if kind == "error":
            raise value
        return value
    return result


class BlasSpinWarning(UserWarning):
    """OpenBLAS was loaded before snrt could shorten its threads' spin (numpy came first)."""


_WARNED = []


def warn_if_blas_spins():
    """Warn once when numpy (and so OpenBLAS, with threads) was imported before snrt with no
    OPENBLAS_THREAD_TIMEOUT set: its threads then spin about 0.1 s after every matrix product,
    holding the cores snrt's kernel threads need (a CIFAR ResNet-110 iteration measured 2.6x
    slower so on 2 cores, results/blas_timeout.md)."""
    import snrt

    if _WARNED or not snrt.BLAS_LOADED_FIRST:  # the usual case: no look at the pools (threadpoolctl takes ms)
        return
    if not any(p.get("internal_api") == "openblas" and p.get("num_threads", 1) > 1 for p in threadpool_info()):
        return
    _WARNED.append(True)
    warnings.warn("numpy was imported before snrt, so OpenBLAS's threads spin for about 0.1 s after every matrix "
                  "product and hold the cores snrt's CPU kernels need (training can run several times slower): "
                  "import snrt before numpy, or set OPENBLAS_THREAD_TIMEOUT=16 in the environment",
                  BlasSpinWarning, stacklevel=3)
