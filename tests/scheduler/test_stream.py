"""Streamed parameters and optimizer state: plans that hold them on the device only while
steps use them, and training that stays bit-identical to `none`."""

from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.config import DataConfig, TrainConfig, config_from_graph
from snrt.scheduler.planner import BudgetError, make_plan
from snrt.scheduler.policies import POLICIES
from snrt.scheduler.verify import verify_plan
from tests.scheduler.graphs import CLASSES, build, graph_recipes
from tests.scheduler.test_exactness import CLIP_NORM, assert_policies_agree
from tests.test_train import MODERN, SMALL_RESNET

FREEING = [name for name, p in POLICIES.items() if p.frees]


def homes(plan):
    """{buffer id: host slot} of the streamed tensors' own buffers."""
    return {b.id: b.host_slot for b in plan.buffers if b.role in ("parameter", "optimizer_state") and not b.is_copy}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_streamed_plans_hold_no_parameter_between_its_uses_and_keep_their_rules(recipe):
    graph = build(recipe)
    for policy in FREEING:
        plan = make_plan(graph, 2, policy, stream_parameters=True)
        verify_plan(plan)
        assert all(b.role == "state" for b in plan.buffers if b.resident)
        slots = sorted((b.host_slot, b.host_slot + b.nbytes) for b in plan.buffers
                       if b.host_slot >= 0 and not b.is_copy)
        assert all(end <= start for (_, end), (start, _) in zip(slots, slots[1:]))  # homes and offload slots apart
        assert plan.host_bytes >= sum(plan.buffers[b].nbytes for b in homes(plan))
        for b in plan.buffers:
            if b.is_copy and b.role in ("parameter", "optimizer_state"):
                original = next(o for o in plan.buffers if o.name == b.name.split("@")[0])
                assert b.host_slot == original.host_slot  # a copy goes back to its tensor's home


def test_each_parameter_comes_for_its_forward_and_its_backward_and_goes_home_after_its_update():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    plan = make_plan(graph, 4, "liveness", stream_parameters=True)
    weight = next(b for b in plan.buffers if b.name == "stage1.0.body.conv2d0:weight")
    copies = {b.id for b in plan.buffers if b.name.split("@")[0] == weight.name}
    kinds = [s.kind for s in plan.steps
             if (s.kind in ("prefetch", "offload") and s.buffer in copies)
             or (s.kind in ("forward", "backward", "update") and s.node == "stage1.0.body.conv2d0")]
    assert kinds == ["prefetch", "forward", "prefetch", "backward", "update", "offload"]
    momentum = [s.kind for s in plan.steps if s.kind in ("prefetch", "offload")
                and plan.buffers[s.buffer].name.startswith("stage1.0.body.conv2d0:weight:momentum")]
    assert momentum == ["prefetch", "offload"]
    to_host, to_device = plan.copied_bytes()
    params = sum(b.nbytes for b in plan.buffers if b.role == "parameter" and not b.is_copy)
    assert (to_host, to_device) == (2 * params, 3 * params)  # weights and momentum home; weights twice, momentum in


def test_streaming_lowers_the_peak_by_what_the_parameters_held_and_the_budget_sees_it():
    graph = snrt.load_config("configs/vgg16.yaml", {"input.shape": [3, 32, 32]}).graph
    resident = make_plan(graph, 2, "superneurons")
    streamed = make_plan(graph, 2, "superneurons", stream_parameters=True)
    params = sum(b.nbytes for b in resident.buffers if b.role in ("parameter", "optimizer_state"))
    # the 4096 x 4096 linear layer holds 47% of them, and its weight, gradient and momentum are
    # on the device together while it updates: streaming frees a little more than the rest
    assert streamed.peak_bytes < resident.peak_bytes - params // 3
    with pytest.raises(BudgetError):
        make_plan(graph, 2, "superneurons", budget=params)
    verify_plan(make_plan(graph, 2, "superneurons", budget=params, stream_parameters=True), budget=params)


def test_a_resnet_trains_bit_identically_with_streamed_parameters_under_every_policy():
    assert_policies_agree(snrt.load_config(SMALL_RESNET), iterations=3, stream=True)


@pytest.mark.parametrize("doc", [MODERN, CLIP_NORM], ids=lambda doc: doc["name"])
def test_newer_layers_adamw_and_deferred_updates_train_bit_identically_streamed(doc):
    assert_policies_agree(snrt.load_config(doc), iterations=3, stream=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=8))
def test_generated_graphs_train_identically_streamed(recipe):
    train = TrainConfig(batch=2, iterations=2, data=DataConfig(samples=8))
    assert_policies_agree(config_from_graph(build(recipe), CLASSES, train), iterations=2, stream=True)


def test_a_streamed_run_checkpoints_and_resumes_exactly_and_either_way(tmp_path):
    import numpy as np

    from snrt.config import with_settings
    from snrt.train import Trainer

    resident = with_settings(snrt.load_config(SMALL_RESNET), memory={"policy": "liveness"})
    streamed = with_settings(resident, memory={"stream_parameters": True})
    straight = Trainer(streamed)
    straight.fit(iterations=4)
    first = Trainer(resident)  # a resident run's checkpoint resumes streamed, and on
    first.fit(iterations=2)
    first.save(tmp_path / "half.npz")
    second = Trainer(streamed)
    second.restore(tmp_path / "half.npz")
    second.fit(iterations=4)
    expected, got = straight.host_arrays(), second.host_arrays()
    assert sorted(expected) == sorted(got)
    for key, value in expected.items():
        assert np.array_equal(got[key], value), key


def test_snrt_plan_and_train_take_stream_parameters(tmp_path, capsys):
    import json

    from snrt.cli import main

    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "4", "--policy", "liveness", "--stream-parameters",
                 "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["chosen"]
    params = snrt.load_config("configs/cifar_resnet20.yaml").graph.num_params() * 4
    assert chosen["copied_to_host_bytes"] == 2 * params and chosen["copied_to_device_bytes"] == 3 * params
    assert "parameter" not in chosen["peak_by_role"] or chosen["peak_by_role"]["parameter"] < params
    out = tmp_path / "run"
    assert main(["train", "configs/cifar_resnet20.yaml", "--batch", "4", "--image-size", "16", "--iterations", "2",
                 "--policy", "superneurons", "--stream-parameters", "--no-progress", "--no-eval", "--out",
                 str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measured_peak_device_bytes"] == summary["predicted_peak_device_bytes"]
    assert "stream_parameters: true" in (out / "config.yaml").read_text()


def test_auto_streams_the_parameters_only_when_nothing_fits_with_them_resident():
    graph = snrt.load_config("configs/vgg16.yaml", {"input.shape": [3, 32, 32]}).graph
    resident = make_plan(graph, 2, "auto", budget=2**31)
    assert resident.policy.startswith("auto:") and "streamed" not in resident.policy
    assert all(b.resident for b in resident.buffers if b.role == "parameter")
    budget = 300 * 2**20  # fc7's update alone needs 4 x 64 MiB; parameters and momentum are 288 MiB
    streamed = make_plan(graph, 2, "auto", budget=budget)
    assert streamed.policy.endswith(", streamed") and streamed.arena_bytes <= budget
    verify_plan(streamed, budget=budget)
    with pytest.raises(BudgetError, match="stream them from host memory"):
        make_plan(graph, 2, "superneurons", budget=budget)


def test_auto_streams_from_the_iteration_it_built_for_the_resident_plans():
    """Streaming parameters changes no step of the unscheduled iteration: auto's streamed
    candidates are lowered from the one it built for the resident ones."""
    from snrt.scheduler import session

    graph = snrt.load_config("configs/vgg16.yaml", {"input.shape": [3, 32, 32]}).graph
    session.forget()
    with mock.patch.object(session, "build_iteration", wraps=session.build_iteration) as built:
        streamed = make_plan(graph, 2, "auto", budget=300 * 2**20)
    assert streamed.policy.endswith(", streamed") and built.call_count == 1


def test_a_run_under_auto_streams_when_it_must_and_trains_as_none_does(monkeypatch):
    import numpy as np

    from snrt.backends.numpy_backend import NumpyBackend
    from snrt.config import with_settings
    from snrt.train import Trainer

    # the layers' own convolutions: the direct kernel's workspace would be this small network's
    # peak under every policy, and no streaming could lower it
    monkeypatch.setenv("SNRT_CPU_KERNELS", "im2col")
    config = snrt.load_config(SMALL_RESNET)
    reference = Trainer(config)
    reference.fit(iterations=2)
    floor = make_plan(config.graph, config.train.batch, "superneurons", stream_parameters=True,
                      kernels=NumpyBackend.kernel_choice()).arena_bytes
    tight = Trainer(with_settings(config, memory={"policy": "auto", "budget": floor}), check=True)
    assert tight.plan.policy.endswith(", streamed")
    tight.fit(iterations=2)
    assert tight.backend.arena.peak_bytes == tight.plan.peak_bytes <= floor
    expected, got = reference.host_arrays(), tight.host_arrays()
    for key, value in expected.items():
        assert np.array_equal(got[key], value), key


def test_the_timeline_counts_parameter_traffic_apart_from_activations(tmp_path):
    from snrt.timeline import copy_traffic, draw_timeline

    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    plan = make_plan(graph, 4, "offload", stream_parameters=True)
    traffic = copy_traffic(plan)
    params = sum(b.nbytes for b in plan.buffers if b.role == "parameter" and not b.is_copy)
    weights = "parameters and optimizer state"
    assert traffic[("out", weights)][-1] == 2 * params and traffic[("in", weights)][-1] == 3 * params
    assert (traffic[("out", "activations")][-1] + 2 * params, traffic[("in", "activations")][-1] + 3 * params) == \
        plan.copied_bytes()
    assert all(len(values) == len(plan.steps) for values in traffic.values())
    draw_timeline(plan, tmp_path / "t.png")
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"
    assert copy_traffic(make_plan(graph, 4, "liveness")) == {}


def test_snrt_plan_layers_says_where_each_layers_parameters_live(capsys):
    import json

    from snrt.cli import main

    args = ["plan", "configs/cifar_resnet20.yaml", "--batch", "4", "--policy", "superneurons", "--json", "--layers"]
    assert main(args) == 0
    assert set(json.loads(capsys.readouterr().out)["chosen"]["parameters"].values()) == {"resident"}
    assert main([*args, "--stream-parameters"]) == 0
    homes = json.loads(capsys.readouterr().out)["chosen"]["parameters"]
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    with_params = {name for name, node in graph.nodes.items()
                   if node.inputs and node.layer.param_specs(graph.in_shapes(name, 4))}
    assert set(homes) == with_params and set(homes.values()) == {"streamed"}
