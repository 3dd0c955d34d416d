"""Data-parallel plans: the gradient buckets, their exchange and wait steps, their memory."""

import pytest
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.scheduler.plan import Plan, evolve
from snrt.scheduler.planner import make_plan
from snrt.scheduler.policies import POLICIES
from snrt.scheduler.verify import PlanError, verify_plan
from tests.scheduler.graphs import build, graph_recipes


def reductions(plan):
    starts = [s for s in plan.steps if s.kind == "allreduce"]
    waits = [s for s in plan.steps if s.kind == "allreduce_wait"]
    return starts, waits


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_every_parameter_gradient_is_summed_once_before_its_update_under_every_policy(recipe):
    graph = build(recipe)
    for policy in POLICIES:
        for ranks in (2, 3):
            plan = make_plan(graph, 2, policy, ranks=ranks, bucket_bytes=256)
            verify_plan(plan)
            assert Plan.from_json(plan.to_json()) == plan
            starts, waits = reductions(plan)
            grads = [g for s in plan.steps if s.kind == "backward" for _, g in s.grad_params]
            assert [g for s in starts for g in s.grads] == grads  # each once, in the order backward writes them
            assert [w.gathered for w in waits] == [s.gathered for s in starts]
            summed = {b for w in waits for b in w.sums}
            updated = [g for s in plan.steps if s.kind == "update" for _, g, _, _ in s.slots]
            assert sorted(updated) == sorted(summed)
            last_backward = max(i for i, s in enumerate(plan.steps) if s.kind == "backward")
            first_update = min(i for i, s in enumerate(plan.steps) if s.kind == "update")
            assert first_update > last_backward
            for start in starts:
                gathered = plan.buffers[start.gathered]
                assert gathered.nbytes == ranks * start.nbytes == ranks * sum(plan.buffers[g].nbytes
                                                                            for g in start.grads)


def test_one_rank_plans_exactly_as_before():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    for policy in POLICIES:
        assert make_plan(graph, 4, policy, ranks=1).to_json() == make_plan(graph, 4, policy).to_json()


def test_buckets_close_at_the_cap_in_backward_order_and_start_during_backward():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    cap = 64 * 1024
    plan = make_plan(graph, 4, "liveness", ranks=2, bucket_bytes=cap)
    starts, waits = reductions(plan)
    assert len(starts) > 3
    for start in starts[:-1]:  # each bucket closes once it holds the cap (the last one: what is left)
        assert start.nbytes >= cap
        assert start.nbytes - plan.buffers[start.grads[-1]].nbytes < cap
    index = {id(s): i for i, s in enumerate(plan.steps)}
    last_backward = max(i for i, s in enumerate(plan.steps) if s.kind == "backward")
    assert all(index[id(s)] < last_backward for s in starts[:-1])  # overlapped with the backward pass
    assert all(index[id(w)] > last_backward for w in waits)


def test_the_exchange_is_counted_in_memory_and_time():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    one = make_plan(graph, 4, "liveness")
    two = make_plan(graph, 4, "liveness", ranks=2)
    four = make_plan(graph, 4, "liveness", ranks=4)
    params = sum(b.nbytes for b in one.buffers if b.role == "parameter")
    assert two.bytes_by_role()["collective"] == 2 * params
    assert four.bytes_by_role()["collective"] == 4 * params
    assert one.predicted_s < two.predicted_s < four.predicted_s
    def after_backward(plan):  # the bytes alive while the updates run: the slots, then the sums
        last = max(i for i, s in enumerate(plan.steps) if s.kind == "backward")
        return max(plan.device_bytes[last + 1:])
    assert after_backward(one) < after_backward(two) < after_backward(four)
    assert after_backward(four) - after_backward(two) >= 2 * params - 2 * max(
        b.nbytes for b in one.buffers if b.role == "parameter")


def test_the_verifier_refuses_an_update_of_an_unsummed_gradient():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    plan = make_plan(graph, 4, "none", ranks=2)
    at = next(i for i, s in enumerate(plan.steps) if s.kind == "update")
    step = plan.steps[at]
    unsummed = next(g for s in plan.steps if s.kind == "backward" and s.node == step.node for _, g in s.grad_params)
    p, _, states, decay = step.slots[0]
    broken = evolve(step, slots=((p, unsummed, states, decay), *step.slots[1:]))
    with pytest.raises(PlanError, match="not summed across ranks"):
        verify_plan(evolve(plan, steps=plan.steps[:at] + (broken,) + plan.steps[at + 1:]))
