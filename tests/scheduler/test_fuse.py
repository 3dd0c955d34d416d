"""Fusion as a graph fact (snrt/scheduler/fuse.py): which pairs fold, what the plan then holds,
and that a fused plan trains as the unfused one does, bit for bit, under every policy."""

import numpy as np
import pytest

import snrt
from snrt.config import with_settings
from snrt.graph import Graph
from snrt.layers.activation import ReLU
from snrt.layers.conv import Conv2d
from snrt.layers.fused import BatchNormReLU
from snrt.layers.input import Input
from snrt.layers.join import Add
from snrt.layers.norm import BatchNorm
from snrt.scheduler.fuse import fuse_layers, planned_graph
from snrt.train import Trainer
from tests.scheduler.test_exactness import CONCAT_NET, assert_policies_agree
from tests.test_train import SMALL_RESNET


def _block():
    """conv -> bn -> relu -> conv -> bn2 -> add(bn2, data) -> relu (out) -> bn3; bn3 read by a
    ReLU and a conv."""
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
    return g


def test_each_relu_folds_into_the_batch_norm_it_alone_reads():
    fused = fuse_layers(_block())
    assert list(fused.nodes) == ["data", "conv", "bn", "conv2", "bn2", "add", "out", "bn3", "relu3", "side", "join"]
    assert fused["bn"].layer == BatchNormReLU(momentum=0.3)  # the options kept
    assert fused["conv2"].inputs == ("bn",)  # the ReLU's reader reads the fused node
    assert type(fused["add"].layer) is Add and type(fused["out"].layer) is ReLU  # Add+ReLU is not fused
    assert type(fused["bn3"].layer) is BatchNorm  # its output is read twice: nothing to fold
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
