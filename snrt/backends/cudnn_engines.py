"""Which cuDNN engine runs a graph: timed once per device and cuDNN version, then kept.

cuDNN's heuristics rank the engines that can run a graph (modes A, then FALLBACK); the first
of that list is a guess. As PyTorch's `cudnn.benchmark` does, `select` builds the ranked
engines that pass the context's filters (deterministic ones only, unless the run is not
deterministic; TF32 tensor-core ones only in tf32) and fit the workspace limit, the first
MAX_CANDIDATES of them, has each timed (the context runs it on temporary device buffers of
the graph's shapes: one untimed call, then the best of ROUNDS between CUDA events), and
selects the fastest. Its name is kept in
cudnn-engines.json in the cache folder (snrt/backends/choice_file.py), keyed by the device,
the cuDNN and frontend versions, the graph (operation, shapes, options), the workspace limit
and the filters: a later run finds the engine by its name among the ranked ones and builds
that one alone, timing nothing, so it starts at full speed and computes the same bits. An
engine that is no longer offered (another cuDNN ranks others) is timed again.

Timing happens at planning time, when the planner asks a kernel for its workspace, before a
run's arena exists. A graph built while a step runs (a plan whose workspace is smaller than
the planned engine's) is not timed: it gets the kept engine if that fits, else cuDNN's first.
The workspace the kernel asks the planner for is the selected engine's, and its measured
seconds stay with the graph.

Some operations have an alternative to cuDNN (1x1 convolutions by cuBLAS GEMMs, BatchNorm by
snrt's CUDA kernels): `faster` times it against the graph's timed engine at planning time and
keeps whichever ran faster, in the same file.

`SNRT_CUDNN_ENGINES` sets the choice: `measure` (the default) or `heuristic` (cuDNN's first
engine that builds and fits, as before engines were timed; nothing is timed or kept).
"""

import math
import os
from dataclasses import dataclass

from snrt.backends import choice_file
from snrt.errors import SnrtError

VARIABLE = "SNRT_CUDNN_ENGINES"
SETTINGS = ("measure", "heuristic")
CACHE_FILE = "cudnn-engines.json"
MAX_CANDIDATES = 8  # ranked engines built and timed per graph, at most
ROUNDS = 5  # timed calls of each engine, after one untimed call


class NoEngineError(SnrtError):
    """cuDNN ranked no engine that builds within the workspace limit."""


def setting():
    """SNRT_CUDNN_ENGINES as it is now; anything but a known value is a SnrtError."""
    value = os.environ.get(VARIABLE, "measure")
    if value not in SETTINGS:
        raise SnrtError(f"environment variable {VARIABLE} is {value!r}: expected one of "
                        f"{', '.join(repr(s) for s in SETTINGS)}")
    return value


@dataclass(frozen=True)
class Engine:
    """One ranked plan of a graph: its position in cuDNN's list, name and workspace need."""

    index: int
    name: str
    workspace_bytes: int


def _built(graph, index, limit):
    """The Engine at `index` built (and selected), or None when a filter bars it, cuDNN
    declines it, or it needs more than `limit` workspace bytes (None: any)."""
    try:
        graph.build_plan_at_index(index)
        engine = Engine(index, graph.get_plan_name_at_index(index), int(graph.get_workspace_size_plan_at_index(index)))
    except Exception:  # barred by a note or workspace filter, or declined: the next one
        return None
    return engine if limit is None or engine.workspace_bytes <= limit else None


def candidates(graph, limit, most=None):
    """The first `most` (default MAX_CANDIDATES) Engines of `graph`'s ranked list (execution
    plans created, filters set) that build within `limit` workspace bytes, in cuDNN's order;
    a NoEngineError when none does."""
    most = MAX_CANDIDATES if most is None else most
    found = []
    for index in range(graph.get_execution_plan_count()):
        engine = _built(graph, index, limit)
        if engine is not None:
            found.append(engine)
            if len(found) == most:
                break
    if not found:
        raise NoEngineError(f"no cuDNN engine builds within {limit} workspace bytes")
    return found


def named(graph, name, limit):
    """The Engine called `name` in `graph`'s ranked list, built, or None when none of that
    name builds within `limit` workspace bytes."""
    for index in range(graph.get_execution_plan_count()):
        try:
            matches = graph.get_plan_name_at_index(index) == name
        except Exception:
            continue
        if matches:
            return _built(graph, index, limit)
    return None


def _kept(graph, entry, limit):
    """(Engine, seconds) of a choices file's entry when its engine still builds within
    `limit`, else (None, None)."""
    if not isinstance(entry, dict):
        return None, None
    engine = named(graph, entry.get("engine"), limit)
    seconds = entry.get("seconds")
    return engine, (seconds.get(engine.name) if engine is not None and isinstance(seconds, dict) else None)


def _fastest(graph, limit, time_engines):
    """(Engine, seconds, entry to keep): the fastest of the candidates as `time_engines`
    times them; cuDNN's first and no entry when they could not be timed."""
    found = candidates(graph, limit)
    seconds = time_engines(graph, found)
    if seconds is None or min(seconds) == math.inf:  # not timed, or none of them ran
        return found[0], None, None
    best = min(range(len(found)), key=seconds.__getitem__)
    return found[best], seconds[best], {"engine": found[best].name,
                                        "seconds": {e.name: s for e, s in zip(found, seconds)}}


TIMED, KEPT, FIRST = "timed now", "kept from before", "cuDNN's first"  # how an engine was chosen


def select(graph, key, limit, time_engines=None):
    """Build and select `graph`'s engine; returns (Engine, its measured seconds or None, how
    it was chosen: TIMED, KEPT or FIRST).

    `key` names the graph in the choices file; `limit` bounds the workspace (None: any);
    `time_engines(graph, engines)` returns each Engine's best seconds, in order (infinity for
    one that failed to run), or None when they could not be timed (no device memory to
    spare). Without it (a graph built while a step runs) the kept engine is used when it
    fits, else cuDNN's first, and nothing is kept. A NoEngineError when nothing builds
    within the limit."""
    path = choice_file.cache_path(CACHE_FILE)
    if setting() == "heuristic":
        engine, seconds, how = candidates(graph, limit, most=1)[0], None, FIRST
    elif time_engines is None:
        engine, seconds = _kept(graph, choice_file.read(path).get(key), limit)
        how = KEPT
        if engine is None:
            engine, how = candidates(graph, limit, most=1)[0], FIRST
    else:
        chosen = {}

        def usable(entry):
            chosen["kept"] = (*_kept(graph, entry, limit), KEPT)
            return chosen["kept"][0] is not None

        def measure():
            engine, seconds, entry = _fastest(graph, limit, time_engines)
            chosen["kept"] = engine, seconds, TIMED if entry is not None else FIRST
            return entry

        choice_file.remembered(path, key, usable, measure)
        engine, seconds, how = chosen["kept"]
    graph.build_plan_at_index(engine.index)  # select it (building others selected them in turn)
    return engine, seconds, how


def faster(graph, alternative, key, timed):
    """`alternative` when it runs the operation of `graph` (a built cuDNN graph, its engine
    chosen) faster, else `graph`. An alternative (cuBLAS GEMMs, snrt's CUDA kernels) has a
    `name`, `time()` (its best seconds on temporary buffers, or None without the memory) and
    `seconds` and `chosen`, set here when it is taken.

    `key` names the pair in the choices file. `timed` (at planning time): the kept choice,
    else both timed now and the choice kept; an alternative is only chosen over an engine
    that was timed. Untimed (a graph built while a step runs): the kept choice, or `graph`."""
    path = choice_file.cache_path(CACHE_FILE)

    def usable(entry):
        return (isinstance(entry, dict) and entry.get("kernel") in (alternative.name, "cudnn")
                and isinstance(entry.get("seconds"), dict)
                and isinstance(entry["seconds"].get(alternative.name), (int, float)))

    def taken(entry, how):
        if entry is None or entry["kernel"] != alternative.name:
            return graph
        alternative.seconds, alternative.chosen = entry["seconds"][alternative.name], how
        return alternative

    if not timed:
        entry = choice_file.read(path).get(key)
        return taken(entry if usable(entry) else None, KEPT)
    if graph.seconds is None:
        return graph
    how = {"how": KEPT}

    def measure():
        how["how"] = TIMED
        seconds = alternative.time()
        if seconds is None:
            return None
        return {"kernel": alternative.name if seconds < graph.seconds else "cudnn",
                "seconds": {alternative.name: seconds, "cudnn": graph.seconds}}

    return taken(choice_file.remembered(path, key, usable, measure), how["how"])
