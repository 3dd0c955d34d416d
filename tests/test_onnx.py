"""ONNX export (snrt/onnx_export.py): the inference graph with its weights, run by onnxruntime,
gives the probabilities snrt's own inference plan gives; a layer without a translation is one
error naming it."""

import numpy as np
import onnxruntime
import pytest

import snrt
from snrt.cli import main
from snrt.errors import SnrtError
from snrt.onnx_export import TRANSLATE, to_onnx
from snrt.runtime import prepare
from snrt.train import Trainer
from tests.scheduler.test_exactness import CONCAT_NET
from tests.test_train import MODERN, SMALL_RESNET, UNET

MANY_LAYERS = {
    "name": "many_layers", "input": {"shape": [3, 12, 12], "classes": 5},
    "train": {"batch": 4, "iterations": 2},
    "network": [
        {"type": "Conv2d", "out_channels": 8, "kernel": 3, "padding": 2, "dilation": 2},
        {"type": "BatchNorm", "affine": False}, {"type": "ReLU6"},
        {"type": "Conv2d", "out_channels": 8, "kernel": 3, "padding": 1, "groups": 4, "bias": False},
        {"type": "BatchNorm"}, {"type": "SiLU"},
        {"type": "MaxPool", "kernel": 3, "stride": 2, "ceil_mode": True},
        {"type": "LeakyReLU", "slope": 0.2},
        {"type": "AvgPool", "kernel": 2, "padding": 1, "count_include_pad": False},
        {"type": "Sigmoid"}, {"type": "Dropout", "p": 0.3}, {"type": "Reshape", "shape": [-1]},
        {"type": "Linear", "out_features": 16}, {"type": "Tanh"}, {"type": "Identity"},
        {"type": "Linear", "out_features": 5}, {"type": "SoftmaxCrossEntropy"}]}


def probabilities(config, weights, x):
    """snrt's inference-plan probabilities of `x` (the last loss layer's)."""
    runtime = prepare(config.graph, len(x), "none", training=False, values=weights)
    labels = np.zeros((len(x), *config.graph["label"].shape), np.int64)
    runtime.executor.run({"data": x, "label": labels}, 0, 0)
    return np.array(runtime.executor.views[runtime.plan.losses[-1][2]])


ZOO = {name: (f"configs/{name}.yaml", {"input.shape": [3, size, size], "train.batch": 2, "train.data": {"samples": 8}})
       for name, size in [("alexnet", 67), ("se_resnet50", 32), ("mobilenet_v2", 32), ("efficientnet_b0", 32),
                          ("convnext_tiny", 32), ("unet", 32), ("inceptionv4", 75), ("densenet121", 32)]}
NETWORKS = {"lenet": ("configs/lenet.yaml", {}), "resnet": (SMALL_RESNET, {}), "concat": (CONCAT_NET, {}),
            "many_layers": (MANY_LAYERS, {}), "modern": (MODERN, {}), "unet_blocks": (UNET, {}), **ZOO}


@pytest.mark.parametrize("network", NETWORKS)
def test_onnxruntime_gives_the_probabilities_snrt_gives(network):
    doc, overrides = NETWORKS[network]
    config = snrt.load_config(doc, overrides)
    trainer = Trainer(config)
    if network not in ZOO:  # trained weights and running statistics, not the initial ones (the zoo's at
        trainer.fit(iterations=2)  # batch 2 and their files' rates may diverge in two steps)
    weights = trainer.host_arrays(("parameter", "state"))
    x = np.random.default_rng(0).standard_normal((3, *config.input.shape)).astype(np.float32)
    session = onnxruntime.InferenceSession(to_onnx(config.graph, weights).SerializeToString())
    theirs = session.run(None, {"data": x})[-1]  # the last loss layer's
    assert np.isfinite(theirs).all()
    np.testing.assert_allclose(theirs, probabilities(config, weights, x), rtol=1e-3, atol=1e-5)


def test_a_layer_without_a_translation_is_named(monkeypatch):
    doc = {**MANY_LAYERS, "network": [{"type": "Conv2d", "out_channels": 4, "kernel": 3}, {"type": "ELU"},
                                      {"type": "GlobalAvgPool"}, {"type": "Linear", "out_features": 5},
                                      {"type": "SoftmaxCrossEntropy"}]}
    config = snrt.load_config(doc)
    weights = Trainer(config).host_arrays(("parameter", "state"))
    monkeypatch.delitem(TRANSLATE, "ELU")  # every layer of the zoo translates: take one away
    with pytest.raises(SnrtError, match=r"node 'elu0' \(ELU\): no ONNX translation; exportable layers: .*Conv2d"):
        to_onnx(config.graph, weights)


def test_snrt_export_writes_a_model_from_a_run(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "configs/lenet.yaml", "--iterations", "2", "--batch", "8", "--out", str(run),
                 "--no-progress", "--no-eval"]) == 0
    assert main(["export", str(run), "--format", "onnx"]) == 0
    session = onnxruntime.InferenceSession(str(run / "model.onnx"))
    assert [i.name for i in session.get_inputs()] == ["data"]
    (probs,) = session.run(None, {"data": np.zeros((2, 1, 8, 8), np.float32)})
    np.testing.assert_allclose(probs.sum(axis=1), 1, rtol=1e-5)
    (run / "config.yaml").unlink()
    capsys.readouterr()
    assert main(["export", str(run), "--format", "onnx"]) == 2
    assert "config.yaml: not found; ONNX export needs the network" in " ".join(capsys.readouterr().err.split())


def test_snrt_export_refuses_a_network_other_than_the_checkpoints(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "configs/lenet.yaml", "--iterations", "1", "--batch", "8", "--out", str(run),
                 "--no-progress", "--no-eval"]) == 0
    lenet = open("configs/lenet.yaml").read()
    for edit in (("out_channels: 16", "out_channels: 8"), ("stride: 2}", "stride: 1}")):  # other shapes; the same
        (run / "config.yaml").write_text(lenet.replace(*edit))
        capsys.readouterr()
        assert main(["export", str(run), "--format", "onnx"]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"{run / 'checkpoint.npz'}: made for another network" in err and "Traceback" not in err
        assert not (run / "model.onnx").exists()
