"""The cuDNN engine choice (snrt/backends/cudnn_engines.py) on a stand-in for the frontend's
graph: which engines are timed, which one is selected, what is kept on disk and when it is
used again. No cuDNN and no device needed; tests/backends/test_cuda_device.py times real
engines."""

import json

import pytest

from snrt.backends import choice_file, cudnn_engines
from snrt.errors import SnrtError


class RankedGraph:
    """The part of cudnn.pygraph that engine selection uses, over a ranked list of plans
    (name, workspace bytes, how it fails to build: None, "barred" or "declined")."""

    def __init__(self, *plans):
        self.plans = [plan if len(plan) == 3 else (*plan, None) for plan in plans]
        self.built, self.selected = [], None

    def get_execution_plan_count(self):
        return len(self.plans)

    def get_plan_name_at_index(self, index):
        return self.plans[index][0]

    def get_workspace_size_plan_at_index(self, index):
        if self.plans[index][2] == "barred":
            raise ValueError(f"plan {index} is excluded by a note filter")
        return self.plans[index][1]

    def build_plan_at_index(self, index):
        failure = self.plans[index][2]
        if failure is not None:
            raise (ValueError if failure == "barred" else RuntimeError)(f"plan {index} {failure}")
        self.built.append(index)
        self.selected = index


class Stopwatch:
    """time_engines for select: the seconds of each engine by name, and the names timed."""

    def __init__(self, **seconds):
        self.seconds, self.timed = seconds, []

    def __call__(self, graph, engines):
        self.timed.append([engine.name for engine in engines])
        return [self.seconds[engine.name] for engine in engines]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(cudnn_engines.VARIABLE, raising=False)
    return tmp_path / cudnn_engines.CACHE_FILE


def graph_of_five():
    return RankedGraph(("eng0", 0), ("eng1", 64, "barred"), ("eng2", 4096), ("eng3", 128, "declined"),
                       ("eng4", 256))


def test_the_fastest_engine_that_builds_within_the_limit_is_selected_and_kept(cache):
    graph, stopwatch = graph_of_five(), Stopwatch(eng0=3e-3, eng2=1e-3, eng4=2e-3)
    engine, seconds, how = cudnn_engines.select(graph, "conv A", 1024, stopwatch)
    assert stopwatch.timed == [["eng0", "eng4"]]  # barred, declined and over the limit: not timed
    assert (engine.name, engine.index, engine.workspace_bytes, seconds) == ("eng4", 4, 256, 2e-3)
    assert how == cudnn_engines.TIMED
    assert graph.selected == 4
    assert json.loads(cache.read_text()) == {"conv A": {"engine": "eng4", "seconds": {"eng0": 3e-3, "eng4": 2e-3}}}


def test_a_kept_choice_is_built_alone_and_nothing_is_timed_again(cache):
    cudnn_engines.select(graph_of_five(), "conv A", None, Stopwatch(eng0=3e-3, eng2=1e-3, eng4=2e-3))
    graph, stopwatch = graph_of_five(), Stopwatch(eng0=1e-6, eng2=1e-6, eng4=1e-6)
    engine, seconds, how = cudnn_engines.select(graph, "conv A", None, stopwatch)
    assert stopwatch.timed == []
    assert (engine.name, seconds, graph.built, graph.selected, how) == ("eng2", 1e-3, [2, 2], 2, cudnn_engines.KEPT)


def test_choices_are_kept_per_key_so_another_device_or_graph_is_timed_anew(cache):
    cudnn_engines.select(graph_of_five(), "H100 | conv A", None, Stopwatch(eng0=3e-3, eng2=1e-3, eng4=2e-3))
    stopwatch = Stopwatch(eng0=1e-4, eng2=1e-3, eng4=2e-3)
    engine, _, how = cudnn_engines.select(graph_of_five(), "H200 | conv A", None, stopwatch)
    assert engine.name == "eng0" and stopwatch.timed == [["eng0", "eng2", "eng4"]]
    assert set(json.loads(cache.read_text())) == {"H100 | conv A", "H200 | conv A"}


def test_a_kept_engine_no_longer_offered_or_now_too_large_is_timed_again(cache):
    cudnn_engines.select(graph_of_five(), "conv A", None, Stopwatch(eng0=3e-3, eng2=1e-3, eng4=2e-3))
    renamed = RankedGraph(("eng0", 0), ("eng5", 16))  # another cuDNN ranks other engines
    engine, _, how = cudnn_engines.select(renamed, "conv A", None, Stopwatch(eng0=2e-3, eng5=1e-3))
    assert engine.name == "eng5"
    assert json.loads(cache.read_text())["conv A"]["engine"] == "eng5"
    cache.write_text(json.dumps({"conv B": {"engine": "eng2", "seconds": {"eng2": 1e-3}}}))
    stopwatch = Stopwatch(eng0=3e-3, eng4=2e-3)
    engine, _, how = cudnn_engines.select(graph_of_five(), "conv B", 1024, stopwatch)  # eng2 needs 4096
    assert engine.name == "eng4" and stopwatch.timed == [["eng0", "eng4"]]


@pytest.mark.parametrize("damage", ["{not json", "[1, 2]", '{"conv A": "eng2"}', '{"conv A": {"seconds": 1}}'])
def test_a_damaged_choices_file_is_measured_over(cache, damage):
    cache.write_text(damage)
    stopwatch = Stopwatch(eng0=3e-3, eng2=1e-3, eng4=2e-3)
    engine, _, how = cudnn_engines.select(graph_of_five(), "conv A", None, stopwatch)
    assert engine.name == "eng2" and len(stopwatch.timed) == 1
    assert json.loads(cache.read_text())["conv A"]["engine"] == "eng2"


def test_while_a_step_runs_nothing_is_timed_the_kept_engine_or_cudnns_first_runs(cache):
    engine, seconds, how = cudnn_engines.select(graph_of_five(), "conv A", None)
    assert (engine.name, seconds, how) == ("eng0", None, cudnn_engines.FIRST) and not cache.exists()
    cudnn_engines.select(graph_of_five(), "conv A", None, Stopwatch(eng0=3e-3, eng2=1e-3, eng4=2e-3))
    graph = graph_of_five()
    engine, seconds, how = cudnn_engines.select(graph, "conv A", None)
    assert (engine.name, seconds, graph.selected, how) == ("eng2", 1e-3, 2, cudnn_engines.KEPT)
    engine, _, how = cudnn_engines.select(graph_of_five(), "conv A", 1024)  # the kept one does not fit
    assert engine.name == "eng0"


def test_engines_that_cannot_be_timed_leave_cudnns_first_and_keep_nothing(cache):
    engine, seconds, how = cudnn_engines.select(graph_of_five(), "conv A", None, lambda graph, engines: None)
    assert (engine.name, seconds, how) == ("eng0", None, cudnn_engines.FIRST) and not cache.exists()


def test_the_heuristic_setting_times_nothing_and_keeps_nothing(cache, monkeypatch):
    monkeypatch.setenv(cudnn_engines.VARIABLE, "heuristic")
    graph = RankedGraph(("eng1", 64, "barred"), ("eng4", 4096), ("eng2", 256))
    stopwatch = Stopwatch()
    engine, seconds, how = cudnn_engines.select(graph, "conv A", 1024, stopwatch)
    assert (engine.name, seconds, graph.selected, stopwatch.timed) == ("eng2", None, 2, [])
    assert not cache.exists()


def test_at_most_max_candidates_are_timed(cache, monkeypatch):
    monkeypatch.setattr(cudnn_engines, "MAX_CANDIDATES", 3)
    names = [f"eng{i}" for i in range(6)]
    stopwatch = Stopwatch(**{name: 1e-3 * (6 - i) for i, name in enumerate(names)})
    engine, _, how = cudnn_engines.select(RankedGraph(*((name, 0) for name in names)), "conv A", None, stopwatch)
    assert stopwatch.timed == [names[:3]] and engine.name == "eng2"


def test_no_engine_within_the_limit_is_an_error_the_kernel_turns_into_its_fallback(cache):
    graph = RankedGraph(("eng0", 4096), ("eng1", 64, "declined"))
    for time_engines in (Stopwatch(eng0=1.0), None):
        with pytest.raises(cudnn_engines.NoEngineError, match="within 1024 workspace bytes"):
            cudnn_engines.select(graph, "conv A", 1024, time_engines)
    assert not cache.exists()


def test_an_unknown_setting_is_an_error_naming_the_variable_and_its_values(cache, monkeypatch):
    monkeypatch.setenv(cudnn_engines.VARIABLE, "fastest")
    with pytest.raises(SnrtError, match="SNRT_CUDNN_ENGINES is 'fastest': expected one of 'measure', 'heuristic'"):
        cudnn_engines.select(graph_of_five(), "conv A", None, Stopwatch())


def test_nothing_is_written_when_a_measurement_keeps_nothing(tmp_path):
    path = tmp_path / "choices.json"
    assert choice_file.remembered(path, "k", lambda entry: True, lambda: None) is None
    assert not path.exists()
    assert choice_file.remembered(path, "k", lambda entry: True, lambda: {"a": 1}) == {"a": 1}
    assert choice_file.remembered(path, "k", lambda entry: True, lambda: {"a": 2}) == {"a": 1}


def test_engines_that_all_failed_to_run_leave_cudnns_first_and_keep_nothing(cache):
    engine, seconds, how = cudnn_engines.select(graph_of_five(), "conv A", None, Stopwatch(
        eng0=float("inf"), eng2=float("inf"), eng4=float("inf")))
    assert (engine.name, seconds) == ("eng0", None) and not cache.exists()
    engine, _, how = cudnn_engines.select(graph_of_five(), "conv A", None, Stopwatch(
        eng0=float("inf"), eng2=float("inf"), eng4=2e-3))
    assert engine.name == "eng4"


def test_the_run_says_how_its_cudnn_engines_were_chosen(cache, monkeypatch):
    """CudaKernels.describe counts the graphs built so far by how their engine was chosen,
    names the choices file (or the setting) and the graphs cuDNN refused."""
    from types import SimpleNamespace

    from snrt.backends.cuda_kernels import CudaKernels

    def graph(how, name="cudnn"):
        return SimpleNamespace(chosen=how, name=name)

    kernels = CudaKernels()
    assert kernels.describe() == ""
    kernels._kernels = {
        "conv": SimpleNamespace(name="cudnn", graphs=lambda: [graph(cudnn_engines.TIMED), graph(cudnn_engines.KEPT),
                                                              None]),
        "bn": SimpleNamespace(name="cudnn", graphs=lambda: [graph(cudnn_engines.TIMED)]),
        "relu": SimpleNamespace(name="cuda")}
    assert kernels.describe() == (f"cuDNN: 3 graphs, engines 2 timed now, 1 kept from before, 0 cuDNN's first ({cache}); "
                                  "1 refused (the CUDA kernels run them)")
    kernels._kernels["1x1"] = SimpleNamespace(name="cudnn", graphs=lambda: [graph(cudnn_engines.KEPT, "cublas")])
    kernels._kernels["bn2"] = SimpleNamespace(name="cudnn", graphs=lambda: [graph(cudnn_engines.TIMED, "cuda")] * 2)
    assert kernels.describe() == (f"cuDNN: 6 graphs, engines 4 timed now, 2 kept from before, 0 cuDNN's first ({cache}); "
                                  "run instead, where timed faster: 1 by cuBLAS GEMMs, 2 by CUDA kernels; "
                                  "1 refused (the CUDA kernels run them)")
    monkeypatch.setenv(cudnn_engines.VARIABLE, "heuristic")
    assert "(SNRT_CUDNN_ENGINES=heuristic)" in kernels.describe()


class StandInAlternative:
    """An alternative to a cuDNN graph whose `time()` gives set seconds and counts its calls."""

    name = "cublas"

    def __init__(self, seconds):
        self.seconds_when_timed, self.calls = seconds, 0
        self.seconds, self.chosen = None, cudnn_engines.FIRST

    def time(self):
        self.calls += 1
        return self.seconds_when_timed


def test_an_alternative_runs_an_operation_only_where_it_was_timed_faster(cache):
    """cudnn_engines.faster: timed at planning time against the cuDNN graph's timed engine,
    the faster kept on disk and taken again without timing; a graph whose engine was not timed
    keeps cuDNN; a graph built while a step runs takes the kept choice, or cuDNN."""
    from types import SimpleNamespace

    choose = cudnn_engines.faster

    timed_graph = SimpleNamespace(seconds=2e-3, name="cudnn")
    faster = StandInAlternative(1e-3)
    assert choose(timed_graph, faster, "wgrad A", timed=True) is faster
    assert (faster.calls, faster.seconds, faster.chosen) == (1, 1e-3, cudnn_engines.TIMED)
    assert json.loads(cache.read_text())["wgrad A"] == {"kernel": "cublas", "seconds": {"cublas": 1e-3, "cudnn": 2e-3}}
    again = StandInAlternative(9.0)  # a later run: the kept choice, nothing timed
    assert choose(timed_graph, again, "wgrad A", timed=True) is again
    assert (again.calls, again.seconds, again.chosen) == (0, 1e-3, cudnn_engines.KEPT)
    during_a_step = StandInAlternative(9.0)
    assert choose(timed_graph, during_a_step, "wgrad A", timed=False) is during_a_step and during_a_step.calls == 0

    slower = StandInAlternative(3e-3)
    assert choose(timed_graph, slower, "fprop B", timed=True) is timed_graph and slower.calls == 1
    assert json.loads(cache.read_text())["fprop B"]["kernel"] == "cudnn"
    assert choose(timed_graph, StandInAlternative(1e-6), "fprop B", timed=True) is timed_graph  # kept: not timed again

    untimed_graph = SimpleNamespace(seconds=None, name="cudnn")
    never = StandInAlternative(1e-6)
    assert choose(untimed_graph, never, "dgrad C", timed=True) is untimed_graph and never.calls == 0
    assert choose(timed_graph, StandInAlternative(1e-6), "dgrad D", timed=False) is timed_graph  # nothing kept: cuDNN
    no_memory = StandInAlternative(None)
    assert choose(timed_graph, no_memory, "dgrad E", timed=True) is timed_graph
    assert "dgrad E" not in json.loads(cache.read_text())


def test_a_choice_that_cannot_be_written_holds_in_the_process_and_leaves_no_temporary(tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    path = tmp_path / "choices.json"
    write_text = Path.write_text

    def full(self, text, *args, **kwargs):
        write_text(self, text[:5])  # part of the file, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    assert choice_file.remembered(path, "k", lambda entry: True, lambda: {"a": 1}) == {"a": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["choices.json.lock"]
