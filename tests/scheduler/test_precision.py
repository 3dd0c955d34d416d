"""Precisions (snrt/precision.py) planned end to end: every buffer stored in the dtype its role
and its layer give it, the bytes counted in that dtype by every policy, and the precisions a
backend does not run refused in one line."""

import json

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import snrt
from snrt.backends.cpu_cast import convert
from snrt.backends.numpy_backend import NumpyBackend
from snrt.config import DataConfig, TrainConfig, config_from_graph, with_settings
from snrt.cli import main
from snrt.errors import SnrtError
from snrt.layers.activation import ReLU
from snrt.layers.base import BACKWARD, KernelContext, Saved, numel, scratch_bytes
from snrt.layers.conv import Conv2d
from snrt.layers.join import Add
from snrt.layers.staging import Staged, staged_workspace_bytes, staging_bytes
from snrt.precision import PRECISIONS, LossScale, PrecisionError, unsupported
from snrt.scheduler.order import ITEMSIZE
from snrt.scheduler.planner import make_plan
from snrt.scheduler.policies import POLICIES
from snrt.scheduler.verify import verify_plan
from snrt.train import Trainer
from tests.scheduler.graphs import CLASSES, build, graph_recipes
from tests.scheduler.test_exactness import CONCAT_NET, assert_policies_agree
from tests.test_train import MODERN, SMALL_RESNET, UNET

FP32_ROLES = ("parameter", "parameter_gradient", "optimizer_state", "state")


def stored_as(plan, graph):
    """{buffer name: dtype} of `plan`, and the dtype each buffer should have in bf16."""
    expected = {}
    for b in plan.buffers:
        node_name, _, part = b.name.partition(":")
        node = graph[node_name]
        if part.startswith("partial"):  # a share of the gradient of the node's input: stored as that input
            node = graph[node.inputs[int(part.split("@")[0].removeprefix("partial"))]]
        if b.role in FP32_ROLES:
            expected[b.name] = "float32"
        elif b.dtype not in ("float32", "bfloat16"):
            expected[b.name] = b.dtype  # labels, pooling indices, workspaces (uint8): a dtype of their own
        elif b.role == "aux" and b.name.split(":")[1].split("@")[0] in ("mean", "inv_std"):
            expected[b.name] = "float32"  # normalization statistics
        elif node.layer.keeps_fp32:
            expected[b.name] = "float32"
        else:
            expected[b.name] = "bfloat16"
    return {b.name: b.dtype for b in plan.buffers}, expected


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes())
def test_every_buffer_of_every_policy_is_stored_in_the_dtype_of_its_role_and_layer(recipe):
    graph = build(recipe)
    for policy in POLICIES:
        plan = make_plan(graph, 2, policy, precision="bf16")
        verify_plan(plan)
        actual, expected = stored_as(plan, graph)
        assert actual == expected
        assert all(b.nbytes == numel(b.shape) * ITEMSIZE[b.dtype] for b in plan.buffers)


def test_bf16_halves_the_activations_and_what_offloading_copies():
    graph = snrt.load_config("configs/cifar_resnet20.yaml").graph
    for policy in POLICIES:
        wide, narrow = (make_plan(graph, 16, policy, precision=p) for p in ("fp32", "bf16"))
        if policy in ("none", "liveness"):  # the same buffers: each 2-byte one is half its fp32 twin
            assert [b.name for b in wide.buffers] == [b.name for b in narrow.buffers]
            for w, n in zip(wide.buffers, narrow.buffers):
                if n.role == "workspace":  # sized by each kernel for its itemsize
                    continue
                assert n.nbytes * (2 if n.dtype == "bfloat16" else 1) == w.nbytes
        assert narrow.bytes_by_role()["parameter"] == wide.bytes_by_role()["parameter"]
        assert narrow.peak_bytes < (0.6 if policy == "none" else 0.7) * wide.peak_bytes  # fp32 parameters stay
    offload = {p: make_plan(graph, 16, "offload", precision=p) for p in ("fp32", "fp16")}
    assert offload["fp16"].host_bytes < 0.51 * offload["fp32"].host_bytes
    assert offload["fp16"].copied_bytes()[0] < 0.51 * offload["fp32"].copied_bytes()[0]


@pytest.mark.parametrize("network", ["alexnet", "vgg16"])
def test_bf16_plans_about_half_of_fp32s_peak_under_superneurons_with_parameters_streamed(network):
    config = snrt.load_config(f"configs/{network}.yaml")
    wide, narrow = (make_plan(config.graph, config.train.batch, "superneurons", stream_parameters=True, precision=p)
                    for p in ("fp32", "bf16"))
    assert narrow.peak_bytes <= 0.55 * wide.peak_bytes  # AlexNet's fc6..fc8 parameters stay fp32 at its peak


def test_fp32_and_tf32_plans_are_the_same_and_bf16_and_fp16_plans_are_the_same_bytes():
    graph = snrt.load_config("configs/lenet.yaml").graph
    plans = {p: make_plan(graph, 8, "superneurons", precision=p) for p in PRECISIONS}
    assert plans["fp32"].to_json() == plans["tf32"].to_json()
    assert plans["bf16"].peak_bytes == plans["fp16"].peak_bytes
    assert plans["bf16"].bytes_by_dtype()["bfloat16"] == plans["fp16"].bytes_by_dtype()["float16"]
    assert sum(plans["bf16"].peak_by_dtype().values()) == plans["bf16"].peak_bytes


def test_an_unknown_precision_is_one_error_listing_the_choices(tmp_path, capsys):
    graph = snrt.load_config("configs/lenet.yaml").graph
    with pytest.raises(SnrtError, match="unknown precision 'int8'; expected one of fp32, tf32, bf16, fp16"):
        make_plan(graph, 2, precision="int8")
    path = tmp_path / "net.yaml"
    path.write_text(open("configs/lenet.yaml").read().replace("train:\n", "train:\n  precision: half\n", 1))
    assert main(["plan", str(path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "train.precision" in err and "expected one of fp32, tf32, bf16, fp16" in err and "Traceback" not in err


def test_a_precision_the_backend_does_not_run_is_refused_naming_the_file_and_key(tmp_path, capsys, monkeypatch):
    assert all(unsupported(p, NumpyBackend) is None for p in PRECISIONS)  # the CPU runs every one
    monkeypatch.setattr(NumpyBackend, "precisions", ("fp32", "tf32"))  # a backend without 2-byte kernels
    assert isinstance(unsupported("fp16", NumpyBackend), PrecisionError)
    code = main(["train", "configs/lenet.yaml", "--precision", "fp16", "--iterations", "1", "--out",
                 str(tmp_path / "run")])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "Traceback" not in err
    assert "configs/lenet.yaml: train.precision: the cpu backend runs fp32 and tf32; fp16 is planned" in err
    assert not (tmp_path / "run").exists()  # refused before the output folder is made


def test_tf32_trains_on_the_cpu_exactly_as_fp32():
    losses = {}
    for precision in ("fp32", "tf32"):
        config = snrt.load_config("configs/lenet.yaml", {"train.batch": 8, "train.precision": precision})
        losses[precision] = [m.loss for m in Trainer(config).fit(iterations=3)]
    assert np.array_equal(losses["fp32"], losses["tf32"])


def test_snrt_plan_shows_each_dtype_and_each_layers_dtype(capsys):
    assert main(["plan", "configs/lenet.yaml", "--precision", "bf16", "--layers", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    chosen = report["chosen"]
    assert set(chosen["bytes_by_dtype"]) == {"bfloat16", "float32", "int64", "uint8"}
    assert main(["plan", "configs/lenet.yaml", "--precision", "bf16", "--layers"]) == 0
    out = capsys.readouterr().out
    assert "in bfloat16" in out and "in float32" in out
    rows = [line for line in out.splitlines() if "SoftmaxCrossEntropy" in line or "Conv2d" in line]
    assert any("float32" in r and "SoftmaxCrossEntropy" in r for r in rows)
    assert any("bfloat16" in r and "Conv2d" in r for r in rows)


@pytest.mark.parametrize("doc", [SMALL_RESNET, CONCAT_NET, MODERN, UNET], ids=["resnet", "concat", "modern", "unet"])
def test_bf16_trains_bit_identically_under_every_policy_within_its_plan(doc):
    """Each step's 2-byte arrays staged in fp32 inside its planned workspace: every policy
    gives the losses and arrays of `none` in bf16, and the measured peak is the planned one."""
    assert_policies_agree(with_settings(snrt.load_config(doc), train={"precision": "bf16"}), iterations=3)


def test_bf16_with_streamed_parameters_trains_as_none_does():
    config = with_settings(snrt.load_config(SMALL_RESNET), train={"precision": "bf16"})
    assert_policies_agree(config, iterations=2, stream=True)


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=8))
def test_generated_graphs_train_identically_in_bf16_under_every_policy(recipe):
    train = TrainConfig(batch=2, iterations=2, data=DataConfig(samples=8), precision="bf16")
    assert_policies_agree(config_from_graph(build(recipe), CLASSES, train), iterations=2)


def test_bf16_follows_fp32_to_bf16_rounding_and_stores_its_tensors_in_two_bytes():
    runs = {}
    for precision in ("fp32", "bf16"):
        trainer = Trainer(with_settings(snrt.load_config(SMALL_RESNET), train={"precision": precision}))
        runs[precision] = ([m.loss for m in trainer.fit(iterations=3)], trainer)
    (wide, _), (narrow, trainer) = runs["fp32"], runs["bf16"]
    assert not np.array_equal(wide, narrow)  # rounded, so not the same run
    np.testing.assert_allclose(narrow, wide, rtol=0.03)
    activations = [b for b in trainer.plan.buffers if b.role == "activation" and b.name.startswith("conv")]
    assert activations and all(b.dtype == "bfloat16" for b in activations)
    assert all(b.dtype == "float32" for b in trainer.plan.buffers if b.role == "parameter")


def test_fp16_trains_bit_identically_under_every_policy_with_its_updates_deferred():
    config = with_settings(snrt.load_config(SMALL_RESNET), train={"precision": "fp16"})
    assert_policies_agree(config, iterations=3)
    trainer = Trainer(config)
    assert trainer.executor.updates_deferred and trainer.loss_scale.scale == 2.0 ** 16
    assert all(b.dtype == "float16" for b in trainer.plan.buffers if b.role == "activation" and "conv" in b.name)


def test_an_fp16_iteration_whose_gradients_overflow_updates_nothing_and_halves_the_scale():
    config = with_settings(snrt.load_config(SMALL_RESNET), train={"precision": "fp16"})
    trainer = Trainer(config)
    trainer.loss_scale = LossScale(scale=2.0 ** 40)  # far past fp16's largest value (65504)
    before = trainer.host_arrays(("parameter",))
    history = trainer.fit(iterations=2)
    assert [m.skipped for m in history] == [True, True] and [m.loss_scale for m in history] == [2.0 ** 40, 2.0 ** 39]
    assert all(np.isfinite(m.loss) for m in history)  # not a divergence: the loss itself is finite
    after = trainer.host_arrays(("parameter",))
    for key, value in before.items():
        np.testing.assert_array_equal(after[key], value, err_msg=key)
    assert trainer.loss_scale.scale == 2.0 ** 38
    history = trainer.fit(iterations=40)  # it comes down until the gradients fit, then trains
    assert not history[-1].skipped and history[-1].loss_scale < 2.0 ** 24
    assert any(not np.array_equal(trainer.host_arrays(("parameter",))[k], v) for k, v in before.items())


def test_check_mode_runs_an_fp16_iteration_whose_gradients_overflow_under_every_policy():
    """Overflowing gradients hold inf and NaN (inf - inf) in the buffers later steps read:
    check mode takes those for what they are, not for poison, and the run skips its updates
    under every policy as it does without check mode, with the same losses."""
    config = with_settings(snrt.load_config(SMALL_RESNET), train={"precision": "fp16"})
    losses = {}
    for policy in POLICIES:
        trainer = Trainer(with_settings(config, memory={"policy": policy}), check=True)
        trainer.loss_scale = LossScale(scale=2.0 ** 40)
        history = trainer.fit(iterations=2)
        assert [m.skipped for m in history] == [True, True], policy
        assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes, policy
        losses[policy] = [m.loss for m in history]
    assert all(run == losses["none"] for run in losses.values())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_poison_is_told_from_a_nan_that_arithmetic_makes(dtype):
    from snrt.memory.arena import Arena
    from snrt.scheduler.plan import Buffer

    arena = Arena(np, 64, check=True)
    buffer = Buffer(0, "x:y", (4,), dtype, 4 * np.dtype(dtype).itemsize, "activation", offset=0)
    arena.reserve(buffer)
    view = arena.view(buffer)
    assert arena.holds_poison(buffer) and np.isnan(view.astype(np.float32)).all()
    with np.errstate(invalid="ignore"):
        view[...] = np.float32(np.inf) - np.float32(np.inf)  # what an overflow leaves
    assert not arena.holds_poison(buffer)
    view[1:] = 0.0
    arena.release(buffer)
    assert arena.holds_poison(buffer)


def test_the_loss_scale_grows_after_an_interval_without_overflow_and_resumes_from_a_checkpoint(tmp_path):
    scale = LossScale(scale=8.0, growth_interval=3)
    for overflowed, expected in [(False, 8.0), (False, 8.0), (False, 16.0), (True, 8.0), (False, 8.0)]:
        scale.after(overflowed)
        assert scale.scale == expected
    config = with_settings(snrt.load_config(SMALL_RESNET), train={"precision": "fp16"})
    trainer = Trainer(config)
    trainer.loss_scale = LossScale(scale=2.0 ** 40)
    trainer.fit(iterations=2)
    trainer.save(tmp_path / "checkpoint.npz")
    resumed = Trainer(config)
    resumed.restore(tmp_path / "checkpoint.npz")
    assert resumed.loss_scale == trainer.loss_scale and resumed.loss_scale.scale == 2.0 ** 38


def test_loss_scaling_needs_a_plan_whose_updates_wait_for_the_backward_pass():
    trainer = Trainer(snrt.load_config(SMALL_RESNET))
    x = np.zeros((trainer.batch, *trainer.graph["data"].shape), np.float32)
    with pytest.raises(RuntimeError, match="plan it with deferred_updates=True"):
        trainer.executor.run({"data": x, "label": np.zeros(trainer.batch, np.int64)}, 0, 0, trainer.optimizer, 0.1,
                             loss_scale=1024.0)


@pytest.mark.parametrize("doc", [SMALL_RESNET, MODERN], ids=["resnet", "modern"])
def test_bf16_losses_follow_pytorch_autocast_to_bf16_rounding(doc):
    """Four SGD steps of snrt in bf16 and of PyTorch under torch.autocast (CPU, bfloat16) from the
    same start: the losses agree to bf16's relative rounding step, 2^-8 (they differ by about
    1e-3: PyTorch rounds other intermediate tensors), where fp32 runs agree to 2e-5
    (tests/test_train.py)."""
    import torch

    from snrt.torch_reference import TorchNet, torch_sgd
    from tests.test_train import batch_of

    config = with_settings(snrt.load_config(doc), train={"precision": "bf16"})
    trainer = Trainer(config)
    net = TorchNet(config.graph, trainer.host_arrays(("parameter",)), trainer.host_arrays(("state",)))
    sgd = torch_sgd(net, config.graph, config.train.optimizer)
    for step in range(4):
        x, y = batch_of(config, step)
        ours = trainer.step(x, y, total=4).loss
        sgd.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = net({"data": torch.tensor(x), "label": torch.tensor(y)}).float().mean()
        loss.backward()
        sgd.step()
        assert ours == pytest.approx(loss.item(), rel=2 ** -8), f"step {step}"  # one bf16 rounding step


@pytest.mark.parametrize("layer, in_shapes, staged", [
    (Add(), [(2, 3, 4, 4)] * 2, ("gy", "gx0", "gx1")),  # saves nothing
    (ReLU(), [(2, 3, 4, 4)], ("gy", "y", "gx0")),  # saves its output
    (Conv2d(out_channels=5, kernel=3, padding=1), [(2, 3, 4, 4)], ("gy", "x0", "gx0")),  # saves its input
], ids=["Add", "ReLU", "Conv2d"])
def test_a_2_byte_backward_stages_what_the_layer_saves_and_no_more(layer, in_shapes, staged):
    """The staging a 2-byte backward step reserves is the fp32 copies of its output's gradient,
    the tensors its layer saves and its inputs' gradients; the layer's kernel runs staged in
    exactly that, and its gradients are those of the fp32 arrays it was given, rounded."""
    out_shape = layer.infer_shape(in_shapes)
    shape_of = {"gy": out_shape, "y": out_shape, **{f"x{i}": s for i, s in enumerate(in_shapes)},
                **{f"gx{i}": s for i, s in enumerate(in_shapes)}}
    assert staging_bytes(layer, in_shapes, BACKWARD) == scratch_bytes(*(numel(shape_of[a]) * 4 for a in staged))
    rng = np.random.default_rng(0)
    wide = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shape_of.items()}
    narrow = {name: a.astype(ml_dtypes.bfloat16) for name, a in wide.items()}
    params = {name: rng.standard_normal(spec.shape).astype(np.float32) for name, spec in layer.param_specs(in_shapes).items()}

    def run(arrays, ctx_bytes, staged_kernel):
        gxs = [np.zeros_like(arrays[f"gx{i}"]) for i in range(len(in_shapes))]
        gparams = {name: np.zeros_like(p) for name, p in params.items()}
        saved = Saved(tuple(arrays[f"x{i}"] if i in layer.saves.inputs else None for i in range(len(in_shapes))),
                      arrays["y"] if layer.saves.output else None)
        ctx = KernelContext(np, workspace=np.zeros(ctx_bytes, np.uint8))
        staged_kernel.backward(ctx, arrays["gy"], saved, params, {}, gxs, gparams)
        return gxs, gparams

    own = layer.workspace_bytes(in_shapes, BACKWARD)
    narrow_gxs, narrow_gparams = run(narrow, staged_workspace_bytes(layer, in_shapes, BACKWARD, own),
                                     Staged(layer, convert))
    widened = {name: a.astype(np.float32) for name, a in narrow.items()}
    wide_gxs, wide_gparams = run(widened, max(own, 1), layer)
    for got, want in zip(narrow_gxs, wide_gxs):
        np.testing.assert_array_equal(got, want.astype(ml_dtypes.bfloat16))
    for name in params:
        np.testing.assert_array_equal(narrow_gparams[name], wide_gparams[name])
