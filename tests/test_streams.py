"""The streams timeline (snrt/timeline.py): the cost model's per-stream intervals of a plan,
CUDA events turned into the same form, the share of copy time kernels hid, and the figure."""

import pytest

from snrt.scheduler import cost
from snrt.scheduler.planner import make_plan
from snrt.timeline import copy_overlap, draw_streams, measured_streams, predicted_streams
from tests.scheduler.graphs import build

GRAPH = [("conv", 0, 0), ("bn", 1, 1), ("relu", 2, 2), ("conv", 3, 3), ("bn", 4, 4), ("relu", 5, 5)]


def test_predicted_streams_replay_the_plans_prediction_stream_by_stream():
    graph = build(GRAPH)
    plan = make_plan(graph, 8, "offload", cost_model=cost.CUDA)
    intervals = predicted_streams(plan, graph, cost.CUDA)
    by_stream = {stream: sorted((s, e) for name, s, e in intervals if name == stream)
                 for stream in ("compute", "offload", "prefetch")}
    assert by_stream["offload"] and by_stream["prefetch"]  # the plan copies
    for spans in by_stream.values():  # a stream runs one thing at a time
        assert all(e1 <= s2 + 1e-15 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert all(s < e for s, e in spans)
    assert by_stream["compute"][-1][1] == pytest.approx(plan.predicted_s)
    offloaded = sum(b.nbytes for s in plan.steps if s.kind == "offload" for b in [plan.buffers[s.buffer]])
    assert sum(e - s for s, e in by_stream["offload"]) == pytest.approx(cost.CUDA.copy_s(offloaded))


def test_copy_overlap_counts_the_copy_time_inside_some_kernel():
    events = [("compute", "a", 0.0, 4.0), ("compute", "a inner", 1.0, 2.0),  # nested: one interval
              ("compute", "b", 6.0, 8.0),
              ("copy", "offload x", 3.0, 7.0),  # 1 s under a, 1 s under b
              ("copy", "prefetch y", 8.0, 9.0)]  # after every kernel
    overlap = copy_overlap(events)
    assert overlap == {"copy_s": 5.0, "overlapped_s": 2.0, "hidden": 0.4}
    assert copy_overlap([("compute", "a", 0.0, 1.0)])["hidden"] == 1.0  # nothing to hide
    assert measured_streams(events)[3] == ("offload", 3.0, 7.0)
    assert measured_streams([("copy", "prefetch y", 8.0, 9.0)]) == [("prefetch", 0.0, 1.0)]


def test_the_streams_figure_is_written(tmp_path):
    path = tmp_path / "streams.png"
    draw_streams([("compute", 0.0, 0.002), ("offload", 0.001, 0.003)],
                 [("compute", 0.0, 0.0015), ("prefetch", 0.0005, 0.001)], path, "one iteration")
    assert path.read_bytes()[:4] == b"\x89PNG"
