"""Which of several CPU kernels runs a layer at a shape: measured once per machine, then kept.

Like cuDNN's find, `choose` times each candidate kernel on random fp32 data of the shape, its
batch cut to about MEASURED_ELEMENTS input values (the best of `ROUNDS` calls, after one
untimed call that also compiles it), keeps the default (the first candidate) unless another
is at least 10% faster (`pick`) in that measurement and in a second one (a shared machine's
noise that slowed the default once does not switch the shape for good; each candidate's time
kept is then its best of both), and remembers the choice: in this process, and in a JSON
file per machine, so later runs start with the same choice and do not measure again. Once
chosen, a shape's kernel never changes, so a run's results are deterministic and every
policy runs the same kernels; processes that start together (the ranks of a data-parallel
job) take turns through a lock on the file, so the first measures and the others read its
choice, and every rank runs the same kernels as a single process would. The measurement
happens at planning time, when the planner first asks for the workspace, in memory of its
own outside any run's arena. The chosen kernel's measured time, scaled to the batch
(`chosen_seconds`), is what the planner's cost model predicts for the step (as cuDNN's timed
engines are on the GPU).

`SNRT_CPU_KERNELS` overrides the choice: `measure` (the default), or a candidate's name
(`direct`, `im2col`) to run that one wherever it serves. The file is cpu-kernels.json in the
cache folder (`$SNRT_CACHE_DIR`, see choice_file.py); its entries are keyed by the CPU
model (its name, family and model numbers: `cpu_model`), so a file shared between machines (a
home directory on a cluster) keeps each model's own choices, and by `REVISION`, so that choices measured against earlier kernels are
measured again. They are not keyed by the number of threads, which would let a run with
--threads 1 compute other bits than the same run with 2 (it keeps the choice measured with
the threads of the first run).
"""

import math
import os
import platform
import time
from functools import lru_cache
from pathlib import Path

import numpy as np

from snrt.backends import choice_file
from snrt.errors import SnrtError
from snrt.layers.base import FORWARD, KernelContext, Saved

VARIABLE = "SNRT_CPU_KERNELS"
ROUNDS = 5  # timed calls of each candidate
MARGIN = 0.9  # another kernel replaces the default when it takes at most this share of its time
MEASURED_ELEMENTS = 1 << 21  # input values a measurement's batch holds, about (8 MB of fp32)
REVISION = 23  # of the kernels and the rule: raised when one changes (23: channel tiles for 1x1s with partial vectors)
_CHOSEN = {}  # this process's choices: file key, or (layer, in_shapes, phase) asked, -> entry ({"kernel", "seconds"})


def setting():
    """SNRT_CPU_KERNELS as it is now: 'measure' (the default) or the name of a kernel to force."""
    return os.environ.get(VARIABLE, "measure")


def cache_path():
    """The choices file, cpu-kernels.json in the cache folder (snrt/backends/choice_file.py)."""
    return choice_file.cache_path("cpu-kernels.json")


@lru_cache(maxsize=1)
def cpu_model():
    """The processor's name from /proc/cpuinfo (`named_cpu`), else platform's description of it."""
    try:
        named = named_cpu(Path("/proc/cpuinfo").read_text())
    except OSError:
        named = None
    return named or platform.processor() or platform.machine()


def named_cpu(cpuinfo):
    """The first processor's model name in the text of /proc/cpuinfo, with its family and model
    numbers where given, e.g. 'AMD EPYC (family 25, model 17)' (a virtual machine's name is often
    the vendor's line alone, shared by generations whose kernels time differently); None
    without a model name."""
    fields = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        fields.setdefault(name.strip(), value.strip())
    if not fields.get("model name"):
        return None
    numbers = [f"{key.split()[-1]} {fields[key]}" for key in ("cpu family", "model") if fields.get(key)]
    return fields["model name"] + (f" ({', '.join(numbers)})" if numbers else "")


def choose(layer, in_shapes, phase, candidates):
    """The name of the candidate kernel ({name: kernel}) that runs `phase` of `layer` at
    `in_shapes` (see the module docstring)."""
    return _forced(candidates) or _entry(layer, in_shapes, phase, candidates)["kernel"]


def chosen_seconds(layer, in_shapes, phase, candidates):
    """The seconds the chosen candidate took when it was measured, at `in_shapes`: its best
    time at the measured batch (`measured_shapes`) times in_shapes' batch over that batch (the
    work of a layer grows with the batch). None where SNRT_CPU_KERNELS forces a kernel (nothing
    was measured) or the entry holds no usable time for its kernel."""
    if _forced(candidates):
        return None
    entry = _entry(layer, in_shapes, phase, candidates)
    seconds = entry.get("seconds")
    value = seconds.get(entry["kernel"]) if isinstance(seconds, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        return None
    return value * in_shapes[0][0] / measured_shapes(in_shapes)[0][0]


def _forced(candidates):
    """The candidate SNRT_CPU_KERNELS names, or None when it is 'measure' (else an error)."""
    forced = setting()
    if forced in candidates:
        return forced
    if forced != "measure":
        raise SnrtError(f"environment variable {VARIABLE} is {forced!r}: expected 'measure' or one of "
                        f"{', '.join(repr(name) for name in candidates)}")
    return None


def _entry(layer, in_shapes, phase, candidates):
    """{"kernel": the chosen name, "seconds": {name: best seconds}} of `phase` of `layer` at
    `in_shapes`' measured shapes: this process's (looked up by the call's own arguments, which
    every step of a training iteration repeats), else the file's, else measured now."""
    asked = (layer, tuple(map(tuple, in_shapes)), phase)
    entry = _CHOSEN.get(asked)
    if entry is None:
        entry = _CHOSEN[asked] = _measured_entry(layer, measured_shapes(in_shapes), phase, candidates)
    return entry


def _measured_entry(layer, in_shapes, phase, candidates):
    """_entry's answer at measured shapes `in_shapes`: this process's, else the file's, else
    measured now."""
    key = f"{cpu_model()} | r{REVISION} | {layer!r} | {[list(s) for s in in_shapes]} | {phase}"
    if key not in _CHOSEN:
        def measure():
            seconds = best_seconds(candidates, layer, in_shapes, phase)
            kernel = pick(seconds)
            if kernel != next(iter(candidates)):  # leaving the default: only if a second measurement agrees
                again = best_seconds(candidates, layer, in_shapes, phase)
                kernel = kernel if pick(again) == kernel else next(iter(candidates))
                seconds = {name: min(seconds[name], again[name]) for name in seconds}
            return {"kernel": kernel, "seconds": seconds}

        _CHOSEN[key] = choice_file.remembered(cache_path(), key, lambda entry: entry.get("kernel") in candidates,
                                              measure)
    return _CHOSEN[key]


def measured_shapes(in_shapes):
    """`in_shapes` with the batch cut to the samples whose first input holds about
    MEASURED_ELEMENTS values (at least one sample): the choice for a bigger batch is the one
    measured at that batch, so that a search over batch sizes measures each layer once, in
    bounded time and memory."""
    per_sample = max(1, math.prod(in_shapes[0][1:]))
    batch = max(1, min(in_shapes[0][0], MEASURED_ELEMENTS // per_sample))
    return [(batch, *shape[1:]) for shape in in_shapes]


def best_seconds(candidates, layer, in_shapes, phase):
    """{name: best seconds} of each candidate over ROUNDS rounds. A round calls each candidate
    once, in turn, on the same random fp32 data; one untimed round first (it also compiles),
    so that each candidate runs after the others as it will in a network."""
    calls = {name: _call(kernel, layer, in_shapes, phase) for name, kernel in candidates.items()}
    best = dict.fromkeys(calls, float("inf"))
    for round_ in range(ROUNDS + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            if round_:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def pick(seconds):
    """The first candidate of `seconds` ({name: seconds}, the default first), unless another
    took at most MARGIN of its time: a near tie, within what a shared machine's noise and a
    network's cold caches move, keeps the default."""
    default = next(iter(seconds))
    best = min(seconds, key=seconds.get)
    return best if seconds[best] <= MARGIN * seconds[default] else default


def _call(kernel, layer, in_shapes, phase):
    """A function that runs `kernel`'s `phase` on random fp32 data of `in_shapes`."""
    rng = np.random.default_rng(0)

    def array(shape):
        return rng.standard_normal(shape, dtype=np.float32)

    xs = [array(shape) for shape in in_shapes]
    params = {name: array(spec.shape) for name, spec in layer.param_specs(in_shapes).items()}
    out_shape = layer.infer_shape(in_shapes)
    ctx = KernelContext(np, True, 0, 0, 0, np.empty(kernel.workspace_bytes(in_shapes, phase), np.uint8))
    if phase == FORWARD:
        y = np.empty(out_shape, np.float32)
        return lambda: kernel.forward(ctx, xs, params, {}, y, {})
    gy, gxs = array(out_shape), [np.empty_like(x) for x in xs]
    gparams = {name: np.empty_like(value) for name, value in params.items()}
    saved = Saved(xs=xs, y=None)
    return lambda: kernel.backward(ctx, gy, saved, params, {}, gxs, gparams)
