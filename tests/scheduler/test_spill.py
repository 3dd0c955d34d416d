"""Spilled plans (snrt/scheduler/spill.py): under a budget below every policy's plan, the tensors
idle at the fullest steps go to the host and back, down to the largest step's working set,
and training stays bit-identical to `none`."""

from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import snrt
from snrt.config import with_settings
from snrt.scheduler.candidates import own_plan
from snrt.scheduler.lowering import SPILL_FLOOR
from snrt.scheduler.planner import BudgetError, PlanOptions, each_plan, make_plan
from snrt.scheduler.policies import POLICIES
from snrt.scheduler.steps import largest_step_bytes
from snrt.scheduler.session import Session, planning
from snrt.scheduler.spill import _Peaks
from snrt.scheduler.verify import verify_plan
from snrt.train import Trainer
from tests.scheduler.graphs import build, graph_recipes
from tests.scheduler.test_exactness import CLIP_NORM, CONCAT_NET, run_under
from tests.test_train import MODERN, UNET

ROOT = Path(__file__).resolve().parents[2]
FREEING = [name for name, p in POLICIES.items() if p.frees]
COMPUTE = ("forward", "recompute", "backward", "update")


def smallest_budget(graph, batch, policy, **options):
    """The smallest budget a BudgetError states for `policy`."""
    with pytest.raises(BudgetError) as error:
        make_plan(graph, batch, policy, budget=1, **options)
    return error.value.smallest_bytes


def spilled_to_floor(graph, batch, policy, **options):
    """(the just-in-time plan of `policy`, that plan spilled down to the floor)."""
    at = Session(graph, batch, PlanOptions(**options))
    with planning():
        base = own_plan(at, POLICIES[policy], hide_copies=False)
        return base.plan, at.assemble(replace(base.recipe, spill=SPILL_FLOOR)).plan


def idle_at_full_steps(plan, limit, keep):
    """(step, buffer name) for each non-resident buffer alive but idle at a compute step holding
    more than `limit` non-resident bytes that a spill could have moved: not in `keep`, not a
    streamed tensor, and not waiting for a copy."""
    resident = sum(b.nbytes for b in plan.buffers if b.resident)
    alive, in_flight, found = set(), set(), []
    for i, (step, fresh) in enumerate(zip(plan.steps, plan.allocations)):
        alive.update(fresh)
        if step.kind in ("offload", "prefetch"):
            in_flight.add(step.buffer)
        elif step.kind == "wait":
            in_flight.discard(step.buffer)
        elif step.kind == "free":
            alive.difference_update(step.buffers)
        if step.kind in COMPUTE and plan.device_bytes[i] - resident > limit:
            used = set(step.reads()) | set(step.writes())
            found += [(i, plan.buffers[b].name) for b in alive - used - in_flight - keep
                      if plan.buffers[b].role not in ("parameter", "optimizer_state")]
    return found


def fetched(plan):
    """Counter of the tensors `plan` prefetches, by name without the version."""
    return Counter(plan.buffers[s.buffer].name.split("@")[0] for s in plan.steps if s.kind == "prefetch")


def prefetches(plan):
    return sum(s.kind == "prefetch" for s in plan.steps)


def kept(plan):
    return {b for out, _, probs, labels, _ in plan.losses for b in (out, probs, labels)}


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=10), st.booleans())
@example([("conv", 0, 0), ("conv", 0, 0), ("add", 1, 2)], False)  # the loss's kept tensors count to the end
def test_spilled_to_the_floor_no_tensor_idles_at_a_step_over_it(recipe, stream):
    graph = build(recipe)
    for policy in FREEING:
        plain, spilled = spilled_to_floor(graph, 2, policy, stream_parameters=stream)
        verify_plan(spilled)
        limit = largest_step_bytes(plain.steps, plain.buffers)
        assert idle_at_full_steps(spilled, limit, kept(spilled)) == []
        assert spilled.peak_bytes <= plain.peak_bytes


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=10), st.sampled_from([{}, {"ranks": 2, "bucket_bytes": 256},
                                                   {"deferred_updates": True}]))
@example([("bn", 0, 0), *[("conv", 0, 0)] * 5, ("gate", 0, 1), ("conv", 0, 0), ("conv", 0, 0), ("conv", 7, 0)],
         {"deferred_updates": True})  # auto's plan at that budget packs tighter than the one it states
def test_the_smallest_budget_an_error_states_works_and_spilling_never_raises_it(recipe, options):
    graph = build(recipe)
    just_in_time = dict(each_plan(graph, 2, FREEING, hide_copies=False, **options))
    # auto, where nothing fits with parameters resident, states the smallest of the streamed plans
    streamed = each_plan(graph, 2, FREEING, hide_copies=False, stream_parameters=True, **options)
    just_in_time["auto"] = min((p for _, p in streamed), key=lambda p: p.arena_bytes)
    for policy in (*FREEING, "auto"):
        smallest = smallest_budget(graph, 2, policy, **options)
        verify_plan(make_plan(graph, 2, policy, budget=smallest, **options), smallest)
        assert smallest <= just_in_time[policy].arena_bytes


def assert_spilled_training_agrees(config, iterations=2):
    """At its smallest budget, every freeing policy trains as `none` does, bit for bit, with the
    measured peak equal to the planned one; at least one policy spills to get there."""
    graph, batch = config.graph, config.train.batch
    losses, arrays, _ = run_under(config, "none", iterations)
    spilled = []
    for policy in FREEING:
        with pytest.raises(BudgetError) as error:
            Trainer(with_settings(config, memory={"policy": policy, "budget": 1}))
        budget = error.value.smallest_bytes
        trainer = Trainer(with_settings(config, memory={"policy": policy, "budget": budget}), check=True)
        assert [m.loss for m in trainer.fit(iterations=iterations)] == losses, policy
        for key, value in trainer.host_arrays().items():
            np.testing.assert_array_equal(value, arrays[key], err_msg=f"{policy}: {key}")
        assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes, policy
        trainer.backend.close()
        unbudgeted = Trainer(with_settings(config, memory={"policy": policy}))
        spilled.append(prefetches(trainer.plan) > prefetches(unbudgeted.plan))
        unbudgeted.backend.close()
    assert any(spilled)


@pytest.mark.parametrize("doc", [CONCAT_NET, MODERN, CLIP_NORM, UNET], ids=lambda doc: doc["name"])
def test_training_at_the_smallest_budget_is_bit_identical_to_none(doc):
    assert_spilled_training_agrees(snrt.load_config(doc))


def test_a_residual_network_spills_its_skip_gradients_and_trains_identically():
    config = snrt.load_config(ROOT / "configs" / "cifar_resnet20.yaml",
                              {"train.batch": 4, "train.data": {"type": "synthetic", "samples": 8}})
    plain, spilled = spilled_to_floor(config.graph, 4, "offload")
    spills = fetched(spilled) - fetched(plain)
    # a skip's gradient (an Add+ReLU's, which the blocks before it share), images, statistics
    assert {"stage1.2.add0:grad", "data:y", "batchnorm0:mean"} <= set(spills)
    assert_spilled_training_agrees(config)


def test_auto_spills_before_it_streams_parameters():
    config = snrt.load_config(CONCAT_NET)
    graph, batch = config.graph, config.train.batch
    fixed = min(p.arena_bytes for _, p in each_plan(graph, batch, POLICIES, hide_copies=False))
    budget = smallest_budget(graph, batch, "superneurons")
    assert budget < fixed
    plan = make_plan(graph, batch, "auto", budget=budget)
    assert plan.policy.startswith("auto:spilled(") and "streamed" not in plan.policy
    verify_plan(plan, budget)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-50, 50), min_size=1, max_size=40),
       st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40), st.integers(-20, 20)), max_size=30))
def test_range_adds_and_range_maxima_agree_with_a_list(values, ops):
    peaks, plain = _Peaks(values), list(values)
    for a, b, value in ops:
        lo, hi = sorted((a % len(values), b % (len(values) + 1)))
        peaks.add(lo, hi, value)
        plain[lo:hi] = [v + value for v in plain[lo:hi]]
        for x in range(len(values)):
            for y in range(x, len(values) + 1):
                assert peaks.max(x, y) == max(plain[x:y], default=float("-inf"))
