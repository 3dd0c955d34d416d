"""Weights in and out (snrt/weights.py): snrt export writes a run's parameters and statistics as
safetensors or a PyTorch state dict; --init-from reads either back, by name or by order and
shape, and a file that fits neither way is one error naming the first tensors that do not."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import snrt
from snrt.cli import main
from snrt.errors import SnrtError
from snrt.train import Trainer

LENET = "configs/lenet.yaml"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("runs") / "lenet"
    assert main(["train", LENET, "--iterations", "3", "--batch", "8", "--out", str(folder), "--no-progress",
                 "--no-eval"]) == 0
    return folder


def trained(folder):
    """The run's parameters and statistics, as a fresh Trainer restored from its checkpoint holds them."""
    trainer = Trainer(snrt.load_config(LENET, {"train.batch": 8}))
    trainer.restore(folder / "checkpoint.npz")
    return trainer.host_arrays(("parameter", "state"))


@pytest.mark.parametrize("fmt, name", [("safetensors", "weights.safetensors"), ("torch", "weights.pt")])
def test_exported_weights_start_a_run_with_the_trained_parameters_and_a_fresh_optimizer(run, fmt, name):
    assert main(["export", str(run), "--format", fmt]) == 0
    trainer = Trainer(snrt.load_config(LENET, {"train.batch": 8}))
    trainer.load_weights(run / name)
    loaded, expected = trainer.host_arrays(("parameter", "state")), trained(run)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_array_equal(loaded[key], value, err_msg=str(key))
    assert all(not v.any() for v in trainer.host_arrays(("optimizer_state",)).values())


def test_a_state_dict_with_other_names_loads_by_order_and_shape(run, tmp_path):
    expected = trained(run)
    renamed = {f"features.{i}.tensor": torch.from_numpy(v) for i, v in enumerate(expected.values())}
    renamed["features.3.num_batches_tracked"] = torch.tensor(7)  # PyTorch's BatchNorm counter: ignored
    torch.save({"state_dict": renamed}, tmp_path / "other.pt")
    trainer = Trainer(snrt.load_config(LENET, {"train.batch": 8}))
    trainer.load_weights(tmp_path / "other.pt")
    for key, value in expected.items():
        np.testing.assert_array_equal(trainer.host_arrays(("parameter", "state"))[key], value)


def test_weights_that_do_not_fit_say_which_tensors(run, tmp_path):
    trainer = Trainer(snrt.load_config(LENET, {"train.batch": 8}))
    expected = {f"{node}.{name}": v for (node, name), v in trained(run).items()}
    wrong = dict(expected, **{"conv2d0.weight": np.zeros((1, 1, 1, 1), np.float32)})
    save_file(wrong, tmp_path / "shape.safetensors")
    with pytest.raises(SnrtError, match=r"1 tensors have another shape .*conv2d0.weight: file \[1, 1, 1, 1\]"):
        trainer.load_weights(tmp_path / "shape.safetensors")
    save_file({k: v for k, v in expected.items() if k != "linear0.bias"}, tmp_path / "short.safetensors")
    with pytest.raises(SnrtError, match="1 of its 12 tensors missing, first linear0.bias"):
        trainer.load_weights(tmp_path / "short.safetensors")
    torch.save({"a": torch.zeros(3)}, tmp_path / "tiny.pt")
    with pytest.raises(SnrtError, match="nor by order: the file has 1 tensors, the network 12"):
        trainer.load_weights(tmp_path / "tiny.pt")
    (tmp_path / "junk.safetensors").write_bytes(b"junk")
    with pytest.raises(SnrtError, match="junk.safetensors: not a safetensors file"):
        trainer.load_weights(tmp_path / "junk.safetensors")


def test_the_commands_say_in_one_line_what_is_missing(tmp_path, capsys):
    assert main(["export", str(tmp_path)]) == 2
    assert "checkpoint.npz" in " ".join(capsys.readouterr().err.split())
    assert main(["train", LENET, "--iterations", "1", "--out", str(tmp_path / "r"), "--init-from",
                 str(tmp_path / "none.safetensors")]) == 2
    assert "none.safetensors: no such weights file" in " ".join(capsys.readouterr().err.split())


def test_a_checkpoint_given_as_weights_says_how_to_use_it(run, tmp_path, capsys):
    checkpoint = run / "checkpoint.npz"
    assert main(["train", LENET, "--iterations", "1", "--out", str(tmp_path / "r"), "--init-from",
                 str(checkpoint)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{checkpoint}: a checkpoint of snrt train, not a weights file; continue its run with --resume" in err
    assert f"`snrt export {checkpoint}`" in err and "pickle" not in err and "state dict" not in err


def test_names_like_a_reference_that_does_not_fit_names_the_tensors(run, tmp_path, capsys):
    expected = trained(run)
    reference = {f"net.{i}": torch.from_numpy(v) for i, v in enumerate(expected.values())}
    reference["net.0"] = torch.zeros(2, 2)
    torch.save(reference, tmp_path / "reference.pt")
    assert main(["export", str(run), "--format", "torch", "--names-like", str(tmp_path / "reference.pt"),
                 "--out", str(tmp_path / "w.pt")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "reference.pt: does not match" in err and "#0 net.0 [2, 2] against conv2d0.weight" in err
    assert not (tmp_path / "w.pt").exists()
    assert main(["export", str(run), "--format", "onnx", "--names-like", str(tmp_path / "reference.pt")]) == 2
    assert "an ONNX model keeps snrt's names" in " ".join(capsys.readouterr().err.split())


@pytest.mark.parametrize("saved", ["whole model", "text"])
def test_a_file_that_is_not_a_state_dict_is_one_line_that_never_suggests_unsafe_loading(tmp_path, saved):
    from snrt.weights import read

    path = tmp_path / "model.pt"
    if saved == "whole model":
        torch.save(torch.nn.Linear(2, 2), path)
    else:
        path.write_text("input: {shape: [3]}\n")
    with pytest.raises(SnrtError) as caught:
        read(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: not a PyTorch state dict of tensors") and "\n" not in message
    assert "weights_only` set to `False`" not in message and "state_dict()" in message


@pytest.mark.parametrize("values, says", [
    (lambda v: np.ones(v.shape, np.int64), "conv2d0.weight holds int64 values, not the floating-point numbers"),
    (lambda v: np.ones(v.shape, bool), "conv2d0.weight holds bool values"),
    (lambda v: np.full(v.shape, np.nan, np.float32), "conv2d0.weight holds NaN or infinite values"),
    (lambda v: np.full(v.shape, 1e39), "conv2d0.weight holds values beyond float32's range \\(largest magnitude 1e\\+39\\)"),
], ids=["integers", "booleans", "nan", "beyond float32"])
def test_weights_that_are_not_finite_floats_are_refused_not_cast(tmp_path, values, says):
    trainer = Trainer(snrt.load_config(LENET, {"train.batch": 8}))
    before = trainer.host_arrays(("parameter", "state"))
    tensors = {f"{node}.{name}": v for (node, name), v in before.items()}
    tensors["conv2d0.weight"] = values(tensors["conv2d0.weight"])
    save_file(tensors, tmp_path / "w.safetensors")
    torch.save({f"layer{i}": torch.from_numpy(v) for i, v in enumerate(tensors.values())}, tmp_path / "w.pt")
    with pytest.raises(SnrtError, match=f"w.safetensors: {says}"):
        trainer.load_weights(tmp_path / "w.safetensors")
    with pytest.raises(SnrtError, match=f"w.pt: {says.replace('conv2d0.weight', 'layer0')}"):  # by order
        trainer.load_weights(tmp_path / "w.pt")
    for key, value in trainer.host_arrays(("parameter", "state")).items():
        np.testing.assert_array_equal(value, before[key])


def test_an_export_that_cannot_be_written_is_one_line_and_never_replaces_the_checkpoint(run, tmp_path, capsys):
    for fmt in ("safetensors", "torch", "onnx"):
        assert main(["export", str(run), "--format", fmt, "--out", str(tmp_path / "missing" / "w")]) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"{tmp_path / 'missing' / 'w'}: cannot write (No such file or directory)" in err, fmt
        assert "Traceback" not in err
    before = (run / "checkpoint.npz").read_bytes()
    assert main(["export", str(run), "--out", str(run / "checkpoint.npz")]) == 2
    assert "checkpoint.npz: is the checkpoint being exported; choose another --out" in capsys.readouterr().err
    assert (run / "checkpoint.npz").read_bytes() == before
    for name in ("metrics.jsonl", "config.yaml"):
        kept = (run / name).read_bytes()
        assert main(["export", str(run), "--out", str(run / name)]) == 2
        assert f"{name}: is a file of the run being exported" in capsys.readouterr().err
        assert (run / name).read_bytes() == kept


def test_a_path_that_is_not_utf8_is_printed_as_it_is_in_a_utf8_locale(run, tmp_path):
    out = tmp_path / os.fsdecode(b"caf\xe9.safetensors")  # a Latin-1 name
    done = subprocess.run([sys.executable, "-m", "snrt", "export", str(run), "--out", str(out)], capture_output=True,
                          env={**os.environ, "PYTHONIOENCODING": "utf-8"}, cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    assert b"caf\xe9.safetensors" in done.stdout and out.is_file()


@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor")
def test_a_sparse_tensor_loads_dense_and_one_without_values_or_numpy_form_is_named(tmp_path):
    trainer = Trainer(snrt.load_config(LENET, {"train.batch": 8}))
    expected = {f"{node}.{name}": v for (node, name), v in trainer.host_arrays(("parameter", "state")).items()}
    state = {name: torch.from_numpy(v) for name, v in expected.items()}
    torch.save({**state, "linear0.weight": state["linear0.weight"].to_sparse()}, tmp_path / "sparse.pt")
    trainer.load_weights(tmp_path / "sparse.pt")
    np.testing.assert_array_equal(trainer.host_arrays(("parameter",))[("linear0", "weight")], expected["linear0.weight"])
    quantized = torch.quantize_per_tensor(state["linear0.weight"], 0.1, 0, torch.qint8)
    torch.save({**state, "linear0.weight": quantized}, tmp_path / "quantized.pt")
    with pytest.raises(SnrtError, match="quantized.pt: linear0.weight is a tensor NumPy cannot hold"):
        trainer.load_weights(tmp_path / "quantized.pt")
    torch.save({**state, "linear0.weight": torch.empty(state["linear0.weight"].shape, device="meta")},
               tmp_path / "meta.pt")
    with pytest.raises(SnrtError, match="meta.pt: linear0.weight holds no values: a tensor of PyTorch's meta device"):
        trainer.load_weights(tmp_path / "meta.pt")
