"""Plans of every policy are consistent (static checks, property tests on generated graphs)."""

import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.models.resnet import resnet
from snrt.scheduler.fuse import planned_graph
from snrt.scheduler.plan import Plan
from snrt.scheduler import planner
from snrt.scheduler.planner import BudgetError, make_plan
from snrt.scheduler.policies import POLICIES
from snrt.scheduler.verify import PlanError, verify_plan
from tests.scheduler.graphs import build, graph_recipes


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_every_policy_gives_a_consistent_plan_that_keeps_its_budget(recipe):
    graph = build(recipe)
    arenas = {}
    for policy in POLICIES:
        plan = make_plan(graph, 2, policy)
        arenas[policy] = plan.arena_bytes
        verify_plan(plan)
        verify_plan(plan, budget=plan.arena_bytes)
        tighter = plan.arena_bytes - 1
        try:
            tight = make_plan(graph, 2, policy, budget=tighter)
        except BudgetError as e:
            assert e.smallest_bytes > tighter
        else:  # offload policies fall back to just-in-time prefetch, freeing ones spill: both need less
            assert policy != "none"
            verify_plan(tight, budget=tighter)
    assert arenas["superneurons"] <= arenas["offload"]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_plans_are_deterministic_and_round_trip_through_json(recipe):
    graph = build(recipe)
    for policy in POLICIES:
        text = make_plan(graph, 2, policy).to_json()
        assert make_plan(build(recipe), 2, policy).to_json() == text
        assert Plan.from_json(text).to_json() == text


def test_the_verifier_catches_broken_plans():
    from dataclasses import replace

    graph = build([("conv", 0, 0), ("bn", 1, 1), ("relu", 2, 2)])
    plan = make_plan(graph, 2, "liveness")
    frees = [i for i, s in enumerate(plan.steps) if s.kind == "free"]
    early = list(plan.steps)
    moved = early.pop(frees[0])
    early.insert(0, moved)  # free a buffer before it exists
    with pytest.raises(PlanError):
        verify_plan(replace(plan, steps=tuple(early)))
    overlapping = [replace(b, offset=0) if b.role == "activation" else b for b in plan.buffers]
    with pytest.raises(PlanError, match="overlaps"):
        verify_plan(replace(plan, buffers=tuple(overlapping)))


def test_policies_shrink_the_peak_of_a_resnet():
    graph = snrt.load_config("configs/resnet50.yaml").graph
    peaks = {p: make_plan(graph, 8, p).peak_bytes for p in POLICIES}
    assert peaks["liveness"] < 0.5 * peaks["none"]
    assert peaks["recompute"] < peaks["liveness"]
    assert peaks["offload"] < peaks["liveness"]
    assert peaks["superneurons"] < 0.5 * peaks["liveness"]


def test_superneurons_recomputes_only_where_that_costs_no_more_memory_than_offloading():
    graph = snrt.load_config("configs/resnet50.yaml").graph
    offload, superneurons = (make_plan(graph, 32, p) for p in ("offload", "superneurons"))
    assert superneurons.arena_bytes <= offload.arena_bytes
    replayed = {s.node for s in superneurons.steps if s.kind == "recompute"}
    assert replayed  # most segments are still recomputed ...
    offloaded = {superneurons.buffers[s.buffer].name.split(":")[0] for s in superneurons.steps if s.kind == "offload"}
    kept = [n for n in graph.nodes if snrt.LAYERS[graph[n].layer.type_name].recompute_cost == "cheap"
            and n not in replayed and n in offloaded]
    assert kept  # ... and some cheap layers' outputs are offloaded instead at this batch


def test_superneurons_peak_stays_within_offloads_where_replaying_the_stem_would_raise_it():
    # at 227x227 in bf16, replaying the stem at the end of the backward peaks over offload's
    # plan (uncapped: 129 against 116 MB) while still inside its arena: those segments are
    # offloaded instead
    graph = resnet(stages=(2, 2, 50, 2), image_size=227)
    offload, superneurons = (make_plan(graph, 16, p, stream_parameters=True, precision="bf16")
                             for p in ("offload", "superneurons"))
    assert superneurons.peak_bytes <= offload.peak_bytes
    assert superneurons.arena_bytes <= offload.arena_bytes
    assert any(s.kind == "recompute" for s in superneurons.steps)  # still replays the other segments


def test_recompute_replays_only_cheap_layers():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    plan = make_plan(graph, 4, "recompute")
    planned = planned_graph(graph, plan)  # each BatchNorm's ReLU fused into it
    replayed = {planned[s.node].layer for s in plan.steps if s.kind == "recompute"}
    assert {"BatchNorm", "BatchNormReLU"} <= {layer.type_name for layer in replayed}
    assert all(layer.recompute_cost == "cheap" for layer in replayed)
    assert plan.recompute_flops > 0


def test_offload_moves_bytes_to_the_host_and_waits_for_every_copy():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    plan = make_plan(graph, 4, "offload")
    kinds = [s.kind for s in plan.steps]
    assert plan.host_bytes > 0
    assert kinds.count("offload") == kinds.count("prefetch")
    assert kinds.count("wait") == 2 * kinds.count("offload")


def test_auto_picks_a_policy_that_fits_and_infeasible_budgets_say_what_would_work():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    none = make_plan(graph, 8, "none")
    roomy = make_plan(graph, 8, "auto", budget=none.arena_bytes)
    assert roomy.arena_bytes <= none.arena_bytes and roomy.policy.startswith("auto:")
    with pytest.raises(BudgetError) as info:
        make_plan(graph, 8, "auto", budget=1)
    frugal = info.value.smallest_bytes
    assert frugal <= min(make_plan(graph, 8, p).arena_bytes for p in POLICIES)
    tight = make_plan(graph, 8, "auto", budget=frugal)
    assert tight.arena_bytes <= frugal
    with pytest.raises(BudgetError) as info:
        make_plan(graph, 8, "auto", budget=frugal - 1)
    assert info.value.smallest_bytes == frugal
    assert 1 <= info.value.largest_batch < 8
    assert make_plan(graph, info.value.largest_batch, "auto", budget=frugal - 1).arena_bytes < frugal
    assert "smallest budget that works" in str(info.value)


def test_the_largest_batch_autos_error_names_is_the_largest_auto_itself_plans():
    """auto may fit a batch by a plan other than the recipe of its smallest plan at the asked
    batch (here, at half the smallest arena of LeNet's policies, a spilled offload plan with
    parameters streamed fits 32 where the smallest recipe fits 31): the batch named is one auto
    plans, the next one it cannot, and the message names the plan."""
    graph = snrt.load_config("configs/lenet.yaml").graph
    budget = min(make_plan(graph, 64, p).arena_bytes for p in POLICIES) // 2
    with pytest.raises(BudgetError) as info:
        make_plan(graph, 64, "auto", budget=budget)
    largest = info.value.largest_batch
    fits = make_plan(graph, largest, "auto", budget=budget)
    assert f"the largest batch that fits is {largest} ({fits.policy})" in str(info.value)
    assert planner.fitting_plan(graph, largest + 1, "auto", budget) is None


@pytest.mark.parametrize("policy", ["auto", "offload"])
def test_fitting_plan_is_make_plans_plan_or_none_without_searching_for_a_batch(policy):
    from unittest import mock

    from snrt.scheduler import planner

    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    roomy = make_plan(graph, 8, "none").arena_bytes
    assert planner.fitting_plan(graph, 8, policy, roomy) == make_plan(graph, 8, policy, budget=roomy)
    with pytest.raises(BudgetError):
        make_plan(graph, 8, policy, budget=2**20)
    with mock.patch.object(planner, "_infeasible", side_effect=AssertionError("searched for the largest batch")):
        assert planner.fitting_plan(graph, 8, policy, 2**20) is None


def test_policy_auto_needs_a_budget():
    graph = build([("relu", 0, 0)])
    with pytest.raises(snrt.SnrtError, match="picks the fastest plan within a budget"):
        make_plan(graph, 2, "auto")


def test_device_bytes_are_nonnegative_and_peak_is_their_max():
    plan = make_plan(build([("conv", 0, 0), ("add", 1, 0)]), 2, "superneurons")
    assert min(plan.device_bytes) > 0
    assert plan.peak_bytes == max(plan.device_bytes) == int(np.max(plan.device_bytes))


@pytest.mark.parametrize("policy", POLICIES)
def test_deferred_updates_follow_the_whole_backward_pass_and_their_gradients_are_counted(policy):
    graph = snrt.load_config("configs/lenet.yaml").graph
    fused = make_plan(graph, 4, policy)
    deferred = make_plan(graph, 4, policy, deferred_updates=True)
    verify_plan(deferred)
    kinds = [s.kind for s in deferred.steps]
    last_backward = max(i for i, k in enumerate(kinds) if k == "backward")
    updates = [i for i, k in enumerate(kinds) if k == "update"]
    assert updates and min(updates) > last_backward
    assert [s.node for s in deferred.steps if s.kind == "update"] == [s.node for s in fused.steps if s.kind == "update"]
    # when the first update runs, every parameter gradient is alive on the device (or copied out)
    grads = {b.id for b in deferred.buffers if b.role == "parameter_gradient"}
    alive = set()
    for step, fresh in zip(deferred.steps[:min(updates)], deferred.allocations):
        alive |= set(fresh)
        if step.kind == "free":
            alive -= set(step.buffers)
    offloaded = {s.buffer for s in deferred.steps if s.kind == "offload"}
    assert grads <= alive | offloaded
    # (the peak may move either way: gradients live longer, but the updates' workspaces no
    # longer meet the backward pass's activations)
    if policy == "none":  # nothing is freed: the same buffers, a different order
        assert deferred.peak_bytes == fused.peak_bytes


def test_an_optimizer_that_clips_by_the_global_norm_refuses_a_plan_with_fused_updates():
    from snrt.backends.numpy_backend import NumpyBackend
    from snrt.executor import Executor
    from snrt.optim import SGD

    graph = snrt.load_config("configs/lenet.yaml").graph
    plan = make_plan(graph, 2, "liveness")
    executor = Executor(graph, plan, NumpyBackend(plan.arena_bytes))
    x = np.zeros((2, *graph["data"].shape), np.float32)
    with pytest.raises(RuntimeError, match="plan it with deferred_updates=True"):
        executor.run({"data": x, "label": np.zeros(2, np.int64)}, 0, 0, SGD(clip_norm=1.0), 0.1)


def test_plans_made_one_after_another_follow_the_graph_batch_and_options():
    """make_plan reuses the iteration it built last: a plan for another image size, batch,
    label dtype or optimizer is still that one's own, equal to a plan made afresh."""
    from snrt.scheduler import session

    def config(size):
        return snrt.load_config("configs/lenet.yaml", {"input.shape": [1, size, size]})

    first = make_plan(config(8).graph, 2, "superneurons")
    cases = [(config(12).graph, 2, {}), (config(8).graph, 3, {}),
             (config(8).graph, 2, {"optimizer_states": ("exp_avg", "exp_avg_sq")}),
             (config(8).graph, 2, {"deferred_updates": True})]
    for graph, batch, options in cases:
        reused = make_plan(graph, batch, "superneurons", **options)
        session.forget()  # forget the iteration: a plan made afresh
        assert reused == make_plan(graph, batch, "superneurons", **options)
        assert reused != first


def test_node_decisions_and_copied_bytes_say_what_each_policy_does():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    by_policy = {p: make_plan(graph, 8, p) for p in POLICIES}
    graph = planned_graph(graph, by_policy["none"])
    for policy, plan in by_policy.items():
        decisions = plan.node_decisions()
        assert sorted(decisions) == sorted(graph.nodes)  # every node: inputs first, then in forward order
        assert list(decisions)[:2] == [name for name, _ in plan.inputs]
        counts = {d: sum(v == d for v in decisions.values()) for d in ("keep", "recompute", "offload", "unsaved")}
        assert sum(counts.values()) == len(graph.nodes)
        out, back = plan.copied_bytes()
        if not plan.host_bytes:
            assert (out, back, counts["offload"]) == (0, 0, 0)
        else:  # every offloaded output goes out once and comes back at least once
            output = dict(plan.inputs)
            output.update((s.node, s.output) for s in plan.steps if s.kind == "forward")
            offloaded = [output[n] for n, d in decisions.items() if d == "offload"]
            assert out == sum(plan.buffers[b].nbytes for b in offloaded) and back >= out
        assert (counts["recompute"] > 0) == (policy in ("recompute", "superneurons"))
    assert by_policy["none"].node_decisions() == by_policy["liveness"].node_decisions()  # freeing moves nothing
    assert by_policy["offload"].node_decisions()["conv2d0"] == "offload"


def test_every_buffer_id_field_of_every_step_type_is_remapped():
    from dataclasses import fields

    from snrt.scheduler.plan import _REMAPPED, NOT_IDS

    for cls, remapped in _REMAPPED.items():
        assert {f.name for f in fields(cls)} - set(NOT_IDS) == {name for name, _ in remapped}, cls.__name__


def test_threads_planning_at_once_each_get_the_plan_of_their_own_graph():
    """The planner's caches are shared: planning in several threads (ranks run as threads, or a
    user's pool) must not hand one thread another graph's iteration."""
    import sys
    import threading

    cifar = "configs/cifar_resnet20.yaml"
    sizes = (32, 16, 24)
    graphs = [snrt.load_config(cifar, {"input.shape": [3, size, size]}).graph for size in sizes]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for _ in range(10):
            make_plan(graphs[0], 4, "superneurons")  # leaves the first graph's iteration cached
            shapes = {}

            def plan(k):
                p = make_plan(graphs[k], 4, "superneurons")
                shapes[k] = p.buffers[dict(p.inputs)["data"]].shape

            threads = [threading.Thread(target=plan, args=(k,)) for k in (1, 2, 1, 2, 1, 2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert shapes == {k: (4, 3, sizes[k], sizes[k]) for k in (1, 2)}
    finally:
        sys.setswitchinterval(previous)


def test_a_kernel_choice_that_timed_its_kernels_gives_the_plan_those_seconds():
    """Steps whose kernel the kernel choice timed (cuDNN's engines) are predicted at the
    timed seconds plus the step overhead; the others, and every step at a precision the
    timing did not cover, by the cost model's rates."""
    from snrt.layers.base import BACKWARD, FORWARD, LayerKernels
    from snrt.scheduler import cost

    class TimedConvolutions(LayerKernels):
        def __init__(self):
            self.asked = set()

        def measured_seconds(self, layer, in_shapes, phase, itemsize=4):
            self.asked.add((layer.type_name, phase, itemsize))
            if layer.type_name == "Conv2d" and itemsize == 4:
                return {FORWARD: 0.25, BACKWARD: 0.5}[phase]
            return None

    graph = build([("conv", 0, 0), ("bn", 1, 1), ("relu", 2, 2), ("conv", 3, 3)])
    kernels, model = TimedConvolutions(), cost.CUDA
    rated = make_plan(graph, 2, "none", cost_model=model)
    timed = make_plan(graph, 2, "none", cost_model=model, kernels=kernels)
    convolutions = sum(node.layer.type_name == "Conv2d" for node in graph.nodes.values())
    rated_conv_s = sum(cost.step_seconds(s, graph, 2, model) for s in rated.steps
                       if s.kind in ("forward", "backward") and graph[s.node].layer.type_name == "Conv2d")
    overhead = 2 * convolutions * model.step_overhead_s
    assert timed.predicted_s == pytest.approx(rated.predicted_s - rated_conv_s + convolutions * 0.75 + overhead)
    assert ("Conv2d", FORWARD, 4) in kernels.asked and ("BatchNormReLU", BACKWARD, 4) in kernels.asked
    in_bf16 = make_plan(graph, 2, "none", cost_model=model, kernels=kernels, precision="bf16")
    assert in_bf16.predicted_s < 0.75 and ("Conv2d", BACKWARD, 2) in kernels.asked


def test_an_update_reserves_the_workspace_its_kernel_choice_asks_for():
    """The optimizers' array code updates in pieces of at most UPDATE_PIECE_BYTES, so a plan
    sized for it reserves that much for an update of a larger parameter; the CPU's compiled
    updates need none, so its plans reserve none and peak no higher."""
    from snrt.backends.cpu_kernels import CPU_KERNELS
    from snrt.layers.base import UPDATE_PIECE_BYTES

    graph = snrt.load_config("configs/alexnet.yaml").graph
    for policy in ("none", "superneurons"):
        array_code = make_plan(graph, 2, policy, stream_parameters=True)
        compiled = make_plan(graph, 2, policy, stream_parameters=True, kernels=CPU_KERNELS)
        updates = [s for s in array_code.steps if s.kind == "update"]
        for step in updates:
            largest = max(array_code.buffers[p].nbytes for p, _, _, _ in step.slots)
            assert array_code.buffers[step.workspace].nbytes == min(largest, UPDATE_PIECE_BYTES)
        assert any(array_code.buffers[s.workspace].nbytes == UPDATE_PIECE_BYTES for s in updates)
        assert all(s.workspace == -1 for s in compiled.steps if s.kind == "update")
        assert not any(b.name.endswith(":workspace:update") for b in compiled.buffers)
        assert compiled.peak_bytes <= array_code.peak_bytes


@pytest.mark.parametrize("arguments, message", [
    ({"policy": ["none"]}, "unknown memory policy ['none']; expected one of none, "),
    ({"precision": ["bf16"]}, "unknown precision ['bf16']; expected one of fp32, "),
    ({"ranks": 0}, "ranks: expected a positive int, got 0"),
    ({"ranks": "2"}, "ranks: expected a positive int, got '2'"),
    ({"ranks": 2, "bucket_bytes": "25MiB"}, "bucket_bytes: expected a positive int, got '25MiB'"),
    ({"optimizer_states": "momentum"}, "optimizer_states: expected a tuple of buffer names"),  # not 8 of one letter
    ({"optimizer_states": None}, "optimizer_states: expected a tuple of buffer names"),
    ({"optimiser_states": ()}, "unknown planning option 'optimiser_states'; expected one of hide_copies, training, "),
    ({"training": "no"}, "training: expected True or False, got str 'no'"),  # not a training plan by truthiness
    ({"stream_parameters": 0}, "stream_parameters: expected True or False, got int 0"),
    ({"fuse": []}, "fuse: expected True or False, got list []"),
    ({"hide_copies": None}, "hide_copies: expected True or False, got NoneType None"),
    ({"cost_model": "cpu"}, "cost_model: expected a CostModel, got str 'cpu'"),
    ({"kernels": None}, "kernels: expected a kernel choice (a backend's kernel_choice(), with kernel_for, "),
], ids=lambda value: str(value) if isinstance(value, dict) else "")
def test_snrt_plan_names_an_option_of_the_wrong_kind(arguments, message):
    graph = snrt.load_config("configs/lenet.yaml").graph
    with pytest.raises(snrt.SnrtError, match=re.escape(message)):
        snrt.plan(graph, 2, **arguments)


def test_snrt_plan_of_something_other_than_a_graph_says_what_it_wants():
    config = snrt.load_config("configs/lenet.yaml")
    for wrong in ("configs/lenet.yaml", config):
        with pytest.raises(snrt.SnrtError, match=f"graph: expected a snrt.Graph, got {type(wrong).__name__} "):
            snrt.plan(wrong, 2)
    assert snrt.plan(config.graph, 2, hide_copies=False).peak_bytes > 0


@pytest.mark.parametrize("batch", [-1, 0, 2.5, True, "4"])
def test_snrt_plan_refuses_a_batch_that_is_not_a_positive_int(batch):
    graph = snrt.load_config("configs/lenet.yaml").graph
    with pytest.raises(snrt.SnrtError, match=f"batch: expected a positive int, got {re.escape(repr(batch))}"):
        snrt.plan(graph, batch=batch)
    with pytest.raises(snrt.SnrtError, match="budget: expected a byte size"):
        snrt.plan(graph, batch=2, budget="lots")
