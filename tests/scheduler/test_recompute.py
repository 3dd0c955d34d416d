"""Recomputation writes every replayed tensor into a version of its own."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snrt.scheduler.order import BufferTable, build_iteration
from snrt.scheduler.recompute import plan_recomputation
from snrt.scheduler.steps import version_buffers
from tests.scheduler.graphs import build, graph_recipes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(), st.booleans())
def test_replayed_tensors_are_versions_that_later_steps_read(recipe, speed):
    """After plan_recomputation no buffer is written twice (version_buffers finds nothing to
    do), every recompute step writes new versions ("name@k") of its node's tensors, and no
    step after a replay reads the tensor the forward pass wrote."""
    graph = build(recipe)
    it = build_iteration(graph, 2)
    table = BufferTable()
    table.buffers = list(it.buffers)
    _, segments = plan_recomputation(graph, list(it.steps), table)
    table.buffers = list(it.buffers)
    steps, _ = plan_recomputation(graph, list(it.steps), table, speed_segments=tuple(segments) if speed else ())
    versions = len(table.buffers)
    assert version_buffers(steps, table) == steps
    assert len(table.buffers) == versions
    forward_writes = {s.node: set(s.writes()) for s in it.steps if s.kind == "forward"}
    replayed_originals = set()
    for step in steps:
        assert replayed_originals.isdisjoint(step.reads()), step
        if step.kind == "recompute":
            for b in step.writes():
                assert table.buffers[b].is_copy, table.buffers[b].name
                assert table.buffers[b].name.split("@")[0] in {table.buffers[o].name for o in forward_writes[step.node]}
            replayed_originals |= forward_writes[step.node]
