"""A copying policy's own plan hides its copies behind compute only where that does not raise
its peak (snrt/scheduler/candidates.py: within_peak, copies_over_floor)."""

from dataclasses import replace

from hypothesis import HealthCheck, given, settings

import snrt
from snrt.scheduler.candidates import copies_over_floor, within_peak
from snrt.scheduler.options import PlanOptions
from snrt.scheduler.planner import make_plan
from snrt.scheduler.policies import policy_named
from snrt.scheduler.session import Session
from snrt.scheduler.verify import verify_plan
from tests.scheduler.graphs import build, graph_recipes

COPYING = ("liveness", "offload", "superneurons")  # liveness copies with streamed parameters


def hidden_and_just_in_time(session, name):
    """The Assemblies of Policy `name`'s memory-centric plan with every copy hidden, and with
    every copy just in time, in Session `session` (None, None for a row that copies nothing)."""
    row = policy_named(name)
    if not session.does(row).copies:
        return None, None
    return session.assemble(session.recipe(row)), session.assemble(session.recipe(row, hide_copies=False))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_the_copies_made_just_in_time_bring_the_peak_no_higher_and_no_copy_sets_it_where_none_did(recipe):
    graph = build(recipe)
    for stream_parameters in (False, True):
        session = Session(graph, 2, PlanOptions(stream_parameters=stream_parameters))
        for name in COPYING:
            hidden, just_in_time = hidden_and_just_in_time(session, name)
            if hidden is None:
                continue
            chosen = copies_over_floor(hidden.plan)
            mixed = session.assemble(replace(hidden.recipe, just_in_time=tuple(sorted(chosen))))
            verify_plan(mixed.plan)
            assert mixed.plan.peak_bytes <= hidden.plan.peak_bytes, (name, stream_parameters)
            if hidden.plan.peak_bytes == just_in_time.plan.peak_bytes:  # no copy window sets the peak
                assert within_peak(session, hidden) is hidden  # every copy stays hidden


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_a_policys_own_plan_is_no_larger_than_with_every_copy_hidden_and_a_budget_that_fits_that_one_keeps_it(
        recipe):
    graph = build(recipe)
    session = Session(graph, 2, PlanOptions(stream_parameters=True))
    for name in COPYING:
        hidden, _ = hidden_and_just_in_time(session, name)
        plan = make_plan(graph, 2, name, stream_parameters=True)
        verify_plan(plan)
        if hidden is None or name == "superneurons":  # superneurons' own plan also chooses its replays
            continue
        assert plan.arena_bytes <= hidden.plan.arena_bytes and plan.peak_bytes <= hidden.plan.peak_bytes
        within = make_plan(graph, 2, name, budget=hidden.plan.arena_bytes, stream_parameters=True)
        assert within.to_json() == hidden.plan.to_json()


def test_vgg16_streamed_peaks_as_if_every_copy_were_just_in_time_and_runs_faster_than_that():
    graph = snrt.load_config("configs/vgg16.yaml").graph
    session = Session(graph, 64, PlanOptions(stream_parameters=True))
    hidden, just_in_time = hidden_and_just_in_time(session, "offload")
    plan = make_plan(graph, 64, "offload", stream_parameters=True)
    assert plan.peak_bytes == just_in_time.plan.peak_bytes < 0.8 * hidden.plan.peak_bytes
    assert hidden.plan.predicted_s < plan.predicted_s < just_in_time.plan.predicted_s
    offloaded = {s.buffer for s in plan.steps if s.kind == "offload"}
    assert len(offloaded) == len({s.buffer for s in hidden.plan.steps if s.kind == "offload"})
