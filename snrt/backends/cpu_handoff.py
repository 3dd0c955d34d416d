"""The kernel threads' pool: a worker that watches for its next share before it sleeps.

A thread asleep on a lock takes tens of µs to wake, and a CIFAR ResNet-110 b32 iteration makes
about 500 hand-offs (its convolutions' kernels). So a worker, having finished a share, first
watches a counter of its own (`seq`) for about `SPIN_SECONDS`, in compiled code that holds no
GIL; only then does it sleep on an Event. The caller likewise watches the worker's `done`
counter before it sleeps. Measured here (2 vCPUs), a run_split of an empty kernel on two
threads: 14 µs best, 42 median (89 median through a ThreadPoolExecutor); what is left is
mostly the GIL, which the worker needs to start its share and which the caller holds until
it enters its own. A CIFAR ResNet-110 b32 iteration: 2% faster, the two alternating in one
process.

The counters are int64 slots of one array, each on a cache line of its own, read and written
with acquire / release ordering (LLVM atomics through numba intrinsics), so that what a thread
wrote before a store is seen by the thread that loads the new value.
"""

import os
import threading
import time

import numpy as np
from numba import njit, types
from numba.extending import intrinsic

SLOT = 8  # int64s between two counters: 64 bytes, a cache line each
SPIN_SECONDS = 200e-6  # how long a thread watches a counter before it sleeps


def _slot_pointer(context, builder, signature, args):
    array = context.make_array(signature.args[0])(context, builder, args[0])
    return builder.gep(array.data, [args[1]])


@intrinsic
def load_acquire(typingctx, counters, index):
    """counters[index] (a C-contiguous int64 array), an atomic load with acquire ordering."""
    if counters.dtype != types.int64 or counters.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_slot_pointer(context, builder, signature, args), "acquire", 8)

    return types.int64(counters, types.intp), codegen


@intrinsic
def store_release(typingctx, counters, index, value):
    """counters[index] = value, an atomic store with release ordering."""
    if counters.dtype != types.int64 or counters.layout != "C":
        return None

    def codegen(context, builder, signature, args):
        value = context.cast(builder, args[2], signature.args[2], types.int64)
        builder.store_atomic(value, _slot_pointer(context, builder, signature, args), "release", 8)
        return context.get_dummy_value()

    return types.void(counters, types.intp, types.int64), codegen


@njit(cache=True, nogil=True)
def watch(counters, index, seen, checks):
    """counters[index] once it differs from `seen`, or `seen` after `checks` loads that found it
    unchanged (no GIL held)."""
    for _ in range(checks):
        value = load_acquire(counters, index)
        if value != seen:
            return value
    return seen


@njit(cache=True, nogil=True)
def publish(counters, index, value):
    """counters[index] = value (release), without the GIL."""
    store_release(counters, index, value)


@njit(cache=True, nogil=True)
def current(counters, index):
    """counters[index] (acquire)."""
    return load_acquire(counters, index)


def _checks_per_second():
    """Loads `watch` makes in a second on this machine (timed once, over about a millisecond)."""
    counters = np.zeros(SLOT, np.int64)
    watch(counters, 0, 0, 10)  # compiled (or loaded from the cache) outside the timing
    checks = 1 << 16
    while True:
        start = time.perf_counter()
        watch(counters, 0, 0, checks)
        elapsed = time.perf_counter() - start
        if elapsed > 1e-3 or checks > 1 << 30:
            return checks / max(elapsed, 1e-9)
        checks *= 4


class HandOffPool:
    """`workers` daemon threads that run the shares of run_split (cpu_common) handed to them.
    Worker w waits for counters[seq(w)] to change, runs tasks[w], stores its error (or None) in
    errors[w] and counters[done(w)] = the task's number."""

    def __init__(self, workers):
        self.counters = np.zeros(2 * workers * SLOT, np.int64)
        self.tasks, self.errors = [None] * workers, [None] * workers
        self.wake = [threading.Event() for _ in range(workers)]
        self.finished = [threading.Event() for _ in range(workers)]
        self.number = 0  # of the last task handed out
        self.checks = max(1, int(SPIN_SECONDS * _checks_per_second()))
        for w in range(workers):
            threading.Thread(target=self._work, args=(w,), name=f"snrt-kernel-{w}", daemon=True).start()

    @staticmethod
    def _seq(w):
        return 2 * w * SLOT

    @staticmethod
    def _done(w):
        return (2 * w + 1) * SLOT

    def _work(self, w):
        seen = 0
        while True:
            number = watch(self.counters, self._seq(w), seen, self.checks)
            if number == seen:  # nothing for a while: sleep until woken (clear, then look once more)
                self.wake[w].clear()
                if current(self.counters, self._seq(w)) == seen:
                    self.wake[w].wait()
                continue
            seen = number
            function, args = self.tasks[w]
            self.tasks[w] = None
            try:
                function(*args)
                self.errors[w] = None
            except BaseException as e:  # noqa: BLE001 - raised by the caller of run
                self.errors[w] = e
            publish(self.counters, self._done(w), number)
            self.finished[w].set()

    def run(self, function, calls):
        """function(*calls[0]) on this thread while worker w runs function(*calls[w + 1]);
        returns when all are done, raising this thread's error, else the first worker's."""
        self.number += 1
        others = range(len(calls) - 1)
        for w in others:
            self.finished[w].clear()
            self.tasks[w] = (function, calls[w + 1])
            publish(self.counters, self._seq(w), self.number)
            self.wake[w].set()
        try:
            function(*calls[0])
        finally:
            for w in others:  # no share still runs when this returns or raises
                while watch(self.counters, self._done(w), self.number - 1, self.checks) != self.number:
                    self.finished[w].wait()
                    self.finished[w].clear()
        for w in others:
            if self.errors[w] is not None:
                raise self.errors[w]


_POOLS = {}  # (process id, calling thread, workers): its pool (a forked child makes its own)


def pool(workers):
    """The calling thread's HandOffPool of `workers` threads: one pool serves one caller at a
    time (ranks run as threads of one process split at the same time, each with its own)."""
    key = (os.getpid(), threading.get_ident(), workers)
    return _POOLS.get(key) or _POOLS.setdefault(key, HandOffPool(workers))
