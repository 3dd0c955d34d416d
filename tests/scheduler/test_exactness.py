"""Memory policies never change results: bit-identical training under every policy, with the
executor's check mode on (poisoned memory, live bytes verified after every step)."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.config import DataConfig, TrainConfig, config_from_graph, with_settings
from snrt.scheduler.policies import POLICIES
from snrt.train import Trainer
from tests.scheduler.graphs import CLASSES, build, graph_recipes
from tests.test_train import MODERN, PASS_THROUGH, SEGMENT, SMALL_RESNET, UNET

CONCAT_NET = {
    "name": "concat_net",
    "input": {"shape": [3, 10, 10], "classes": 4},
    "blocks": {
        "mixed": {  # Inception-style branches joined by Concat, DenseNet-style reuse of $in
            "args": {"width": None},
            "layers": [
                {"type": "Conv2d", "name": "a", "inputs": ["$in"], "out_channels": "$width", "kernel": 1},
                {"type": "BatchNorm"},
                {"type": "ReLU", "name": "a_out"},
                {"type": "MaxPool", "name": "b", "inputs": ["$in"], "kernel": 3, "stride": 1, "padding": 1},
                {"type": "Conv2d", "out_channels": "$width", "kernel": 3, "padding": 1},
                {"type": "LeakyReLU", "name": "b_out", "slope": 0.1},
                {"type": "Concat", "inputs": ["$in", "a_out", "b_out"]},
            ],
        }
    },
    "train": {"batch": 4, "seed": 1, "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.0005},
              "data": {"samples": 32}},
    "network": [
        {"type": "Conv2d", "out_channels": 4, "kernel": 3, "padding": 1},
        {"block": "mixed", "args": {"width": 3}, "repeat": 2},
        {"type": "AvgPool", "kernel": 2},
        {"type": "Sigmoid"},
        {"type": "Flatten"},
        {"type": "Dropout", "p": 0.2},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


# Inception's stem joins a convolution and a pooling of the images: the pooled branch, which no
# parameter reaches, has no gradient, and neither has the input joined a second time
STEM = {
    "name": "stem",
    "input": {"shape": [3, 8, 8], "classes": 4},
    "train": {"batch": 2, "seed": 2, "optimizer": {"lr": 0.05, "momentum": 0.9}, "data": {"samples": 8}},
    "network": [
        {"type": "Conv2d", "name": "conv", "out_channels": 4, "kernel": 3, "padding": 1},
        {"type": "MaxPool", "name": "pool", "inputs": ["data"], "kernel": 3, "stride": 1, "padding": 1},
        {"type": "Concat", "name": "joined", "inputs": ["pool", "conv", "data"]},
        {"type": "BatchNorm"},
        {"type": "ReLU"},
        {"type": "Conv2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


def run_under(config, policy, iterations, stream=False):
    """Losses, persistent arrays and (predicted, measured) peaks of a checked run (`stream`:
    parameters and optimizer state streamed from the host store)."""
    trainer = Trainer(with_settings(config, memory={"policy": policy, "stream_parameters": stream}), check=True)
    losses = [m.loss for m in trainer.fit(iterations=iterations)]
    return losses, trainer.host_arrays(), (trainer.plan.peak_bytes, trainer.backend.arena.peak_bytes)


def assert_policies_agree(config, iterations, stream=False):
    """Every freeing policy (streaming parameters, with `stream`) trains as `none` does, bit
    for bit, and its measured peak is its planned peak."""
    base_losses, base_arrays, peaks = run_under(config, "none", iterations)
    assert peaks[0] == peaks[1]
    for policy in list(POLICIES)[1:]:
        losses, arrays, (predicted, measured) = run_under(config, policy, iterations, stream)
        assert losses == base_losses, policy
        for key, value in arrays.items():
            np.testing.assert_array_equal(value, base_arrays[key], err_msg=f"{policy}: {key}")
        assert measured == predicted, policy
        assert predicted < peaks[0], policy


def test_resnet_with_batchnorm_is_bit_identical_under_every_policy():
    assert_policies_agree(snrt.load_config(SMALL_RESNET), iterations=3)


def test_concat_branches_are_bit_identical_under_every_policy():
    assert_policies_agree(snrt.load_config(CONCAT_NET), iterations=3)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_concat_of_branches_without_gradients_is_bit_identical_under_every_policy(precision):
    assert_policies_agree(with_settings(snrt.load_config(STEM), train={"precision": precision}), iterations=2)


@pytest.mark.parametrize("name, size", [("alexnet", 67), ("se_resnet50", 32), ("mobilenet_v2", 32),
                                        ("convnext_tiny", 32), ("efficientnet_b0", 32), ("unet", 32)])
def test_zoo_networks_are_bit_identical_under_every_policy(name, size):
    """AlexNet (dropout, LRN), SE-ResNet-50 (squeeze-and-excitation gates), MobileNetV2
    (depthwise convolutions, ReLU6), ConvNeXt-T (LayerNorm, GELU, layer scale),
    EfficientNet-B0 (SiLU, gates inside depthwise blocks) and U-Net (transposed convolutions,
    two-input blocks, a per-pixel loss, flipped label maps), small images, batch 2."""
    config = snrt.load_config(f"configs/{name}.yaml", {
        "input.shape": [3, size, size], "train.batch": 2, "train.data": {"samples": 8}})
    assert_policies_agree(config, iterations=2)


CLIP_NORM = {**MODERN, "name": "clip_norm", "train": {**MODERN["train"], "optimizer": {
    "type": "adamw", "lr": 0.01, "weight_decay": 0.01, "clip_norm": 0.05}}}


@pytest.mark.parametrize("doc", [MODERN, UNET, CLIP_NORM, SEGMENT, PASS_THROUGH], ids=lambda doc: doc["name"])
def test_newer_layers_and_two_input_blocks_are_bit_identical_under_every_policy(doc):
    assert_policies_agree(snrt.load_config(doc), iterations=3)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=8))
def test_generated_graphs_train_identically_under_every_policy(recipe):
    train = TrainConfig(batch=2, iterations=2, data=DataConfig(samples=8))
    assert_policies_agree(config_from_graph(build(recipe), CLASSES, train), iterations=2)


def test_check_mode_catches_a_read_of_freed_memory():
    from dataclasses import replace

    from snrt.backends.numpy_backend import NumpyBackend
    from snrt.executor import Executor, PlanViolation

    trainer = Trainer(snrt.load_config(SMALL_RESNET, {"memory.policy": "liveness"}), check=True)
    plan = trainer.plan
    k = next(i for i, s in enumerate(plan.steps)
             if s.kind == "free" and set(s.buffers) & set(plan.steps[i - 1].reads()))
    freed = sum(plan.buffers[b].nbytes for b in plan.steps[k].buffers)
    # run the step before that free once more, after the free: it reads freed memory
    broken = replace(
        plan,
        steps=plan.steps[:k + 1] + (plan.steps[k - 1],) + plan.steps[k + 1:],
        allocations=plan.allocations[:k + 1] + ((),) + plan.allocations[k + 1:],
        device_bytes=plan.device_bytes[:k + 1] + (plan.device_bytes[k] - freed,) + plan.device_bytes[k + 1:],
    )
    trainer.executor = Executor(trainer.graph, broken, NumpyBackend(plan.arena_bytes, check=True))
    with pytest.raises(PlanViolation, match="holds poison"):
        trainer.fit(iterations=1)


def test_wrapped_steps_run_once_per_iteration_in_plan_order_and_change_nothing():
    """`wrap_steps` (how kernels are timed) sees every step of the wrapped kinds once per
    iteration, in plan order, and the run it wraps gives the same losses as an unwrapped one."""
    config = snrt.load_config(SMALL_RESNET, {"memory.policy": "superneurons"})
    plain, wrapped = Trainer(config), Trainer(config)
    kinds = ("forward", "recompute", "backward")
    seen = []

    def record(step, action):
        def run():
            seen.append(step)
            action()
        return run

    wrapped.executor.wrap_steps(kinds, record)
    losses = ([], [])
    for trainer, out in zip((plain, wrapped), losses):
        trainer.fit(iterations=2, on_iteration=lambda m, out=out: out.append(m.loss))
    expected = [s for s in wrapped.plan.steps if s.kind in kinds]
    assert any(s.kind == "recompute" for s in expected)
    assert seen == expected * 2
    assert losses[0] == losses[1]


@pytest.mark.parametrize("optimizer", ["adam", "adamw"])
def test_adam_is_bit_identical_under_every_policy_and_its_two_moments_are_planned(optimizer):
    doc = {**SMALL_RESNET, "train": {**SMALL_RESNET["train"], "optimizer": {"type": optimizer, "lr": 0.01,
                                                                             "weight_decay": 0.01}}}
    config = snrt.load_config(doc)
    assert_policies_agree(config, iterations=3)
    plan = Trainer(config).plan
    by_role = {}
    for b in plan.buffers:
        by_role[b.role] = by_role.get(b.role, 0) + b.nbytes
    assert by_role["optimizer_state"] == 2 * by_role["parameter"]
    assert {b.name.rsplit(":", 1)[1] for b in plan.buffers if b.role == "optimizer_state"} == {"exp_avg", "exp_avg_sq"}
