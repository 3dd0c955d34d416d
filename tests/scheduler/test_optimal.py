"""The budget-optimal choice (snrt/scheduler/optimal.py): exact against exhaustive search where
lifetimes nest, feasible where they cross, and the plans auto builds from it."""

import hashlib
import itertools
from dataclasses import replace
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snrt.backends import cpu_choice
from snrt.backends.numpy_backend import NumpyBackend
from snrt.config import load_config, parse_config, with_settings
from snrt.scheduler import candidates, cost, session
from snrt.scheduler.options import PlanOptions
from snrt.scheduler.optimal import Decision, choose
from snrt.scheduler.planner import each_plan, make_plan
from snrt.scheduler.policies import POLICIES
from snrt.scheduler.verify import verify_plan
from snrt.train import Trainer
from tests.scheduler.graphs import build, graph_recipes
from tests.scheduler.test_exactness import CONCAT_NET, run_under
from tests.test_train import MODERN, SMALL_RESNET

ROOT = Path(__file__).resolve().parents[2]


@st.composite
def problems(draw, laminar):
    """(decisions, device bytes, budget): sizes in multiples of 64 bytes, as tensors are."""
    steps = draw(st.integers(1, 24))
    device = [64 * draw(st.integers(0, 40)) for _ in range(steps)]
    decisions = []
    for k in range(draw(st.integers(0, 9))):
        start = draw(st.integers(0, steps - 1))
        end = draw(st.integers(start, steps - 1))
        if laminar and any(a < start <= b < end or start < a <= end < b for a, b in
                           ((d.start, d.end) for d in decisions)):
            continue
        decisions.append(Decision(("tensor", k), (k,), 64 * draw(st.integers(1, 30)), start, end,
                                  draw(st.sampled_from((0.0, 0.5, 1.0, 1.5, 2.0, 3.25)))))
    budget = max(device) + 64 * draw(st.integers(0, 60))
    return decisions, device, budget


def kept_bytes_fit(undone, device, budget):
    extra = np.array(device, dtype=np.int64)
    for d in undone:
        extra[d.start:d.end + 1] += d.nbytes
    return extra.max() <= budget


def exhaustive(decisions, device, budget):
    """The largest saving of any subset that fits, trying them all."""
    return max(sum(d.saves_s for d in subset) for r in range(len(decisions) + 1)
               for subset in itertools.combinations(decisions, r) if kept_bytes_fit(subset, device, budget))


def checked_choice(problem, **options):
    """(Choice, the best saving of all subsets) for `problem`, the choice checked to fit and to
    save no more than that best, and its saving to be the sum of what it undoes."""
    decisions, device, budget = problem
    choice = choose(decisions, device, budget, **options)
    undone = [d for d in decisions if d.key in choice.undone]
    best = exhaustive(decisions, device, budget)
    assert kept_bytes_fit(undone, device, budget)
    assert choice.saves_s == sum(d.saves_s for d in undone) <= best
    return choice, best


@settings(max_examples=300, deadline=None)
@given(problems(laminar=True))
def test_on_nested_lifetimes_the_choice_is_the_best_of_all_subsets(problem):
    choice, best = checked_choice(problem)
    assert choice.exact and choice.saves_s == best


@settings(max_examples=300, deadline=None)
@given(problems(laminar=False))
def test_on_crossing_lifetimes_the_choice_fits_and_saves_no_more_than_the_best(problem):
    checked_choice(problem)


@settings(max_examples=200, deadline=None)
@given(problems(laminar=True), st.integers(2, 4))
def test_thinned_step_functions_still_give_a_choice_that_fits(problem, limit):
    choice, best = checked_choice(problem, limit=limit)
    assert not choice.exact or choice.saves_s == best


@st.composite
def chains(draw):
    """(decisions, device bytes, budget) of a deep chain: every lifetime holds the next (a
    ResNet's tensors, written in the forward pass and read back in the backward pass), so all
    of them meet at the middle step and the choice is a knapsack of the budget."""
    depth = draw(st.integers(20, 48))
    decisions = [Decision(("tensor", k), (k,), 64 * draw(st.integers(1, 30)), k, 2 * depth - 1 - k,
                          draw(st.floats(0.01, 4.0))) for k in range(depth)]
    budget = 64 * draw(st.integers(1, 30 * depth))
    return decisions, [0] * (2 * depth), budget


@settings(max_examples=100, deadline=None)
@given(chains(), st.integers(2, 8))
def test_on_a_deep_chain_thinning_loses_at_most_one_decision_s_saving(problem, limit):
    decisions, device, budget = problem
    best = choose(decisions, device, budget, limit=10 ** 6)  # exact: nothing thinned
    choice = choose(decisions, device, budget, limit=limit)
    undone = [d for d in decisions if d.key in choice.undone]
    assert best.exact and kept_bytes_fit(undone, device, budget)
    assert choice.saves_s >= best.saves_s - max(d.saves_s for d in decisions)


def test_nothing_fits_when_the_frugal_plan_alone_exceeds_the_budget():
    assert choose([Decision(("tensor", 0), (0,), 64, 0, 0, 1.0)], [128], 127) is None


def test_a_chain_of_nested_tensors_keeps_the_set_that_saves_most_and_fits():
    # three nested lifetimes over five steps; 256 bytes of room over the frugal plan
    device = [0, 0, 0, 0, 0]
    decisions = [Decision(("tensor", 0), (0,), 128, 0, 4, 1.0),
                 Decision(("tensor", 1), (1,), 128, 1, 3, 3.0),
                 Decision(("tensor", 2), (2,), 192, 2, 2, 3.5)]
    assert choose(decisions, device, 256).undone == (("tensor", 0), ("tensor", 1))  # 4.0 beats 3.5 and 1+3.5
    assert choose(decisions, device, 320).undone == (("tensor", 1), ("tensor", 2))  # 6.5: 128 + 192 at step 2


SLOW_COPIES = replace(cost.CPU, copy_bytes_per_s=1e8)  # copies dear against compute: keeping pays


@pytest.mark.parametrize("doc, fraction", [(SMALL_RESNET, 0.05), (MODERN, 0.05), (CONCAT_NET, 0.0),
                                           (CONCAT_NET, 0.05)],
                         ids=lambda v: v["name"] if isinstance(v, dict) else None)
def test_training_under_a_budget_optimal_plan_is_bit_identical_to_none(monkeypatch, doc, fraction):
    monkeypatch.setattr(NumpyBackend, "cost_model", SLOW_COPIES)
    # the layers' own convolutions: with the direct kernel's workspace as the peak of these small
    # networks, every policy but none plans the same arena, and auto rightly keeps liveness
    monkeypatch.setenv("SNRT_CPU_KERNELS", "im2col")
    # unfused, as the budgets were chosen: fused, SMALL_RESNET's offload plan already fits the first
    config = with_settings(parse_config(doc, "<test>"), train={"fuse": False})
    graph, batch = config.graph, config.train.batch
    # planned with the kernels the Trainer runs (their workspaces), so that the budget falls where meant
    plans = dict(each_plan(graph, batch, POLICIES, cost_model=SLOW_COPIES, kernels=NumpyBackend.kernel_choice(),
                           fuse=False))
    frugal = min(p.arena_bytes for p in plans.values())
    budget = int(frugal + fraction * (plans["none"].arena_bytes - frugal))
    losses, arrays, _ = run_under(config, "none", 2)
    trainer = Trainer(with_settings(config, memory={"policy": "auto", "budget": budget}), check=True)
    assert trainer.plan.policy.startswith("auto:optimal(")
    assert trainer.plan.arena_bytes <= budget
    fixed = [p.predicted_s for p in plans.values() if p.arena_bytes <= budget]
    assert trainer.plan.predicted_s < min(fixed)
    assert [m.loss for m in trainer.fit(iterations=2)] == losses
    for key, value in trainer.host_arrays().items():
        np.testing.assert_array_equal(value, arrays[key], err_msg=key)
    assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=10), st.floats(0.0, 1.0))
def test_auto_fits_the_budget_verifies_and_is_never_slower_than_a_policy_that_fits(recipe, fraction):
    graph = build(recipe)
    plans = dict(each_plan(graph, 2, POLICIES, cost_model=SLOW_COPIES))
    frugal = min(p.arena_bytes for p in plans.values())
    budget = int(frugal + fraction * (plans["none"].arena_bytes - frugal))
    chosen = make_plan(graph, 2, "auto", budget=budget, cost_model=SLOW_COPIES)
    verify_plan(chosen, budget)
    assert chosen.predicted_s <= min(p.predicted_s for p in plans.values() if p.arena_bytes <= budget)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=10), st.floats(0.0, 1.0))
def test_superneurons_under_a_budget_grows_into_it_and_is_never_slower(recipe, fraction):
    graph = build(recipe)
    plain = make_plan(graph, 2, "superneurons", cost_model=SLOW_COPIES)
    budget = int(plain.arena_bytes * (1 + fraction))
    grown = make_plan(graph, 2, "superneurons", budget=budget, cost_model=SLOW_COPIES)
    verify_plan(grown, budget)
    assert grown.policy == "superneurons"
    assert grown.predicted_s <= plain.predicted_s


@pytest.mark.parametrize("over", [1.0, 1.05, 1.5, 2.0])
def test_superneurons_under_a_budget_is_never_slower_than_offload_where_offload_fits(over):
    # CIFAR ResNet-56 on the CPU: copies hide behind compute, so offloading a segment beats
    # replaying it (superneurons' own plan is 8% slower than offload's at 1.05x its arena)
    graph = load_config(ROOT / "configs" / "cifar_resnet56.yaml").graph
    offload = make_plan(graph, 16, "offload")
    budget = int(offload.arena_bytes * over)
    grown = make_plan(graph, 16, "superneurons", budget=budget)
    verify_plan(grown, budget)
    assert grown.policy == "superneurons"
    assert grown.predicted_s <= offload.predicted_s


def test_a_grown_plan_over_the_budget_is_cut_back_until_one_fits():
    # SE-ResNet-50 at 64px, parameters streamed, 1.2x its arena: the gaps between offsets put
    # the first grown plans over the budget, and they widen as the room shrinks (unfused: each
    # ReLU a node of its own, more for superneurons to recompute and growing to keep)
    graph = load_config(ROOT / "configs" / "se_resnet50.yaml", {"input.shape": [3, 64, 64]}).graph
    plain = make_plan(graph, 4, "superneurons", stream_parameters=True, fuse=False)
    budget = int(plain.arena_bytes * 1.2)
    grown = make_plan(graph, 4, "superneurons", budget=budget, stream_parameters=True, fuse=False)
    verify_plan(grown, budget)
    assert grown.predicted_s < 0.95 * plain.predicted_s


@pytest.mark.parametrize("doc", [SMALL_RESNET, CONCAT_NET], ids=lambda doc: doc["name"])
def test_training_under_superneurons_grown_into_a_budget_is_bit_identical_to_none(monkeypatch, doc):
    monkeypatch.setattr(NumpyBackend, "cost_model", SLOW_COPIES)
    config = parse_config(doc, "<test>")
    plain = make_plan(config.graph, config.train.batch, "superneurons", cost_model=SLOW_COPIES,
                      kernels=NumpyBackend.kernel_choice())
    budget = 2 * plain.arena_bytes
    losses, arrays, _ = run_under(config, "none", 2)
    trainer = Trainer(with_settings(config, memory={"policy": "superneurons", "budget": budget}), check=True)
    assert trainer.plan.arena_bytes <= budget
    assert trainer.plan.predicted_s < plain.predicted_s
    assert [m.loss for m in trainer.fit(iterations=2)] == losses
    for key, value in trainer.host_arrays().items():
        np.testing.assert_array_equal(value, arrays[key], err_msg=key)
    assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes


def streamed_budget(graph, batch, fraction, **options):
    """A budget `fraction` of the way from the smallest streamed plan to the smallest plan
    with parameters resident (its copies just in time), and the streamed plans ({policy: Plan});
    `options`: more PlanOptions for both."""
    resident = min(p.arena_bytes for _, p in each_plan(graph, batch, POLICIES, cost_model=SLOW_COPIES,
                                                       hide_copies=False, **options))
    streamed = dict(each_plan(graph, batch, POLICIES, cost_model=SLOW_COPIES, stream_parameters=True, **options))
    frugal = min(p.arena_bytes for p in streamed.values())
    return int(frugal + fraction * (resident - 1 - frugal)), streamed


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=10), st.floats(0.0, 1.0))
def test_auto_with_streamed_parameters_is_never_slower_than_a_streamed_policy_that_fits(recipe, fraction):
    graph = build(recipe)
    budget, streamed = streamed_budget(graph, 2, fraction)
    chosen = make_plan(graph, 2, "auto", budget=budget, cost_model=SLOW_COPIES)
    verify_plan(chosen, budget)
    fitting = [p.predicted_s for p in streamed.values() if p.arena_bytes <= budget]
    if fitting:
        assert chosen.predicted_s <= min(fitting)


def test_training_with_some_parameters_kept_resident_and_the_rest_streamed_is_bit_identical(monkeypatch):
    monkeypatch.setattr(NumpyBackend, "cost_model", SLOW_COPIES)
    # one kernel for every convolution: no step time measured on this machine (in this process,
    # perhaps under another test's load) decides which plan auto picks
    monkeypatch.setenv(cpu_choice.VARIABLE, "direct")
    config = parse_config(SMALL_RESNET, "<test>")
    budget, streamed = streamed_budget(config.graph, config.train.batch, 0.5, kernels=NumpyBackend.kernel_choice())
    losses, arrays, _ = run_under(config, "none", 2)
    trainer = Trainer(with_settings(config, memory={"policy": "auto", "budget": budget}), check=True)
    homes = set(trainer.plan.parameter_homes().values())
    assert homes == {"resident", "streamed"}, trainer.plan.policy
    assert trainer.plan.predicted_s < min(p.predicted_s for p in streamed.values() if p.arena_bytes <= budget)
    assert [m.loss for m in trainer.fit(iterations=2)] == losses
    for key, value in trainer.host_arrays().items():
        np.testing.assert_array_equal(value, arrays[key], err_msg=key)
    assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes


# offload's plan is faster on the CPU, not on CUDA
@pytest.mark.parametrize("model", [cost.CPU, cost.CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("over", [1.0, 2.0])
def test_skipping_plans_that_cannot_beat_the_cap_changes_no_plan(model, over):
    graph = load_config(ROOT / "configs" / "cifar_resnet56.yaml").graph
    budget = int(make_plan(graph, 16, "offload", cost_model=model).arena_bytes * over)
    skipped = make_plan(graph, 16, "superneurons", budget=budget, cost_model=model)
    with mock.patch.object(candidates, "beaten", lambda *args: False):  # never skip
        built = make_plan(graph, 16, "superneurons", budget=budget, cost_model=model)
    in_rows = dict(each_plan(graph, 16, ["superneurons"], budget=budget, cost_model=model))["superneurons"]
    assert digest(skipped) == digest(built) == digest(in_rows)


def test_superneurons_own_plan_is_not_assembled_where_its_replays_cost_more_than_offloads_stalls():
    graph = load_config(ROOT / "configs" / "cifar_resnet56.yaml").graph
    budget = 2 * make_plan(graph, 16, "offload").arena_bytes
    assembled = []
    real = session.lower
    with mock.patch.object(session, "lower",
                           lambda at, recipe: assembled.append(recipe.row.name) or real(at, recipe)):
        grown = make_plan(graph, 16, "superneurons", budget=budget)
    assert grown.policy == "superneurons" and not any(s.kind == "recompute" for s in grown.steps)
    assert "superneurons" not in assembled and "offload" in assembled


def test_a_growth_whose_decisions_together_save_too_little_makes_no_choice():
    # CIFAR ResNet-56 on the CPU: offload's plan stalls for under 1% of its time, so even
    # undoing every decision would not be worth it
    graph = load_config(ROOT / "configs" / "cifar_resnet56.yaml").graph
    budget = 2 * make_plan(graph, 16, "offload").arena_bytes
    offload = make_plan(graph, 16, "offload", budget=budget)  # every copy hidden: it fits
    with mock.patch.object(candidates, "choose", side_effect=AssertionError("choose was called")):
        grown = make_plan(graph, 16, "superneurons", budget=budget)
    assert grown.predicted_s == offload.predicted_s


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=10), st.sampled_from([cost.CPU, cost.CUDA]), st.booleans())
def test_the_replays_bound_holds_for_every_plan_and_the_memory_centric_plan_replays_every_droppable_node(
        recipe, model, streamed):
    graph = build(recipe)
    at = session.Session(graph, 2, PlanOptions(cost_model=model, stream_parameters=streamed))
    with session.planning():
        droppable = set(candidates.droppable(at))
        for name in POLICIES:
            assembly = at.assemble(at.recipe(POLICIES[name]))
            plan, segments = assembly.plan, assembly.segments
            replayed = {s.node for s in plan.steps if s.kind == "recompute"}
            assert replayed == {n for nodes in segments.values() for n in nodes}
            assert replayed == (droppable if POLICIES[name].recomputes else set())
            assert candidates.time_at_least(at, replayed) <= plan.predicted_s * (1 + 1e-9)


def digest(plan):
    """A short digest of `plan` (a failing comparison of two whole plans would print both)."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
