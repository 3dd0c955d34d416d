"""Fusion as a graph fact (snrt/scheduler/fuse.py): which pairs fold, what the plan then holds,
and that a fused plan trains as the unfused one does, bit for bit, under every policy."""

import numpy as np
import pytest

import snrt
from snrt.config import with_settings
from snrt.graph import Graph
from snrt.layers.activation import ReLU
from snrt.layers.conv import Conv2d
from snrt.layers.fused import AddReLU, BatchNormReLU
from snrt.layers.input import Input
from snrt.layers.join import Add
from snrt.layers.norm import BatchNorm
from snrt.scheduler.fuse import fuse_layers, planned_graph
from snrt.train import Trainer
from tests.scheduler.test_exactness import CONCAT_NET, assert_policies_agree
from tests.test_train import SMALL_RESNET


def _block():
    """conv -> bn -> relu -> conv -> bn2 -> add(bn2, data) -> relu (out) -> bn3; bn3 read by a
    ReLU and a conv, each read by join, an Add read by a ReLU and a conv."""
    g = Graph("block")
    g.add(Input(shape=(4, 6, 6)), name="data")
    g.add(Conv2d(out_channels=4, kernel=3, padding=1), name="conv")
    g.add(BatchNorm(momentum=0.3), name="bn")
    g.add(ReLU(), name="relu")
    g.add(Conv2d(out_channels=4, kernel=3, padding=1), name="conv2")
    g.add(BatchNorm(), name="bn2")
    g.add(Add(), inputs=["bn2", "data"], name="add")
    g.add(ReLU(), name="out")
    g.add(BatchNorm(), name="bn3")
    g.add(ReLU(), name="relu3")
    g.add(Conv2d(out_channels=4, kernel=1), inputs=["bn3"], name="side")
    g.add(Add(), inputs=["relu3", "side"], name="join")
    g.add(ReLU(), name="relu4")
    g.add(Conv2d(out_channels=4, kernel=1), inputs=["join"], name="head")
    return g


def test_each_relu_folds_into_the_batch_norm_or_add_it_alone_reads():
    fused = fuse_layers(_block())
    assert list(fused.nodes) == ["data", "conv", "bn", "conv2", "bn2", "add", "bn3", "relu3", "side", "join",
                                 "relu4", "head"]
    assert fused["bn"].layer == BatchNormReLU(momentum=0.3)  # the options kept
    assert fused["conv2"].inputs == ("bn",)  # the ReLU's reader reads the fused node
    assert type(fused["add"].layer) is AddReLU and fused["add"].inputs == ("bn2", "data")
    assert fused["bn3"].inputs == ("add",)  # "out", folded into "add"
    assert type(fused["bn3"].layer) is BatchNorm  # its output is read twice: nothing to fold
    assert type(fused["join"].layer) is Add  # the same
    assert fused.param_specs() == _block().param_specs()  # the same parameters under the same names
    assert fuse_layers(fused) is fused  # nothing left to fold


def test_a_graph_without_pairs_is_returned_as_it_is():
    g = Graph("plain")
    g.add(Input(shape=(3,)), name="x")
    g.add(ReLU(), name="r")
    assert fuse_layers(g) is g


def _trained(doc, fuse, policy="none", iterations=3):
    trainer = Trainer(with_settings(snrt.load_config(doc), train={"fuse": fuse}, memory={"policy": policy}),
                      check=True)
    losses = [m.loss for m in trainer.fit(iterations=iterations)]
    assert trainer.plan.peak_bytes == trainer.backend.arena.peak_bytes
    return trainer, losses, trainer.host_arrays()


@pytest.mark.parametrize("doc", [SMALL_RESNET, CONCAT_NET], ids=["small_resnet", "concat_net"])
def test_a_fused_plan_trains_as_the_unfused_one_bit_for_bit(doc):
    unfused, unfused_losses, unfused_arrays = _trained(doc, False)
    fused, fused_losses, fused_arrays = _trained(doc, True)
    assert not unfused.plan.fused and fused.plan.fused
    assert fused_losses == unfused_losses
    assert fused_arrays.keys() == unfused_arrays.keys()
    for key, value in unfused_arrays.items():
        assert np.array_equal(value, fused_arrays[key]), key
    # fewer steps, and neither the tensor between the parts nor its gradient planned
    assert len(fused.plan.steps) < len(unfused.plan.steps)
    assert fused.plan.peak_bytes <= unfused.plan.peak_bytes
    names = {b.name.partition(":")[0] for b in fused.plan.buffers}
    assert names < {b.name.partition(":")[0] for b in unfused.plan.buffers}
    types = {node.layer.type_name for node in planned_graph(fused.config.graph, fused.plan).nodes.values()}
    assert "BatchNormReLU" in types and "BatchNormReLU" not in {
        node.layer.type_name for node in planned_graph(unfused.config.graph, unfused.plan).nodes.values()}
    if doc is SMALL_RESNET:
        assert "AddReLU" in types


def test_every_policy_of_a_fused_plan_agrees_with_none():
    assert_policies_agree(snrt.load_config(SMALL_RESNET), iterations=2)


def test_a_fused_step_saves_only_the_batch_norms_input_and_nothing_between():
    plan = snrt.plan(snrt.load_config(SMALL_RESNET).graph, batch=4, policy="liveness")
    forward = {s.node: s for s in plan.steps if s.kind == "forward"}
    backward = {s.node: s for s in plan.steps if s.kind == "backward"}
    assert "batchnorm0" in forward and "relu0" not in forward  # the stem's BatchNorm took its ReLU
    step = backward["batchnorm0"]  # its input (the mask is computed again from it)
    assert step.saved_inputs == (forward["batchnorm0"].inputs[0],) and step.saved_output == -1
    assert not any(b.name.startswith(("relu0", "basic0.relu0")) for b in plan.buffers)


def test_train_fuse_must_be_true_or_false():
    with pytest.raises(snrt.SnrtError, match="train.fuse"):
        snrt.load_config({**SMALL_RESNET, "train": {**SMALL_RESNET["train"], "fuse": "yes"}})


# Residual blocks with identity shortcuts, each ending in Add+ReLU (fused: AddReLU), then an
# AddReLU ("sum") whose output and an earlier tensor ("side", read by nothing else) are summed
# by a plain Add ("late"), which hands its gradient buffer to both: "sum"'s backward then is not
# the last to read that buffer ("side"'s comes after), so it must not write over it.
CHAIN = {
    "name": "chain",
    "input": {"shape": [3, 8, 8], "classes": 4},
    "blocks": {"identity": {"layers": [
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1, "bias": False},
        {"type": "BatchNorm"},
        {"type": "ReLU"},
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1, "bias": False},
        {"type": "BatchNorm", "name": "bn"},
        {"type": "Add", "inputs": ["bn", "$in"]},
        {"type": "ReLU"},
    ]}},
    "train": {"batch": 4, "iterations": 3, "seed": 5,
              "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.001}, "data": {"samples": 32}},
    "network": [
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1},
        {"type": "BatchNorm"},
        {"type": "ReLU"},
        {"block": "identity"},
        {"block": "identity"},
        {"type": "Conv2d", "name": "side", "out_channels": 6, "kernel": 1},
        {"type": "Conv2d", "name": "deep", "inputs": ["identity1"], "out_channels": 6, "kernel": 3,
         "padding": 1},
        {"type": "Add", "name": "sum", "inputs": ["deep", "identity1"]},
        {"type": "ReLU", "name": "sum_relu"},
        {"type": "Add", "name": "late", "inputs": ["sum_relu", "side"]},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


def _add_relu_steps(plan, graph):
    """{AddReLU node: how many of its input gradients its backward writes over gy}."""
    nodes = planned_graph(graph, plan).nodes
    return {s.node: sum(g is not None and s.grad_output in g for g in s.grad_inputs)
            for s in plan.steps if s.kind == "backward" and type(nodes[s.node].layer) is AddReLU}


def test_add_relu_writes_over_gy_only_where_its_step_reads_it_last():
    """In the chain of residual blocks both input gradients of each AddReLU are its gy: one
    buffer carries the gradient down the chain, masked in place at each block's end."""
    config = snrt.load_config(CHAIN)
    plan = snrt.plan(config.graph, batch=4, policy="liveness")
    assert _add_relu_steps(plan, config.graph) == {"identity0.add0": 2, "identity1.add0": 2, "sum": 0}
    gradients = {b.name for b in plan.buffers if b.role == "gradient"}
    assert "identity1.add0:grad" in gradients and "identity0.add0:grad" not in gradients


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_fused_add_relu_trains_as_add_then_relu_bit_for_bit(precision):
    """In every precision (2-byte sums rounded and then clipped, or clipped in fp32 and then
    rounded, are the same number), the masks from the saved output alike."""
    doc = {**CHAIN, "train": {**CHAIN["train"], "precision": precision}}
    unfused, unfused_losses, unfused_arrays = _trained(doc, False)
    fused, fused_losses, fused_arrays = _trained(doc, True)
    assert fused_losses == unfused_losses
    for key, value in unfused_arrays.items():
        assert np.array_equal(value, fused_arrays[key]), key
    assert fused.plan.peak_bytes < unfused.plan.peak_bytes  # neither the sum nor its gradient planned


def test_every_policy_of_a_plan_with_add_relu_agrees_with_none():
    assert_policies_agree(snrt.load_config(CHAIN), iterations=2)


# An AddReLU of one tensor with itself (its gradient reaches that tensor twice: once over gy,
# once added from a partial buffer), then one of a convolution and the first.
TWICE = {
    "name": "twice",
    "input": {"shape": [3, 8, 8], "classes": 4},
    "train": {"batch": 4, "iterations": 3, "seed": 1, "optimizer": {"lr": 0.05, "momentum": 0.9},
              "data": {"samples": 32}},
    "network": [
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1, "name": "c"},
        {"type": "Add", "inputs": ["c", "c"], "name": "twice"},
        {"type": "ReLU", "name": "twice_relu"},
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1, "name": "d"},
        {"type": "Add", "inputs": ["d", "twice_relu"], "name": "join"},
        {"type": "ReLU"},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


def test_an_add_relu_of_a_tensor_with_itself_trains_as_add_then_relu_under_every_policy():
    fused_graph = fuse_layers(snrt.load_config(TWICE).graph)
    assert type(fused_graph["twice"].layer) is AddReLU and fused_graph["twice"].inputs == ("c", "c")
    _, unfused_losses, unfused_arrays = _trained(TWICE, False)
    _, fused_losses, fused_arrays = _trained(TWICE, True)
    assert fused_losses == unfused_losses
    for key, value in unfused_arrays.items():
        assert np.array_equal(value, fused_arrays[key]), key
    assert_policies_agree(snrt.load_config(TWICE), iterations=2)
