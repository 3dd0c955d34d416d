"""Weights shared with torchvision (snrt/weights.py): its ResNet-18, ResNet-50 and MobileNetV2,
random weights and statistics, imported with --init-from give PyTorch's eval logits; an snrt
run exported with --names-like loads into the torchvision model with strict=True and gives
snrt's logits."""

import numpy as np
import pytest
import torch
import yaml

import snrt
from snrt.cli import main
from snrt.runtime import prepare
from snrt.torch_reference import torchvision
from snrt.train import Trainer

SIZE = 64  # input side: every stride of the three networks still leaves a pixel

# torchvision's resnet18: BasicBlocks of two 3x3 convs, stages of 2, 2, 2, 2
RESNET18 = {
    "name": "resnet18", "input": {"shape": [3, SIZE, SIZE], "classes": 10},
    "train": {"batch": 4, "iterations": 2, "data": {"samples": 16}},
    "blocks": {
        "body": {"args": {"width": None, "stride": 1}, "layers": [
            {"type": "Conv2d", "out_channels": "$width", "kernel": 3, "stride": "$stride", "padding": 1, "bias": False},
            {"type": "BatchNorm"}, {"type": "ReLU"},
            {"type": "Conv2d", "out_channels": "$width", "kernel": 3, "padding": 1, "bias": False},
            {"type": "BatchNorm"}]},
        "basic": {"args": {"width": None}, "layers": [
            {"block": "body", "name": "body", "args": {"width": "$width"}},
            {"type": "Add", "inputs": ["body", "$in"]}, {"type": "ReLU"}]},
        "basic_proj": {"args": {"width": None, "stride": 1}, "layers": [
            {"block": "body", "name": "body", "args": {"width": "$width", "stride": "$stride"}},
            {"type": "Conv2d", "name": "proj", "inputs": ["$in"], "out_channels": "$width", "kernel": 1,
             "stride": "$stride", "bias": False},
            {"type": "BatchNorm", "name": "proj_bn"},
            {"type": "Add", "inputs": ["body", "proj_bn"]}, {"type": "ReLU"}]}},
    "network": [
        {"type": "Conv2d", "out_channels": 64, "kernel": 7, "stride": 2, "padding": 3, "bias": False},
        {"type": "BatchNorm"}, {"type": "ReLU"}, {"type": "MaxPool", "kernel": 3, "stride": 2, "padding": 1},
        {"block": "basic", "name": "stage1", "args": {"width": 64}, "repeat": 2},
        {"block": "basic_proj", "name": "stage2_first", "args": {"width": 128, "stride": 2}},
        {"block": "basic", "name": "stage2", "args": {"width": 128}},
        {"block": "basic_proj", "name": "stage3_first", "args": {"width": 256, "stride": 2}},
        {"block": "basic", "name": "stage3", "args": {"width": 256}},
        {"block": "basic_proj", "name": "stage4_first", "args": {"width": 512, "stride": 2}},
        {"block": "basic", "name": "stage4", "args": {"width": 512}},
        {"type": "GlobalAvgPool"}, {"type": "Linear", "out_features": "$classes"}, {"type": "SoftmaxCrossEntropy"}]}

SMALL = {"input.shape": [3, SIZE, SIZE], "input.classes": 10, "train.batch": 4, "train.data": {"samples": 16}}
NETWORKS = {"resnet18": RESNET18, "resnet50": "configs/resnet50.yaml", "mobilenet_v2": "configs/mobilenet_v2.yaml"}


@pytest.fixture(scope="module")
def models():
    return torchvision().models


def randomized(model, seed):
    """`model` in eval mode with random BatchNorm scales, shifts and running statistics (the
    constructor's are ones and zeros, which would hide a swapped pair)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                for tensor, low in ((module.weight, 0.5), (module.bias, -0.2), (module.running_mean, -0.2),
                                    (module.running_var, 0.5)):
                    tensor.copy_(low + torch.rand(tensor.shape, generator=generator) * (abs(low) + 0.5))
    return model.eval()


def logits(config, weights, x):
    """snrt's eval-mode logits of `x`: the input of the network's loss, read after an inference
    step of the `none` plan (no buffer reused, so every output is still there)."""
    runtime = prepare(config.graph, len(x), "none", training=False, values=weights)
    runtime.executor.run({"data": x, "label": np.zeros(len(x), np.int64)}, 0, 0)
    plan = runtime.plan
    loss = plan.buffers[plan.losses[-1][2]].name.split(":")[0]
    scores = [b.name for b in plan.buffers].index(f"{config.graph.nodes[loss].inputs[0]}:y")
    return np.array(runtime.executor.views[scores])


def torch_logits(model, x):
    with torch.no_grad():
        return model(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("network", NETWORKS)
def test_torchvision_weights_give_pytorchs_logits_in_snrt(models, network, tmp_path):
    model = randomized(getattr(models, network)(num_classes=10), seed=1)
    torch.save(model.state_dict(), tmp_path / "torchvision.pt")
    config = snrt.load_config(NETWORKS[network], SMALL)
    trainer = Trainer(config)
    trainer.load_weights(tmp_path / "torchvision.pt")  # matched by order and shape
    x = np.random.default_rng(0).standard_normal((3, 3, SIZE, SIZE)).astype(np.float32)
    theirs = torch_logits(model, x)
    ours = logits(config, trainer.host_arrays(("parameter", "state")), x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())


@pytest.mark.parametrize("network", ["resnet18", "mobilenet_v2"])
@pytest.mark.parametrize("fmt, name", [("torch", "weights.pt"), ("safetensors", "weights.safetensors")])
def test_an_exported_run_loads_strictly_into_torchvision(models, network, fmt, name, tmp_path):
    doc = NETWORKS[network]
    if isinstance(doc, str):
        doc = yaml.safe_load(open(doc))
    doc["input"] = {"shape": [3, SIZE, SIZE], "classes": 10}
    doc["train"] = dict(doc.get("train", {}), data={"samples": 16})
    (tmp_path / "net.yaml").write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    assert main(["train", str(tmp_path / "net.yaml"), "--iterations", "2", "--batch", "4", "--out", str(run),
                 "--no-progress", "--no-eval"]) == 0
    model = getattr(models, network)(num_classes=10)
    torch.save(model.state_dict(), tmp_path / "reference.pt")
    assert main(["export", str(run), "--format", fmt, "--names-like", str(tmp_path / "reference.pt")]) == 0
    state = torch.load(run / name) if fmt == "torch" else {
        k: torch.from_numpy(v) for k, v in __import__("safetensors.numpy").numpy.load_file(str(run / name)).items()}
    model.load_state_dict(state, strict=True)
    if fmt == "torch":  # torchvision's names in torchvision's order (safetensors sorts its names)
        assert list(state) == list(model.state_dict())
    model.eval()
    config = snrt.load_config(tmp_path / "net.yaml", SMALL)
    trainer = Trainer(config)
    trainer.restore(run / "checkpoint.npz")
    x = np.random.default_rng(2).standard_normal((3, 3, SIZE, SIZE)).astype(np.float32)
    theirs = torch_logits(model, x)
    ours = logits(config, trainer.host_arrays(("parameter", "state")), x)
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-4 * np.abs(theirs).max())
