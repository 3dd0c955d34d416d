"""The CUDA backend on a GPU: layer-by-layer parity with the NumPy kernels, whole training
iterations under every policy, measured peak equal to the planned peak, no allocation
outside the arena while kernels run, and copies overlapping compute in CUDA event timings.

Every test here needs a CUDA device and skips, with the reason, where there is none
(`scripts/gpu_check.sh` runs them on a GPU machine)."""

import numpy as np
import pytest

import snrt
from snrt.backends import cuda_unavailable_reason
from snrt.layers.activation import ELU, GELU, Identity, LeakyReLU, ReLU, ReLU6, Sigmoid, SiLU, Softmax, Tanh
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.conv import Conv2d, ConvTranspose2d
from snrt.layers.dropout import Dropout, Dropout2d
from snrt.layers.fused import AddReLU, BatchNormReLU
from snrt.layers.join import Add, Concat, Mul, Scale
from snrt.layers.linear import Flatten, Linear, Reshape
from snrt.layers.loss import SoftmaxCrossEntropy
from snrt.layers.norm import LRN, BatchNorm, GroupNorm, LayerNorm
from snrt.layers.pool import AdaptiveAvgPool, AvgPool, GlobalAvgPool, MaxPool, Upsample
from snrt.config import with_settings
from snrt.scheduler.policies import POLICIES
from snrt.timeline import copy_overlap

REASON = cuda_unavailable_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=f"needs a CUDA device: {REASON}")]

EXACT = ("Dropout", "AvgPool", "ReLU", "LeakyReLU", "Add", "AddReLU", "Concat", "Flatten", "MaxPool")  # same arithmetic

LAYERS = [
    (Conv2d(out_channels=8, kernel=3, padding=1), [(4, 6, 10, 10)]),
    (Conv2d(out_channels=8, kernel=3, stride=2, padding=1, bias=False), [(4, 6, 11, 11)]),
    (Conv2d(out_channels=8, kernel=1), [(4, 6, 7, 7)]),
    (Conv2d(out_channels=6, kernel=3, padding=2, dilation=2, groups=3), [(2, 6, 9, 9)]),
    (Conv2d(out_channels=16, kernel=7, stride=2, padding=3), [(2, 3, 32, 32)]),
    (BatchNorm(), [(4, 8, 6, 6)]),
    (BatchNorm(momentum=0.3), [(16, 12)]),
    (BatchNorm(affine=False), [(4, 8, 6, 6)]),
    (BatchNormReLU(), [(4, 8, 6, 6)]),
    (AddReLU(), [(3, 4, 5), (3, 4, 5)]),
    (ConvTranspose2d(out_channels=4, kernel=3, stride=2, padding=1, output_padding=1), [(2, 6, 5, 5)]),
    (Linear(out_features=7), [(5, 3, 2, 2)]),
    (Linear(out_features=7, bias=False), [(5, 11)]),
    (SoftmaxCrossEntropy(), [(6, 10), (6,)]),
    (Dropout(p=0.3), [(4, 5, 6)]),
    (Dropout2d(p=0.3), [(2, 4, 3, 3)]),
    (AvgPool(kernel=3, stride=2, padding=1), [(2, 3, 9, 9)]),
    (AvgPool(kernel=3, stride=2, padding=1, count_include_pad=False, ceil_mode=True), [(2, 3, 8, 8)]),
    (MaxPool(kernel=3, stride=2, padding=1), [(2, 3, 9, 9)]),
    (GlobalAvgPool(), [(2, 5, 4, 4)]),
    (LRN(size=5), [(2, 7, 4, 4)]),
    (ReLU(), [(3, 4, 5)]),
    (ReLU6(), [(3, 4, 5)]),
    (LeakyReLU(slope=0.1), [(3, 4, 5)]),
    (Sigmoid(), [(3, 4, 5)]),
    (Tanh(), [(3, 4, 5)]),
    (SiLU(), [(3, 4, 5)]),
    (ELU(alpha=0.5), [(3, 4, 5)]),
    (GELU(), [(3, 4, 5)]),
    (GELU(approximate="tanh"), [(3, 4, 5)]),
    (Identity(), [(3, 4, 5)]),
    (Softmax(), [(3, 4, 5)]),
    (Mul(), [(2, 3, 4, 4), (2, 3)]),
    (Scale(init=0.5), [(2, 3, 4, 4)]),
    (GroupNorm(groups=2), [(2, 4, 3, 3)]),
    (LayerNorm(), [(2, 4, 3, 3)]),
    (AdaptiveAvgPool(output=(2, 3)), [(2, 3, 5, 7)]),
    (Reshape(shape=[-1, 4]), [(2, 3, 4, 4)]),
    (Upsample(scale=2), [(2, 3, 4, 5)]),
    (Upsample(scale=(2, 3), mode="bilinear"), [(2, 3, 4, 5)]),
    (Add(), [(2, 3, 4, 4), (2, 3, 4, 4)]),
    (Concat(), [(2, 3, 4, 4), (2, 5, 4, 4)]),
    (Flatten(), [(2, 3, 4, 4)]),
]


@pytest.fixture(scope="module")
def cupy():
    import cupy

    return cupy


def _inputs(layer, in_shapes, rng):
    xs = []
    for shape in in_shapes:
        if layer.type_name == "SoftmaxCrossEntropy" and len(xs) == 1:
            xs.append(rng.integers(0, in_shapes[0][1], shape).astype(np.int64))
        else:
            xs.append(rng.standard_normal(shape).astype(np.float32))
    return xs


def _run(layer, kernel, xs, params, state, gy, xp, training=True, recompute=False, to_host=np.asarray, guard=None):
    """Forward then backward of `kernel` on `xp` arrays; returns host copies of everything."""
    in_shapes = [x.shape for x in xs]
    arr = (lambda a: xp.asarray(a)) if xp is not np else (lambda a: np.array(a, copy=True))
    xs_d = [arr(x) for x in xs]
    params_d = {k: arr(v) for k, v in params.items()}
    state_d = {k: arr(v) for k, v in state.items()}
    y = xp.full(layer.infer_shape(in_shapes), np.nan, dtype=layer.output_dtype([x.dtype.name for x in xs]))
    aux = {k: xp.zeros(s.shape, dtype=np.float32 if s.dtype == "compute" else s.dtype)
           for k, s in layer.aux_specs(in_shapes).items()}
    ws_f = xp.zeros(kernel.workspace_bytes(in_shapes, FORWARD), dtype=np.uint8)
    ws_b = xp.zeros(kernel.workspace_bytes(in_shapes, BACKWARD), dtype=np.uint8)
    ctx = KernelContext(xp, training=training, seed=5, iteration=2, node_index=3, workspace=ws_f if ws_f.size else None)
    kernel.forward(ctx, xs_d, params_d, state_d, y, aux, recompute=recompute)
    gy_d = arr(gy)
    saves = layer.saves
    saved = Saved(tuple(x if i in saves.inputs else None for i, x in enumerate(xs_d)), y if saves.output else None)
    wanted = range(len(xs)) if layer.differentiable_inputs is None else layer.differentiable_inputs
    gxs = [xp.full(x.shape, np.nan, dtype=np.float32) if i in wanted else None for i, x in enumerate(xs)]
    gparams = {k: xp.full(v.shape, np.nan, dtype=np.float32) for k, v in params.items()}
    ctx = KernelContext(xp, training=training, seed=5, iteration=2, node_index=3, workspace=ws_b if ws_b.size else None)
    kernel.backward(ctx, gy_d, saved, params_d, aux, gxs, gparams)
    host = {"y": to_host(y), **{f"aux:{k}": to_host(v) for k, v in aux.items()},
            **{f"state:{k}": to_host(v) for k, v in state_d.items()},
            **{f"gx{i}": to_host(g) for i, g in enumerate(gxs) if g is not None},
            **{f"g{k}": to_host(v) for k, v in gparams.items()}}
    return host


@pytest.mark.parametrize("use_cudnn", [True, False], ids=["cudnn", "cuda-kernels"])
@pytest.mark.parametrize("training,recompute", [(True, False), (True, True), (False, False)],
                         ids=["train", "recompute", "eval"])
@pytest.mark.parametrize("layer,in_shapes", LAYERS, ids=[f"{l.type_name}{i}" for i, (l, _) in enumerate(LAYERS)])
def test_layer_parity_with_numpy(cupy, layer, in_shapes, training, recompute, use_cudnn):
    from snrt.backends.cuda_kernels import CudaKernels
    from snrt.backends.cupy_backend import CupyBackend

    if layer.type_name == "BatchNorm" and not training and recompute:
        pytest.skip("no recompute in eval")
    rng = np.random.default_rng(0)
    xs = _inputs(layer, in_shapes, rng)
    params = {k: rng.uniform(0.5, 1.5, s.shape).astype(np.float32) for k, s in layer.param_specs(in_shapes).items()}
    state = {k: rng.uniform(0.5, 1.5, s.shape).astype(np.float32) for k, s in layer.state_specs(in_shapes).items()}
    gy = rng.standard_normal(layer.infer_shape(in_shapes)).astype(np.float32)
    expected = _run(layer, layer, xs, params, state, gy, np, training, recompute)
    backend = CupyBackend(0, kernels=CudaKernels(use_cudnn=use_cudnn))
    try:
        kernel = backend.kernel_for(layer, in_shapes)  # armed: any CuPy allocation inside raises
        got = _run(layer, kernel, xs, params, state, gy, cupy, training, recompute, to_host=backend.to_host)
    finally:
        backend.close()
    for key, value in expected.items():
        if layer.type_name in EXACT:
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        else:
            np.testing.assert_allclose(got[key], value, rtol=2e-4, atol=2e-4, err_msg=key)


def test_a_recomputed_batchnorm_forward_repeats_the_first_bit_for_bit(cupy):
    """cuDNN's recomputed BatchNorm forward (the policies that replay it) writes the same y,
    mean and inv_std as the first forward and leaves the running statistics alone."""
    from snrt.backends.cuda_kernels import CudaKernels
    from snrt.backends.cupy_backend import CupyBackend

    layer, shape = BatchNorm(momentum=0.3), (8, 16, 10, 10)
    backend = CupyBackend(0, kernels=CudaKernels())
    try:
        kernel = backend.kernel_for(layer, [shape])
        assert kernel.kernel.name == "cudnn"
        rng = np.random.default_rng(4)
        x = cupy.asarray(rng.standard_normal(shape).astype(np.float32))
        params = {k: cupy.asarray(rng.uniform(0.5, 1.5, 16).astype(np.float32)) for k in ("weight", "bias")}
        state = {"running_mean": cupy.zeros(16, np.float32), "running_var": cupy.ones(16, np.float32)}
        workspace = cupy.zeros(kernel.workspace_bytes([shape], FORWARD), np.uint8)
        outputs = []
        for recompute in (False, True):
            y, aux = cupy.full(shape, np.nan, np.float32), {k: cupy.zeros(16, np.float32) for k in ("mean", "inv_std")}
            kernel.forward(KernelContext(cupy, training=True, workspace=workspace), [x], params, state, y, aux,
                           recompute=recompute)
            outputs.append({"y": backend.to_host(y), **{k: backend.to_host(v) for k, v in {**aux, **state}.items()}})
    finally:
        backend.close()
    first, again = outputs
    for key in first:
        np.testing.assert_array_equal(again[key], first[key], err_msg=key)
    assert not np.array_equal(first["running_mean"], np.zeros(16, np.float32))  # the first forward did update them


def test_cudnn_serves_common_convolutions(cupy):
    """cuDNN (not the fallback) runs the usual ResNet convolutions; refusals are printed."""
    from snrt.backends.cuda_kernels import CudaKernels

    kernels = CudaKernels()
    served = 0
    for layer, shape in [(Conv2d(out_channels=64, kernel=3, padding=1, bias=False), (16, 64, 56, 56)),
                         (Conv2d(out_channels=256, kernel=1, bias=False), (16, 64, 56, 56)),
                         (Conv2d(out_channels=128, kernel=3, stride=2, padding=1, bias=False), (16, 128, 56, 56))]:
        kernel = kernels.kernel_for(layer, [shape])
        assert kernel.name == "cudnn"
        served += sum(kernel.graph(op, None) is not None for op in ("fprop", "dgrad", "wgrad"))
    print("cuDNN refusals:", kernels.cudnn.refusals)
    assert served == 9, kernels.cudnn.refusals


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("limit", [None, 0], ids=["a partial per sample", "none"])
def test_pointwise_gemms_agree_with_numpy_and_repeat_their_bits(cupy, limit, stride):
    """The three cuBLAS operations of a 1x1 convolution (snrt/backends/cuda_pointwise.py) on
    the device against the layer's NumPy kernels; the weight gradient run twice gives the
    same bits."""
    from snrt.backends.cuda_kernels import CudaKernels
    from snrt.backends.cuda_pointwise import PointwiseGemm, pointwise_shape
    from snrt.backends.cudnn_graphs import conv_spec

    layer, in_shapes = Conv2d(out_channels=24, kernel=1, stride=stride, bias=False), [(6, 16, 5, 7)]
    rng = np.random.default_rng(2)
    x = rng.standard_normal(in_shapes[0]).astype(np.float32)
    params = {"weight": rng.standard_normal((24, 16, 1, 1)).astype(np.float32)}
    gy = rng.standard_normal(layer.infer_shape(in_shapes)).astype(np.float32)
    expected = _run(layer, layer, [x], params, {}, gy, np)
    module, shape = CudaKernels().module, pointwise_shape(conv_spec(layer, in_shapes))
    limit = None if limit is None else shape.gathered_bytes  # no partial sums beside the gathered pixels
    ops = {op: PointwiseGemm(module, op, shape, limit) for op in ("fprop", "dgrad", "wgrad")}
    d = {"x": cupy.asarray(x), "w": cupy.asarray(params["weight"]), "dy": cupy.asarray(gy)}
    d.update(y=cupy.full(gy.shape, cupy.nan, cupy.float32), dx=cupy.full(x.shape, cupy.nan, cupy.float32),
             dw=cupy.full((24, 16, 1, 1), cupy.nan, cupy.float32))
    workspace = cupy.full(max(op.workspace_bytes for op in ops.values()) + 1, 255, cupy.uint8)
    pointers = {role: array.data.ptr for role, array in d.items()}
    for op in ("fprop", "dgrad", "wgrad"):
        ops[op].execute({role: pointers[role] for role in ops[op].sizes()}, workspace.data.ptr)
    first_dw = cupy.asnumpy(d["dw"])
    ops["wgrad"].execute({role: pointers[role] for role in ops["wgrad"].sizes()}, workspace.data.ptr)
    np.testing.assert_array_equal(cupy.asnumpy(d["dw"]), first_dw)
    for role, key in (("y", "y"), ("dx", "gx0"), ("dw", "gweight")):
        np.testing.assert_allclose(cupy.asnumpy(d[role]), expected[key], rtol=2e-4, atol=2e-4, err_msg=role)


def test_timing_keeps_the_compute_stream_current(cupy):
    """A kernel timed after the backend made its compute stream current (a workspace query
    that times cuDNN's engines and the alternatives) leaves that stream current, so CuPy's
    kernels and cuDNN's stay in one order."""
    from snrt.backends.cuda_kernels import CudaKernels
    from snrt.backends.cupy_backend import CupyBackend

    backend = CupyBackend(0, kernels=CudaKernels())
    try:
        for layer, shape in ((BatchNorm(), (4, 8, 6, 6)), (Conv2d(out_channels=8, kernel=1), (4, 6, 7, 7))):
            backend.kernel_for(layer, [shape]).workspace_bytes([shape], BACKWARD)
            assert cupy.cuda.get_current_stream() == backend.compute_stream
    finally:
        backend.close()


def test_the_alternatives_to_cudnn_time_themselves_on_the_device(cupy):
    """What may run instead of a cuDNN graph gives its best seconds: the pointwise GEMMs'
    three operations and the BatchNorm kernels' forward and backward."""
    from snrt.backends.cuda_kernels import CudaKernels
    from snrt.backends.cuda_layers import CudaBatchNorm
    from snrt.backends.cuda_pointwise import PointwiseGemm, PointwiseShape
    from snrt.backends.cudnn_graphs import KernelsInstead

    module = CudaKernels().module
    seconds = [PointwiseGemm(module, op, PointwiseShape(8, 64, 128, 14, 14, stride, stride), None).time()
               for op in ("fprop", "dgrad", "wgrad") for stride in (1, 2)]
    in_shapes = [(8, 64, 14, 14)]
    kernel = CudaBatchNorm(BatchNorm(), in_shapes, module)
    seconds += [KernelsInstead(kernel, in_shapes, phase).time() for phase in (FORWARD, BACKWARD)]
    assert all(0 < s < 1 for s in seconds), seconds


def test_engines_are_timed_at_planning_kept_on_disk_and_used_again_untimed(cupy, tmp_path, monkeypatch):
    """The workspace query times cuDNN's engines and selects the fastest (its seconds are
    the least timed); a new process (new kernels, same file) builds that engine again and
    times nothing; the selected engine's workspace is what the plan is told."""
    import json

    from snrt.backends import cudnn_engines
    from snrt.backends.cuda_kernels import CudaKernels

    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    layer, shape = Conv2d(out_channels=64, kernel=3, padding=1, bias=False), (16, 64, 28, 28)
    first = CudaKernels()
    workspace = first.workspace_bytes(layer, [shape], BACKWARD)
    kept = json.loads((tmp_path / cudnn_engines.CACHE_FILE).read_text())
    assert len(kept) == 2 and all("dgrad" in key or "wgrad" in key for key in kept), list(kept)
    graphs = {op: first.kernel_for(layer, [shape]).graph(op, None) for op in ("dgrad", "wgrad")}
    assert workspace == max(graph.workspace_bytes for graph in graphs.values())
    for graph in graphs.values():
        (entry,) = [entry for key, entry in kept.items() if key.endswith("workspace limit None") and
                    entry["engine"] == graph.engine.name]
        assert graph.seconds == min(entry["seconds"].values()) > 0
    first.release()

    monkeypatch.setattr(cudnn_engines, "_fastest", lambda *args: pytest.fail("timed again"))
    again = CudaKernels()
    assert again.workspace_bytes(layer, [shape], BACKWARD) == workspace
    assert {op: again.kernel_for(layer, [shape]).graph(op, None).engine.name for op in graphs} == {
        op: graph.engine.name for op, graph in graphs.items()}
    again.release()


def test_the_cost_models_rates_are_measured_on_this_gpu_and_kept(cupy, tmp_path, monkeypatch):
    """Plans for the CUDA backend use this GPU's rates: device memory faster than the host
    link, both and the GEMM rate far above nothing; kept for the next run."""
    from snrt.backends import cuda_rates
    from snrt.backends.cupy_backend import CupyBackend

    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    model = CupyBackend.planning_cost_model()
    print(f"rates: {model.flops_per_s / 1e12:.1f} TFLOP/s, memory {model.memory_bytes_per_s / 1e9:.0f} GB/s, "
          f"host link {model.copy_bytes_per_s / 1e9:.1f} GB/s")
    assert model.memory_bytes_per_s > model.copy_bytes_per_s > 1e9 and model.flops_per_s > 1e12
    assert (tmp_path / cuda_rates.RATES_FILE).exists()


def _timed(backend, step, action):
    with backend.timed("compute", f"{step.kind} {step.node}"):
        action()


def _configs():
    from tests.scheduler.test_exactness import CONCAT_NET
    from tests.test_train import SMALL_RESNET

    return {"small_resnet": SMALL_RESNET, "concat_net": CONCAT_NET}


@pytest.mark.parametrize("name", ["small_resnet", "concat_net"])
def test_training_under_every_policy_matches_the_cpu(cupy, name):
    """Every policy gives the same losses on the GPU (same kernels, same order), close to the
    CPU's; the measured peak equals the plan's under every policy; check mode finds no
    poisoned read."""
    from snrt.train import Trainer

    config = snrt.load_config(_configs()[name])
    cpu = Trainer(config)
    cpu_losses = [m.loss for m in cpu.fit(iterations=3)]
    cpu_arrays = cpu.host_arrays()
    losses_by_policy = {}
    for policy in POLICIES:
        for check in (False, True):
            trainer = Trainer(with_settings(config, memory={"policy": policy}), backend="cuda", check=check)
            try:
                losses = [m.loss for m in trainer.fit(iterations=3)]
                arrays = trainer.host_arrays()
                assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes, policy
                assert max(trainer.executor.measured_bytes) == trainer.plan.peak_bytes, policy
            finally:
                trainer.backend.close()
            losses_by_policy[(policy, check)] = losses
            np.testing.assert_allclose(losses, cpu_losses, rtol=2e-3, atol=2e-4, err_msg=policy)
            for key, value in cpu_arrays.items():
                np.testing.assert_allclose(arrays[key], value, rtol=5e-3, atol=5e-4, err_msg=f"{policy} {key}")
    first = losses_by_policy[("none", False)]
    differ = {key: losses for key, losses in losses_by_policy.items() if losses != first}
    assert not differ, f"none gave {first}; these differ: {differ}"


@pytest.mark.parametrize("precision, rtol", [("tf32", 2e-2), ("bf16", 5e-2), ("fp16", 5e-2)])
def test_every_precision_trains_every_policy_alike_and_near_the_cpu(cupy, precision, rtol):
    """tf32 (TF32 cuDNN engines and cuBLAS), bf16 and fp16 (2-byte tensors, fp32 kernels on
    staged copies): none and superneurons give the same losses bit for bit, the measured peak
    is the planned one, and the losses stay near the CPU's in the same precision."""
    from snrt.train import Trainer

    config = with_settings(snrt.load_config(_configs()["small_resnet"]), train={"precision": precision})
    cpu_losses = [m.loss for m in Trainer(config).fit(iterations=3)]
    losses = {}
    for policy in ("none", "superneurons"):
        trainer = Trainer(with_settings(config, memory={"policy": policy}), backend="cuda")
        try:
            losses[policy] = [m.loss for m in trainer.fit(iterations=3)]
            assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes, policy
        finally:
            trainer.backend.close()
    assert losses["superneurons"] == losses["none"]
    np.testing.assert_allclose(losses["none"], cpu_losses, rtol=rtol, atol=rtol / 10)


@pytest.mark.parametrize("policy, precision", [("none", "fp32"), ("superneurons", "fp32"), ("none", "bf16")])
def test_iterations_replayed_as_a_cuda_graph_train_as_steps_one_by_one(cupy, policy, precision):
    """The executor captures the second iteration and replays it for the rest (a warm-up and
    cosine schedule changes the learning rate every iteration): the same bits as every
    iteration run step by step, and the measured peak is the planned one."""
    from snrt.train import Trainer

    config = with_settings(snrt.load_config(_configs()["small_resnet"]), memory={"policy": policy},
                           train={"precision": precision, "schedule": {"type": "cosine", "warmup": 2}})
    runs = {}
    for replay in (True, False):
        trainer = Trainer(with_settings(config, train={"cuda_graph": replay}), backend="cuda")
        try:
            losses = [m.loss for m in trainer.fit(iterations=5)]
            runs[replay] = losses, trainer.host_arrays(), trainer.executor.replayed, trainer.executor.describe_replay()
            assert trainer.backend.arena.peak_bytes == trainer.plan.peak_bytes
        finally:
            trainer.backend.close()
    assert runs[True][2] == 4, runs[True][3]
    assert runs[False][2] == 0, runs[False][3]
    assert runs[True][0] == runs[False][0]
    for key, value in runs[False][1].items():
        np.testing.assert_array_equal(runs[True][1][key], value, err_msg=key)


def test_no_allocation_outside_the_arena_while_kernels_run(cupy):
    """With the executor running the backend's kernels (Executor consults backend.kernel_for),
    a whole training iteration allocates nothing from CuPy inside kernel steps (the guard
    would raise), and cudaMemGetInfo sees the arena plus a bounded library overhead."""
    from snrt.train import Trainer

    config = snrt.load_config(_configs()["small_resnet"])
    trainer = Trainer(with_settings(config, memory={"policy": "superneurons"}), backend="cuda")
    try:
        trainer.fit(iterations=2)
        report = trainer.backend.memory_report()
        print(report)
        assert report["arena_peak_bytes"] == trainer.plan.peak_bytes
        assert report["arena_allocated_bytes"] >= report["arena_bytes"]
        # the CUDA context, cuBLAS/cuDNN handles and workspaces, modules, other processes on the GPU
        # (pytest-xdist's workers among them): measured, beyond every pool, so never negative
        assert report["device_used_bytes"] >= report["pooled_bytes"] >= report["arena_allocated_bytes"]
        assert report["untracked_bytes"] == report["device_used_bytes"] - report["pooled_bytes"]
    finally:
        trainer.backend.close()


def test_copies_overlap_compute_in_cuda_event_timings(cupy):
    """Under the offload policy, offloads and prefetches run on their own streams while
    kernels run: the copy intervals from CUDA events intersect the kernels' intervals."""
    from snrt.train import Trainer

    config = snrt.load_config("configs/cifar_resnet20.yaml")
    trainer = Trainer(with_settings(config, train={"batch": 128}, memory={"policy": "offload"}), backend="cuda")
    backend, executor = trainer.backend, trainer.executor
    try:
        assert trainer.plan.host_bytes > 0
        backend.profile = True
        executor.wrap_steps(("forward", "recompute", "backward", "update"),  # kernels timed on the compute stream
                            lambda step, action: lambda: _timed(backend, step, action))
        trainer.fit(iterations=1)  # compiles kernels, builds cuDNN graphs
        backend.clear_timeline()
        trainer.fit(iterations=3)
        timeline = backend.timeline()
    finally:
        backend.close()
    overlap = copy_overlap(timeline)
    print(f"copies {overlap['copy_s'] * 1e3:.2f} ms, overlapped with kernels {overlap['overlapped_s'] * 1e3:.2f} ms")
    assert overlap["copy_s"] > 0 and overlap["hidden"] > 0.1


def test_batches_are_fed_through_pinned_slots_in_turn(cupy):
    """Each input batch goes through one of two pinned slots of its view, taken in turn; a
    slot is refilled only after its copy is done, so batches fed back to back without a
    synchronization each arrive whole, in order."""
    from snrt.backends.cupy_backend import FEED_SLOTS, CupyBackend

    backend = CupyBackend(1 << 20)
    try:
        view = cupy.empty((4, 3, 64, 64), np.float32)
        arrived = []
        for k in range(5):
            backend.feed(view, np.full(view.shape, k, np.float32))
            arrived.append(view.copy())  # on the compute stream, like the iteration that reads it
        assert [float(a.min()) for a in arrived] == [float(a.max()) for a in arrived] == [0, 1, 2, 3, 4]
        slots = backend._feed_slots[view.data.ptr]
        assert len(slots) == FEED_SLOTS
        host_memory = 1  # cudaMemoryTypeHost
        assert all(cupy.cuda.runtime.pointerGetAttributes(staged.ctypes.data).type == host_memory
                   for staged, _ in slots)
    finally:
        backend.close()


def test_a_cuda_training_run_prints_nothing_after_its_summary(tmp_path):
    """No library object outlives the interpreter (cuDNN graphs, tensors and the handle are
    released at exit): stderr stays empty and the summary table is the last thing printed."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-m", "snrt", "train", str(root / "configs" / "cifar_resnet20.yaml"),
                             "--backend", "cuda", "--data", "synthetic", "--batch", "8", "--iterations", "2",
                             "--no-progress", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr == "", result.stderr[-3000:]
    assert result.stdout.rstrip().splitlines()[-1].startswith("└"), result.stdout[-2000:]  # the summary table's end
