"""The kernel threads: `run_split` runs the shares of a compiled kernel at once, in one
parallel loop compiled with numba (`parallel=True`, its OpenMP or TBB threading layer).

A hand-off takes no Python and no GIL: a run_split of an empty kernel on two threads takes
about 3.6 µs here (best of runs; 1.6 on one thread), where a pool of Python threads that each took
the GIL to start its share and to report its end took 48, which made splitting a tensor of
under 2^20 values slower than running it on one thread. A kernel splits its work so that every output value is one
share's, computed in an order fixed by the compiled code: results do not depend on the number
of threads, nor on which thread ran a share.

One launcher (`_launch`) serves every kernel: each kernel is passed as a value of a numba type
of its own (`KernelType`, named by the kernel's module, name, source file's stamp and, for a
kernel a factory made, the constants it closes over), so the
launcher is compiled once per kernel and argument types and cached on disk like the kernels;
a dispatcher passed as it is would be typed by its identity, which no other process can load.

Where no thread-safe threading layer loads, and in a process forked from one that ran a
parallel loop (GNU OpenMP cannot start one there), the shares run one after the other on the
calling thread: the same bits, slower.
"""

import os
import sys

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import NativeValue, models, overload, register_model, unbox

from snrt.backends import compiled_cache  # noqa: F401  (numba's cache emptied where a compiled source changed)

if numba.config.THREADING_LAYER == "default":  # not the user's choice: one that ranks run as threads may share
    numba.config.THREADING_LAYER = "threadsafe"
# GNU OpenMP's threads spin about 300,000 pauses (milliseconds) after a loop before they sleep,
# taking a core from BLAS's threads and the copy streams; 20,000 is about 0.2 ms here. Read when
# the library loads, so it applies unless something loaded it first.
os.environ.setdefault("GOMP_SPINCOUNT", "20000")

_STATE = {"parallel": True, "launched": False}  # whether shares may run at once; whether some did


def _forked():
    """In a child forked after a parallel loop ran: shares one after the other from now on."""
    if _STATE["launched"]:
        _STATE["parallel"] = False


if hasattr(os, "register_at_fork"):  # not on Windows, which has no fork
    os.register_at_fork(after_in_child=_forked)


class KernelType(types.Type):
    """The numba type of one Kernel: the launcher compiled for it calls that kernel."""

    def __init__(self, name):
        self.kernel_name = name
        super().__init__(name=f"Kernel({name})")


class Kernel:
    """A compiled kernel as the launcher's argument: its name is its numba type's, which it
    carries as `_numba_type_` (numba's dispatcher reads that without calling back into Python:
    0.7 us a call against 2.6 through a registered typeof)."""

    def __init__(self, name):
        self.name = name
        self._numba_type_ = KernelType(name)


register_model(KernelType)(models.OpaqueModel)
_KERNELS = {}  # name: the compiled kernel
_TAGS = {}  # the compiled kernel: its Kernel


@unbox(KernelType)
def _unbox_kernel(typ, obj, c):
    return NativeValue(c.context.get_dummy_value())


def _tag(function):
    """function's Kernel, named by its module, qualified name, first line, its source file's
    size and modification time (a changed file names a new type, so the launcher is compiled
    anew) and, for a kernel made by a factory (a closure), the constants it closes over: the
    launcher compiled for a name is cached on disk and loaded by any process that names a
    kernel so, so no two kernels may share a name."""
    tag = _TAGS.get(function)
    if tag is None:
        code = function.py_func.__code__
        try:
            stat = os.stat(code.co_filename)
            stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
        except OSError:
            stamp = "?"
        name = f"{function.py_func.__module__}.{function.py_func.__qualname__}:{code.co_firstlineno}:{stamp}"
        cells = function.py_func.__closure__ or ()
        if cells:
            name += f"[{', '.join(_constant(cell.cell_contents, name) for cell in cells)}]"
        if _KERNELS.get(name, function) is not function:
            raise ValueError(f"two kernels are named {name}: the cached launcher of one would run the other")
        _KERNELS[name] = function
        tag = _TAGS[function] = Kernel(name)
    return tag


def _constant(value, name):
    """repr of `value`, a constant a kernel closes over (a number, string or tuple of them)."""
    if isinstance(value, tuple):
        return f"({', '.join(_constant(v, name) for v in value)},)"
    if isinstance(value, (bool, int, float, str, np.number)):
        return repr(value)
    raise TypeError(f"kernel {name} closes over {type(value).__name__}: only numbers, strings and tuples of them "
                    "name a kernel the same way in every process")


def call(kernel, args):
    """kernel's function(*args) (compiled only)."""


@overload(call)
def _call(kernel, args):
    function = _KERNELS[kernel.kernel_name]
    return lambda kernel, args: function(*args)


def thread_rows(arrays, t):
    """(arrays[0][t], arrays[1][t], ...): thread t's rows of per-thread arrays (compiled only)."""


@overload(thread_rows)
def _thread_rows(arrays, t):
    if len(arrays) == 0:
        return lambda arrays, t: ()
    return lambda arrays, t: (arrays[0][t],) + thread_rows(arrays[1:], t)


@njit(parallel=True, nogil=True, cache=True)
def _launch(kernel, bounds, shared_args, per_thread):
    """kernel(*shared_args, bounds[t], bounds[t + 1], *thread t's rows of per_thread) for every
    t at once."""
    for t in prange(bounds.size - 1):
        call(kernel, shared_args + (bounds[t], bounds[t + 1]) + thread_rows(per_thread, t))


def run_split(function, start, stop, threads, shared_args, per_thread=()):
    """function(*shared_args, r0, r1, *(a[t] for a in per_thread)) for each thread t < threads
    over its even share [r0, r1) of range(start, stop), at once on the kernel threads; returns
    when all are done. `function` is compiled (numba, nogil); `per_thread`: arrays whose first
    axis holds each thread's own scratch."""
    bounds = np.array([start + (stop - start) * t // threads for t in range(threads + 1)], np.int64)
    if threads > 1 and _STATE["parallel"]:
        team = min(threads, numba.config.NUMBA_NUM_THREADS)
        if numba.get_num_threads() != team:  # numba's count is per calling thread
            numba.set_num_threads(team)
        try:
            _launch(_tag(function), bounds, tuple(shared_args), tuple(per_thread))
            _STATE["launched"] = True
            return
        except ValueError as e:  # no thread-safe threading layer loads here
            if "threading layer" not in str(e):
                raise
            print(f"snrt: {e.args[0].splitlines()[0]}; the CPU kernels run on one thread", file=sys.stderr)
            _STATE["parallel"] = False
    for t in range(threads):
        function(*shared_args, bounds[t], bounds[t + 1], *(a[t] for a in per_thread))
