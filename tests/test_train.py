"""End-to-end training on the CPU backend: learning, PyTorch parity, determinism, checkpoints."""

import errno
import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.checkpoint import CheckpointError
from snrt.config import config_from_graph
from snrt.train import Trainer
from snrt.torch_reference import TorchNet, torch_sgd
from tests.scheduler.graphs import CLASSES, build, graph_recipes

SMALL_RESNET = {
    "name": "small_resnet",
    "input": {"shape": [3, 12, 12], "classes": 5},
    "blocks": {
        "basic": {
            "args": {"channels": None, "stride": 1},
            "layers": [
                {"type": "Conv2d", "out_channels": "$channels", "kernel": 3, "stride": "$stride", "padding": 1, "bias": False},
                {"type": "BatchNorm"},
                {"type": "ReLU"},
                {"type": "Conv2d", "out_channels": "$channels", "kernel": 3, "padding": 1, "bias": False},
                {"type": "BatchNorm", "name": "bn"},
                {"type": "Conv2d", "name": "proj", "inputs": ["$in"], "out_channels": "$channels", "kernel": 1, "stride": "$stride"},
                {"type": "Add", "inputs": ["bn", "proj"]},
                {"type": "ReLU"},
            ],
        }
    },
    "train": {"batch": 8, "iterations": 6, "seed": 3,
              "optimizer": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
              "data": {"samples": 64}},
    "network": [
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1},
        {"type": "BatchNorm"},
        {"type": "ReLU"},
        {"type": "MaxPool", "kernel": 2},
        {"block": "basic", "args": {"channels": 8, "stride": 2}},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


# The newer layers in one network: SiLU, GELU (both forms), ELU, Identity, a channel Softmax
# and squeeze-and-excitation gates (Mul of a feature map and an (N, C) gate).
MODERN = {
    "name": "modern",
    "input": {"shape": [3, 10, 10], "classes": 5},
    "blocks": {
        "gated": {
            "args": {"channels": None},
            "layers": [
                {"type": "GlobalAvgPool"},
                {"type": "Linear", "out_features": 3},
                {"type": "GELU"},
                {"type": "Linear", "out_features": "$channels"},
                {"type": "Sigmoid", "name": "gate"},
                {"type": "Mul", "inputs": ["$in", "gate"]},
            ],
        }
    },
    "train": {**SMALL_RESNET["train"], "batch": 6, "iterations": 4, "seed": 2, "data": {"samples": 48}},
    "network": [
        {"type": "Conv2d", "out_channels": 6, "kernel": 3, "padding": 1},
        {"type": "BatchNorm"},
        {"type": "SiLU", "name": "act"},
        # an auxiliary head: its weighted loss is added to the main one
        {"type": "GlobalAvgPool", "name": "aux_pool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy", "name": "aux_loss", "weight": 0.4},
        {"block": "gated", "inputs": ["act"], "args": {"channels": 6}},
        {"type": "ELU", "alpha": 0.5},
        {"type": "BatchNorm", "affine": False, "momentum": 0.2},
        {"type": "Identity", "name": "skip"},
        {"type": "Softmax", "name": "attend", "inputs": ["act"]},
        {"type": "Mul", "inputs": ["skip", "attend"]},
        {"type": "Conv2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1},
        {"type": "GELU", "approximate": "tanh"},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


# A small U-Net: an encoder, and a decoder block that reads two layers (the deeper map to
# upsample, as $in0, and the encoder's skip connection, as $in1).
UNET = {
    "name": "unet",
    "input": {"shape": [2, 8, 8], "classes": 3},
    "blocks": {
        "down": {"args": {"width": None}, "layers": [
            {"type": "Conv2d", "out_channels": "$width", "kernel": 3, "padding": "same"},
            {"type": "GroupNorm", "groups": 2},
            {"type": "ReLU"},
        ]},
        "up": {"args": {"width": None}, "layers": [
            {"type": "Upsample", "scale": 2, "mode": "bilinear", "inputs": ["$in0"]},
            {"type": "Concat", "inputs": ["upsample0", "$in1"]},
            {"type": "Conv2d", "out_channels": "$width", "kernel": 3, "padding": 1},
            {"type": "ReLU"},
        ]},
    },
    "train": {**SMALL_RESNET["train"], "batch": 4, "data": {"samples": 32}},
    "network": [
        {"block": "down", "name": "enc1", "args": {"width": 4}},
        {"type": "MaxPool", "kernel": 2},
        {"block": "down", "name": "enc2", "args": {"width": 8}},
        {"type": "MaxPool", "kernel": 2},
        {"type": "Conv2d", "name": "bottom", "out_channels": 8, "kernel": 1},
        {"block": "up", "name": "dec2", "inputs": ["bottom", "enc2"], "args": {"width": 6}},
        {"type": "ConvTranspose2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1, "output_padding": 1},
        {"type": "Concat", "inputs": ["convtranspose2d0", "enc1"]},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


# The U-Net as a segmenter: a class per pixel (per-pixel loss, label maps flipped with images).
SEGMENT = {**UNET, "name": "segment", "input": {**UNET["input"], "per_pixel": True},
           "train": {**UNET["train"], "data": {"samples": 32, "flip": True}},
           "network": [*UNET["network"][:-3],
                       {"type": "Conv2d", "name": "head", "out_channels": "$classes", "kernel": 1},
                       {"type": "SoftmaxCrossEntropy"}]}


# Gradients that take over their output's gradient buffer (Layer.passes_gradient), every way:
# an Add reading one tensor twice and three times, an Identity chained into an Add, an Add
# whose input already has a gradient from a later reader, an Add's gradient handed on by the
# next Add.
PASS_THROUGH = {
    "name": "pass_through",
    "input": {"shape": [3, 8, 8], "classes": 4},
    "train": {"batch": 4, "iterations": 3, "seed": 5, "optimizer": {"lr": 0.05, "momentum": 0.9},
              "data": {"samples": 16}},
    "network": [
        {"type": "Conv2d", "name": "c", "out_channels": 4, "kernel": 3, "padding": 1},
        {"type": "Identity", "name": "i"},
        {"type": "Add", "name": "twice", "inputs": ["c", "c", "i"]},
        {"type": "BatchNorm", "name": "bn"},
        {"type": "ReLU", "name": "r"},
        {"type": "Add", "name": "thrice", "inputs": ["r", "twice", "r", "r"]},
        {"type": "Add", "name": "again", "inputs": ["thrice", "i"]},
        {"type": "Conv2d", "out_channels": 4, "kernel": 3, "stride": 2, "padding": 1},
        {"type": "GlobalAvgPool"},
        {"type": "Linear", "out_features": "$classes"},
        {"type": "SoftmaxCrossEntropy"},
    ],
}


def small_config(**train):
    doc = {**SMALL_RESNET, "train": {**SMALL_RESNET["train"], **train}}
    return snrt.load_config(doc)


def batch_of(config, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((config.train.batch, *config.input.shape)).astype(np.float32)
    y = rng.integers(0, config.input.classes, (config.train.batch, *config.graph["label"].shape))
    return x, y


ADAM = {"type": "adam", "lr": 0.01, "beta1": 0.8, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.01}
# Adam divides by the gradient's own scale, so a bias whose gradient is only rounding noise (a
# conv bias before BatchNorm) would move by lr in a random direction: leave it out.
NO_NOISE_BIAS = [{**SMALL_RESNET["network"][0], "bias": False}, *SMALL_RESNET["network"][1:]]


@pytest.mark.parametrize("doc", [
    SMALL_RESNET, MODERN, UNET, SEGMENT,
    {**SMALL_RESNET, "name": "adam", "network": NO_NOISE_BIAS, "train": {**SMALL_RESNET["train"], "optimizer": ADAM}},
    {**SMALL_RESNET, "name": "adamw", "network": NO_NOISE_BIAS,
     "train": {**SMALL_RESNET["train"], "optimizer": {**ADAM, "type": "adamw"}}},
    {**SMALL_RESNET, "name": "plain_sgd", "train": {**SMALL_RESNET["train"], "optimizer": {"lr": 0.05, "momentum": 0}}},
    {**SMALL_RESNET, "name": "clipped_sgd", "train": {**SMALL_RESNET["train"], "optimizer": {
        **SMALL_RESNET["train"]["optimizer"], "lr": 0.5, "clip_value": 0.01}}},
    {**SMALL_RESNET, "name": "param_groups", "train": {**SMALL_RESNET["train"], "optimizer": {
        "lr": 0.05, "weight_decay": 0.01, "groups": [
            {"params": "linear0:*", "lr_scale": 0.5},  # the head at half the rate, decay as usual
            {"params": ["*:bias", "*batchnorm0:weight"], "weight_decay": 0.1},  # decay where it is off by default
            {"params": "basic0.conv2d?:*", "weight_decay": 0, "lr_scale": 2.0}]}}},
    {**SMALL_RESNET, "name": "clip_norm_sgd", "train": {**SMALL_RESNET["train"], "optimizer": {
        **SMALL_RESNET["train"]["optimizer"], "clip_norm": 0.2}}},
    {**SMALL_RESNET, "name": "clip_norm_and_value_adam", "network": NO_NOISE_BIAS,
     "train": {**SMALL_RESNET["train"], "optimizer": {**ADAM, "clip_norm": 0.1, "clip_value": 0.01}}},
    {**SMALL_RESNET, "name": "clipped_adamw", "network": NO_NOISE_BIAS,
     "train": {**SMALL_RESNET["train"], "optimizer": {**ADAM, "type": "adamw", "clip_value": 0.002}}},
], ids=lambda doc: doc["name"])
def test_losses_and_parameters_match_pytorch(doc):
    """Four steps of snrt and of torch.optim (SGD with and without momentum, Adam, AdamW, with
    torch.nn.utils.clip_grad_norm_ and clip_grad_value_ where clip_norm and clip_value are set,
    in that order) from the same start: the same losses and parameters."""
    config = snrt.load_config(doc)
    trainer = Trainer(config)
    params = {k: v.copy() for k, v in trainer.host_arrays(("parameter",)).items()}
    state = {k: v.copy() for k, v in trainer.host_arrays(("state",)).items()}
    net = TorchNet(config.graph, params, state)
    sgd = torch_sgd(net, config.graph, config.train.optimizer)
    for step in range(4):
        x, y = batch_of(config, step)
        ours = trainer.step(x, y, total=4).loss
        sgd.zero_grad()
        loss = net({"data": torch.tensor(x), "label": torch.tensor(y)}).mean()
        loss.backward()
        if config.train.optimizer.clip_norm:
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), config.train.optimizer.clip_norm)
            assert norm > config.train.optimizer.clip_norm  # it clips
        if config.train.optimizer.clip_value:
            assert max(p.grad.abs().max() for p in net.parameters()) > config.train.optimizer.clip_value  # it clips
            torch.nn.utils.clip_grad_value_(net.parameters(), config.train.optimizer.clip_value)
        sgd.step()
        assert ours == pytest.approx(loss.item(), rel=2e-5), f"step {step}"
    final = trainer.host_arrays(("parameter", "state"))
    for (node, name), value in final.items():
        reference = net.param(node, name) if (node, name) in params else net.state[(node, name)]
        np.testing.assert_allclose(value, reference.detach().numpy(), rtol=1e-3, atol=1e-5, err_msg=f"{node}:{name}")


@pytest.mark.parametrize("doc", [SMALL_RESNET, MODERN, SEGMENT, PASS_THROUGH], ids=lambda doc: doc["name"])
def test_gradients_match_pytorch(doc):
    config = snrt.load_config({**doc, "train": {**doc["train"], "optimizer": {"lr": 0.01, "momentum": 0.0,
                                                                             "weight_decay": 0.0}}})
    trainer = Trainer(config)
    params = trainer.host_arrays(("parameter",))
    net = TorchNet(config.graph, params, trainer.host_arrays(("state",)))
    x, y = batch_of(config, 0)
    trainer.step(x, y, total=1)
    net({"data": torch.tensor(x), "label": torch.tensor(y)}).mean().backward()
    ex = trainer.executor
    by_name = {b.name: b.id for b in trainer.plan.buffers}
    for node, name in params:
        ours = ex.views[by_name[f"{node}:{name}:grad"]]
        np.testing.assert_allclose(ours, net.param(node, name).grad.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=f"gradient of {node}:{name}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=8).filter(lambda recipe: not any(op.startswith("dropout") for op, _, _ in recipe)))
def test_the_gradients_of_generated_graphs_match_pytorch(recipe):
    """Random joins, fan-outs and layer mixes (tests/scheduler/graphs.py; Dropout's masks are
    snrt's own, so left out): one backward pass gives PyTorch autograd's parameter gradients."""
    config = config_from_graph(build(recipe), CLASSES, {"batch": 2, "data": {"samples": 4},
                                                        "optimizer": {"lr": 0.01, "momentum": 0.0}})
    trainer = Trainer(config)
    params = trainer.host_arrays(("parameter",))
    net = TorchNet(config.graph, params, trainer.host_arrays(("state",)))
    x, y = batch_of(config, 0)
    loss = trainer.step(x, y, total=1).loss
    reference = net({"data": torch.tensor(x), "label": torch.tensor(y)}).mean()
    reference.backward()
    assert loss == pytest.approx(reference.item(), rel=1e-5)
    by_name = {b.name: b.id for b in trainer.plan.buffers}
    for node, name in params:
        theirs = net.param(node, name).grad
        if f"{node}:{name}:grad" not in by_name:  # a branch no loss reads: no gradient in either
            assert theirs is None, f"{node}:{name} in {recipe}"
            continue
        ours = trainer.executor.views[by_name[f"{node}:{name}:grad"]]
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-3, atol=1e-5,
                                   err_msg=f"gradient of {node}:{name} in {recipe}")


def test_same_seed_gives_the_same_losses_bit_for_bit():
    runs = [[m.loss for m in Trainer(small_config()).fit()] for _ in range(2)]
    assert runs[0] == runs[1]
    other = [m.loss for m in Trainer(small_config(seed=4)).fit()]
    assert other != runs[0]


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    straight = Trainer(small_config())
    straight.fit()
    path = tmp_path / "ckpt.npz"
    first = Trainer(small_config())
    first.fit(iterations=3, checkpoint=path)
    resumed = Trainer(small_config())
    resumed.restore(path)
    assert resumed.iteration == 3
    resumed.fit()
    expected = straight.host_arrays()
    for key, value in resumed.host_arrays().items():
        np.testing.assert_array_equal(value, expected[key], err_msg=f"{key}")


def test_a_trainer_of_something_other_than_a_config_says_what_it_wants():
    for make in (Trainer, Trainer.plan_for):
        with pytest.raises(snrt.SnrtError, match=r"config: expected a snrt.Config \(snrt.load_config\(path\), .*got str"):
            make("configs/lenet.yaml")


def test_fit_names_a_count_of_the_wrong_kind_and_trains_nothing():
    trainer = Trainer(small_config())
    for name, value in (("iterations", "3"), ("iterations", 2.5), ("iterations", -1), ("checkpoint_every", "2")):
        with pytest.raises(snrt.SnrtError, match=re.escape(f"fit: {name}: expected an int >= 0, got {value!r}")):
            trainer.fit(**{name: value})
    assert trainer.iteration == 0
    assert [m.iteration for m in trainer.fit(iterations=np.int64(2))] == [0, 1]
    assert trainer.fit(iterations=2) == []  # up to iteration 2: there already


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    trainer = Trainer(small_config())
    path = tmp_path / "ckpt.npz"
    trainer.save(path)
    before = path.read_bytes()
    trainer.fit(iterations=1)

    write_array, written = np.lib.format.write_array, []

    def fill_the_disk(file, array, **kwargs):  # the third tensor finds the disk full half-way
        written.append(array.shape)
        if len(written) == 3:
            file.write(b"partial garbage")
            raise OSError(errno.ENOSPC, "No space left on device")
        write_array(file, array, **kwargs)

    monkeypatch.setattr(np.lib.format, "write_array", fill_the_disk)
    with pytest.raises(CheckpointError, match="No space left on device.*previous checkpoint is kept"):
        trainer.save(path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt.npz"]
    monkeypatch.undo()
    Trainer(small_config()).restore(path)


def test_corrupt_and_mismatched_checkpoints_are_clear_errors(tmp_path):
    trainer = Trainer(small_config())
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip file at all")
    with pytest.raises(CheckpointError, match="bad.npz: not a readable checkpoint"):
        trainer.restore(bad)
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        trainer.restore(tmp_path / "missing.npz")
    other = snrt.load_config({**SMALL_RESNET, "input": {"shape": [3, 12, 12], "classes": 7}})
    path = tmp_path / "other.npz"
    Trainer(other).save(path)
    with pytest.raises(CheckpointError, match=r"linear0:weight has shape \[7, 8\], the network needs \[5, 8\]"):
        trainer.restore(path)


def test_peak_device_bytes_are_measured_and_match_the_plan():
    trainer = Trainer(small_config())
    metrics = trainer.fit(iterations=2)
    assert metrics[-1].peak_device_bytes == trainer.plan.peak_bytes
    assert trainer.plan.peak_bytes <= trainer.plan.arena_bytes


def test_eval_mode_uses_running_statistics():
    trainer = Trainer(small_config())
    trainer.fit(iterations=3)
    loss, accuracy = trainer.evaluate()
    assert np.isfinite(loss) and 0 <= accuracy <= 1
    # the held-out pass must not touch training state
    state = trainer.host_arrays(("state",))
    trainer.evaluate()
    for key, value in trainer.host_arrays(("state",)).items():
        np.testing.assert_array_equal(value, state[key])


def test_resnet20_lowers_its_loss_on_synthetic_cifar_data():
    config = snrt.load_config("configs/cifar_resnet20.yaml", {
        "train.batch": 16, "train.data": {"type": "synthetic", "samples": 256},
        "train.optimizer": {"lr": 0.05, "momentum": 0.9}})
    history = Trainer(config).fit(iterations=12)
    first, last = np.mean([m.loss for m in history[:3]]), np.mean([m.loss for m in history[-3:]])
    assert last < 0.8 * first, [m.loss for m in history]


def test_lenet_learns_digits_to_95_percent():
    pytest.importorskip("sklearn", reason="the digits set comes with scikit-learn (test extra)")
    config = snrt.load_config("configs/lenet.yaml")
    trainer = Trainer(config)
    trainer.fit()
    loss, accuracy = trainer.evaluate()
    assert accuracy >= 0.95, (loss, accuracy)


def test_a_segmenter_learns_the_class_of_every_pixel():
    """Synthetic label maps (each pixel the colour of its class, plus noise): held-out pixel
    accuracy well above chance after a short run; the last held-out batch is padded."""
    config = snrt.load_config({**SEGMENT, "train": {**SEGMENT["train"], "iterations": 40, "data": {"samples": 30},
                                                    "optimizer": {"type": "adam", "lr": 0.01}}})
    trainer = Trainer(config)
    before = trainer.evaluate()[1]
    history = trainer.fit()
    loss, accuracy = trainer.evaluate()
    assert len(trainer.heldout_set) % config.train.batch  # a padded last batch
    assert 0 <= history[-1].accuracy <= 1 and np.isfinite(loss)
    assert accuracy > max(0.6, before + 0.3), (before, accuracy)  # chance is 1/3


def test_a_batch_of_another_shape_is_refused_before_the_iteration_and_the_trainer_goes_on():
    config = snrt.load_config(SMALL_RESNET)
    trainer = Trainer(config)
    x, y = batch_of(config, 0)
    with pytest.raises(snrt.SnrtError, match=r"step: data has shape \[1, 3, 12, 12\], but this trainer's plan takes "
                                             r"\[8, 3, 12, 12\]"):
        trainer.step(x[:1], y[:1], total=2)  # broadcast over the batch, it trained on 8 copies of one image
    with pytest.raises(snrt.SnrtError, match=r"step: label has shape \[8, 1\]"):
        trainer.step(x, y[:, None], total=2)
    fresh = Trainer(config)
    assert trainer.step(x, y, total=2).loss == fresh.step(x, y, total=2).loss


@pytest.mark.parametrize("policy", ["none", "superneurons"])
def test_a_step_that_fails_mid_iteration_leaves_the_trainer_ready_for_the_next(policy):
    """A fault inside the iteration (here the first forward after a copy to the host began)
    waits for the copies in flight and releases the iteration's buffers, so the next step runs
    as a fresh trainer's would (the fault came before any update)."""
    config = snrt.load_config(SMALL_RESNET, {"memory.policy": policy})
    trainer, fresh = Trainer(config, check=True), Trainer(config, check=True)
    steps = [s.kind for s in trainer.plan.steps]
    first_copy = steps.index("offload") if "offload" in steps else 0
    fault = steps.index("forward", first_copy + 1)
    kept = trainer.executor.actions[fault]

    def failing():
        trainer.executor.actions[fault] = kept
        raise MemoryError("a kernel's scratch array")
    trainer.executor.actions[fault] = failing
    x, y = batch_of(config, 0)
    with pytest.raises(MemoryError, match="scratch"):
        trainer.step(x, y, total=2)
    arena = trainer.backend.arena
    assert arena.live_bytes == sum(b.nbytes for b in arena.live.values() if b.resident)
    assert not trainer.executor.pending and trainer.iteration == 0
    assert [trainer.step(*batch_of(config, i), total=2).loss for i in range(2)] == \
        [fresh.step(*batch_of(config, i), total=2).loss for i in range(2)]
