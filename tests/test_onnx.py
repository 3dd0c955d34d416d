"""ONNX export (snrt/onnx_export.py): the inference graph with its weights, run by onnxruntime,
gives the probabilities snrt's own inference plan gives; a layer without a translation is one
error naming it."""

import numpy as np
import onnxruntime
import pytest

import snrt
from snrt.cli import main
from snrt.errors import SnrtError
from snrt.onnx_export import to_onnx
from snrt.runtime import prepare
from snrt.train import Trainer
from tests.scheduler.test_exactness import CONCAT_NET
from tests.test_train import MODERN, SMALL_RESNET

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
        {"type": "Sigmoid"}, {"type": "Dropout", "p": 0.3}, {"type": "Flatten"},
        {"type": "Linear", "out_features": 16}, {"type": "Tanh"}, {"type": "Identity"},
        {"type": "Linear", "out_features": 5}, {"type": "SoftmaxCrossEntropy"}]}


def probabilities(config, weights, x):
    """snrt's inference-plan probabilities of `x` (the last loss layer's)."""
    runtime = prepare(config.graph, len(x), "none", training=False, values=weights)
    runtime.executor.run({"data": x, "label": np.zeros(len(x), np.int64)}, 0, 0)
    return np.array(runtime.executor.views[runtime.plan.losses[-1][2]])


@pytest.mark.parametrize("doc", ["configs/lenet.yaml", SMALL_RESNET, CONCAT_NET, MANY_LAYERS],
                         ids=["lenet", "resnet", "concat", "many_layers"])
def test_onnxruntime_gives_the_probabilities_snrt_gives(doc):
    config = snrt.load_config(doc)
    trainer = Trainer(config)
    trainer.fit(iterations=2)  # trained weights and running statistics, not the initial ones
    weights = trainer.host_arrays(("parameter", "state"))
    x = np.random.default_rng(0).standard_normal((3, *config.input.shape)).astype(np.float32)
    session = onnxruntime.InferenceSession(to_onnx(config.graph, weights).SerializeToString())
    (theirs,) = session.run(None, {"data": x})
    np.testing.assert_allclose(theirs, probabilities(config, weights, x), rtol=1e-4, atol=1e-6)


def test_a_layer_without_a_translation_is_named():
    config = snrt.load_config(MODERN)
    weights = Trainer(config).host_arrays(("parameter", "state"))
    with pytest.raises(SnrtError, match=r"node '.*' \((GELU|LayerNorm|GroupNorm|Upsample|Scale|Mul)\): no ONNX "
                                        "translation; exportable layers: .*Conv2d"):
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
