"""What the CPU's compiled kernels share: numba's options (`COMPILED`, `THREADED`), the kernel
threads (`run_split`, `no_arguments_per_thread`, `fitting_threads`) and `LayerLike`, the base
that makes a kernel stand in for its layer.

Kernel threads: the calling thread and `snrt.threads.kernel_threads() - 1` workers per process,
each running compiled code that releases the GIL (`THREADED`). A worker that has run a share
keeps looking for the next one (`POLLS` looks, yielding the processor between them, some
milliseconds) before it sleeps: a hand-off then costs about 10 µs where waking a sleeping
thread cost about 70 (an empty run_split on this project's 2-core machine), which is what
lets the memory-bound kernels split from 2^19 values. A kernel splits its work so that every
output value is one thread's, computed in an order fixed by the compiled code: results do not
depend on the number of threads.
"""

import os
import threading

import llvmlite.binding as llvm
import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from snrt.layers.base import FLOAT32_BYTES
from snrt.threads import kernel_threads

# reassociation lets numba vectorize a sum, in one order fixed by the compiled code (the same
# bits every run); contraction fuses multiply-adds. Nothing that changes NaN or inf handling.
FASTMATH = {"reassoc", "contract"}
# The options of every compiled loop: cached machine code, the flags above, and NumPy's error
# model, under which a division by zero gives inf or NaN as NumPy's does (no raised error:
# without it every division carries a zero test and no loop with one vectorizes).
COMPILED = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy"}
THREADED = dict(COMPILED, nogil=True)  # for kernels that run on the kernel threads

_POOL = {}  # (process id, workers): (a lock held while a call uses them, the _Worker threads); per process
POLLS = 4000  # looks for its next share an idle worker takes (a yield between looks, about 2 ms) before it sleeps


@intrinsic
def _sched_yield(typingctx):
    """The C library's sched_yield(): the processor to any other runnable thread, if any (a
    no-op where the process has no such function)."""
    def codegen(context, builder, signature, args):
        if llvm.address_of_symbol("sched_yield") is None:
            return context.get_dummy_value()
        function = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []), "sched_yield")
        builder.call(function, [])
        return context.get_dummy_value()
    return types.void(), codegen


@njit(nogil=True, cache=True)
def _poll(flags, index, old, polls):
    """flags[index] once it differs from `old`, looked at up to `polls` times with the processor
    yielded to any other runnable thread in between (without the GIL); `old` if it never did."""
    for _ in range(polls):
        value = flags[index]
        if value != old:
            return value
        _sched_yield()
    return old


class _Worker:
    """A kernel thread: it runs the shares run_split hands it. After a share it keeps looking
    for the next one for a while (POLLS), so that a hand-off in the middle of an iteration costs
    a few µs where waking a sleeping thread costs tens, then sleeps until woken."""

    def __init__(self):
        self.flags = np.zeros(2, np.int64)  # [the last share's number, the last finished one's]
        self.share, self.error, self.sleeping = None, None, False
        self.wake = threading.Semaphore(0)
        threading.Thread(target=self._serve, name="snrt-kernel", daemon=True).start()

    def start(self, function, args):
        self.share, self.error = (function, args), None
        self.flags[0] += 1
        if self.sleeping:  # woken at most once more than needed: it then looks again and sleeps
            self.sleeping = False
            self.wake.release()

    def join(self):
        """Wait until the share ends; its error, or None."""
        while self.flags[1] != self.flags[0]:
            _poll(self.flags, 1, self.flags[1], POLLS)
        return self.error

    def _serve(self):
        seen = 0
        while True:
            number = _poll(self.flags, 0, seen, POLLS)
            if number == seen:
                self.sleeping = True
                if self.flags[0] == seen:  # no share started before it said so
                    self.wake.acquire()
                self.sleeping = False
                continue
            seen = number
            function, args = self.share
            try:
                function(*args)
            except BaseException as error:  # noqa: B036 (handed to the caller)
                self.error = error
            self.flags[1] = number


def run_split(function, start, stop, per_thread_args, shared_args):
    """function(*shared_args, r0, r1, *per_thread_args[t]) for thread t's even share [r0, r1)
    of range(start, stop), on the kernel threads: share 0 on the calling thread while the pool's
    threads run the others (so the caller does not wait idle for its own), or every share on the
    calling thread, one after the other, while another thread of the process (a rank run as a
    thread) uses the pool; returns when all are done (raising the caller's error, else the first
    of the others')."""
    threads = len(per_thread_args)
    bounds = [start + (stop - start) * t // threads for t in range(threads + 1)]
    calls = [(*shared_args, bounds[t], bounds[t + 1], *per_thread_args[t]) for t in range(threads)]
    if threads == 1:
        function(*calls[0])
        return
    key = (os.getpid(), threads - 1)
    busy, workers = _POOL.get(key) or _POOL.setdefault(key, (threading.Lock(), [_Worker() for _ in range(threads - 1)]))
    if not busy.acquire(blocking=False):  # another thread of this process has the workers: the shares in turn here
        for call in calls:
            function(*call)
        return
    try:
        for worker, call in zip(workers, calls[1:]):
            worker.start(function, call)
        try:
            function(*calls[0])
        finally:
            errors = [worker.join() for worker in workers]  # no share still runs when this returns or raises
    finally:
        busy.release()
    for error in errors:
        if error is not None:
            raise error


def no_arguments_per_thread(values, minimum):
    """[()] for each thread a kernel without per-thread arguments runs on: the kernel threads
    when it covers at least `minimum` values, else one (a hand-off costs about 10 µs)."""
    return [()] * (kernel_threads() if values >= minimum else 1)


def fitting_threads(workspace_bytes, bytes_for):
    """The kernel threads, fewer if a planned workspace of `workspace_bytes` was sized for fewer
    (threads limited after planning): the most for which bytes_for(threads) fits."""
    threads = kernel_threads()
    while threads > 1 and bytes_for(threads) > workspace_bytes:
        threads -= 1
    return threads


class LayerLike:
    """Base of the compiled kernels: what a kernel does not define (its facts: shapes, specs,
    saves; and a forward or backward it leaves to the layer) is the layer's, its workspace
    included (a kernel may run the layer's own code for some calls, eval mode say); a kernel
    that never does says what it needs. The planner reserves what the kernel says."""

    name = "numba"

    @staticmethod
    def serves(layer, in_shapes):
        """Whether this kernel runs `layer` at `in_shapes` (else the next one asked, or the layer)."""
        return True

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.layer.workspace_bytes(in_shapes, phase, itemsize)
