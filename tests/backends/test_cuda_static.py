"""What can be checked about the CUDA backend without a GPU.

Without CuPy (the default install): `import snrt` stays free of CuPy, asking for the cuda
backend is a clear error, the kernel registry covers every layer whose xp code allocates,
the GEMM convolution's bands fit the workspace existing plans give, and its pointer and
leading-dimension arithmetic (and cuBLAS Linear's) is right, run against NumPy stand-ins for
cuBLAS and the im2col/col2im/bias kernels on host memory.

With the gpu extra (CuPy, NVRTC, cuDNN frontend, NCCL; no device needed): every CUDA kernel
source compiles with NVRTC for the architectures we target, the backend modules import, NCCL
loads and its data-type codes are those the gradient exchange uses,
and a cuDNN frontend graph is described for every convolution (forward, data gradient,
weight gradient) and BatchNorm (forward, recomputed forward, backward) in configs/ at batch
1 and 16, with the frontend's own shape inference agreeing with snrt's.
"""

import ctypes
import glob
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import snrt
from snrt.backends import backend_class, cuda_available, cuda_unavailable_reason, default_backend
from snrt.backends import cuda_layers, cuda_source
from snrt.backends.cuda_kernels import REGISTRY
from snrt.backends.cudnn_graphs import row_major_strides
from snrt.backends.cuda_layers import (NUMPY_ONLY, ConvGeometry, CublasLinear, CudaConvTranspose2d, CudaUpsample,
                                       GemmConv2d)
from snrt.errors import SnrtError
from snrt.layers import LAYERS
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.conv import Conv2d, ConvTranspose2d
from snrt.layers.linear import Linear
from snrt.layers.pool import Upsample
from snrt.optim import SGD, Adam

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.yaml")))
BATCHES = (1, 16)


def config_shapes(type_name):
    """{(layer, in_shapes)} of every `type_name` node in configs/ at batch 1 and 16."""
    found = {}
    for path in CONFIGS:
        graph = snrt.load_config(path).graph
        for name, node in graph.nodes.items():
            if node.layer.type_name == type_name:
                for batch in BATCHES:
                    key = (node.layer, tuple(tuple(s) for s in graph.in_shapes(name, batch)))
                    found.setdefault(key, f"{os.path.basename(path)}:{name}@{batch}")
    return found


# ---- without CuPy ------------------------------------------------------------------------

def test_import_snrt_does_not_import_cupy():
    code = ("import sys, snrt, snrt.backends, snrt.backends.cuda_kernels; "
            "snrt.plan(snrt.load_config('configs/lenet.yaml').graph, batch=2); "
            "bad = [m for m in ('cupy', 'cudnn', 'cupy_backends') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_cuda_request_without_cuda_is_a_clear_error():
    if cuda_available():
        pytest.skip("this machine has a CUDA device")
    plan = snrt.plan(snrt.load_config(os.path.join(ROOT, "configs", "lenet.yaml")).graph, batch=2)
    with pytest.raises(SnrtError, match="cuda backend is not available") as error:
        backend_class("cuda")(plan.arena_bytes, plan.host_bytes)
    assert cuda_unavailable_reason() in str(error.value)
    assert default_backend() == "cpu"
    assert backend_class("cpu")(plan.arena_bytes, plan.host_bytes).name == "cpu"  # cpu always works


def test_unknown_backend_is_an_error():
    with pytest.raises(SnrtError, match="unknown backend"):
        backend_class("tpu")


def test_registry_covers_every_layer_whose_xp_code_allocates():
    from snrt.layers.fused import AddReLU, BatchNormReLU

    assert set(NUMPY_ONLY) <= set(REGISTRY)
    assert set(REGISTRY) <= set(LAYERS) | {BatchNormReLU.type_name, AddReLU.type_name}  # and the nodes fusion makes


def test_gemm_convolution_fits_the_workspace_existing_plans_give():
    """The fallback convolution runs in the workspace the NumPy layer plans, for every
    convolution in configs/, its bands cover every output row once, and the input rows a
    band reads are the rows its col2im touches."""
    for (layer, in_shapes), where in config_shapes("Conv2d").items():
        g = ConvGeometry.of(layer, in_shapes)
        for phase in (FORWARD, BACKWARD):
            planned = layer.workspace_bytes(in_shapes, phase)
            bands = g.bands(planned)
            assert [r0 for r0, _ in bands] == list(np.cumsum([0] + [rows for _, rows in bands[:-1]])), where
            assert sum(rows for _, rows in bands) == g.ho, where
            if not g.pointwise:
                assert max(rows for _, rows in bands) * g.col_rows * g.wo * 4 <= planned, where
        r0, rows = bands[len(bands) // 2]
        in0, count = g.input_rows(r0, rows)
        read = {oh * g.sh - g.ph + a * g.dh for oh in range(r0, r0 + rows) for a in range(g.kh)}
        read = {r for r in read if 0 <= r < g.h}
        assert read <= set(range(in0, in0 + count)), where


# ---- the GEMM kernels' host-side arithmetic against NumPy stand-ins -----------------------

def _host_view(address, shape, strides):
    """A float32 view of host memory at `address` (element strides)."""
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    base = np.frombuffer((ctypes.c_float * extent).from_address(int(address)), dtype=np.float32)
    return np.lib.stride_tricks.as_strided(base, shape, [4 * s for s in strides])


def _address(arg):
    return int(arg) if isinstance(arg, (int, np.integer)) else arg.ctypes.data


class HostModule:
    """KernelModule's interface on host memory: cuBLAS's row-major GEMM and the kernels the
    convolution and Linear launch, written independently in NumPy."""

    def gemm(self, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate=False, batch=1,
             stride_a=0, stride_b=0, stride_c=0):
        a_rows, a_cols = (k, m) if trans_a else (m, k)
        b_rows, b_cols = (n, k) if trans_b else (k, n)
        assert lda >= a_cols and ldb >= b_cols and ldc >= n
        for i in range(batch):  # element strides, as cuBLAS counts them
            left = _host_view(a + 4 * i * stride_a, (a_rows, a_cols), (lda, 1)).astype(np.float64)
            right = _host_view(b + 4 * i * stride_b, (b_rows, b_cols), (ldb, 1)).astype(np.float64)
            out = _host_view(c + 4 * i * stride_c, (m, n), (ldc, 1))
            result = (left.T if trans_a else left) @ (right.T if trans_b else right)
            out[...] = result + (out if accumulate else 0)

    def launch(self, name, blocks, args, threads=256):
        getattr(self, name)(*args)

    @staticmethod
    def _planes(pointer, nc, h, w):
        return _host_view(_address(pointer), (nc, h, w), (h * w, w, 1))

    def snrt_subsample(self, x, xs, nc, h, w, ho, wo, sh, sw):
        nc, h, w, ho, wo, sh, sw = map(int, (nc, h, w, ho, wo, sh, sw))
        self._planes(xs, nc, ho, wo)[...] = self._planes(x, nc, h, w)[:, ::sh, ::sw]

    def snrt_unsubsample(self, gxs, gx, nc, h, w, ho, wo, sh, sw):
        nc, h, w, ho, wo, sh, sw = map(int, (nc, h, w, ho, wo, sh, sw))
        target = self._planes(gx, nc, h, w)
        target[...] = 0
        target[:, ::sh, ::sw] = self._planes(gxs, nc, ho, wo)

    @staticmethod
    def snrt_sum_slices(parts, out, count, size):
        count, size = int(count), int(size)
        slices = _host_view(_address(parts), (count, size), (size, 1))
        total = slices[0].copy()
        for k in range(1, count):  # in order, in float32, as the kernel adds
            total += slices[k]
        _host_view(_address(out), (size,), (1,))[...] = total

    @staticmethod
    def snrt_bias_add(y, b, total, c, hw):
        y.reshape(-1, int(c), int(hw))[...] += b[:, None]

    @staticmethod
    def snrt_channel_sum(x, out, n, c, hw):
        out[...] = x.reshape(int(n), int(c), int(hw)).astype(np.float64).sum(axis=(0, 2))

    @staticmethod
    def snrt_im2col(x, col, c, h, w, wo, kh, kw, sh, sw, ph, pw, dh, dw, r0, rows):
        c, h, w, wo, kh, kw, sh, sw, ph, pw, dh, dw, r0, rows = map(int, (c, h, w, wo, kh, kw, sh, sw, ph, pw, dh, dw, r0, rows))
        image = np.pad(_host_view(_address(x), (c, h, w), (h * w, w, 1)), ((0, 0), (ph, ph), (pw, pw)))
        out = col[: c * kh * kw * rows * wo].reshape(c, kh, kw, rows, wo)
        for a in range(kh):
            for b in range(kw):
                out[:, a, b] = image[:, r0 * sh + a * dh::sh, b * dw::sw][:, :rows, :wo]

    @staticmethod
    def snrt_col2im_add(col, gx, c, h, w, wo, kh, kw, sh, sw, ph, pw, dh, dw, r0, rows, in0, in_rows):
        c, h, w, wo, kh, kw, sh, sw, ph, pw, dh, dw, r0, rows, in0, in_rows = map(
            int, (c, h, w, wo, kh, kw, sh, sw, ph, pw, dh, dw, r0, rows, in0, in_rows))
        padded = np.zeros((c, h + 2 * ph + sh * rows + kh * dh, w + 2 * pw + sw * wo + kw * dw))
        grad = col[: c * kh * kw * rows * wo].reshape(c, kh, kw, rows, wo)
        for a in range(kh):
            for b in range(kw):
                top = r0 * sh + a * dh
                padded[:, top:top + sh * rows:sh, b * dw:b * dw + sw * wo:sw] += grad[:, a, b]
        inside = padded[:, ph:ph + h, pw:pw + w]
        target = _host_view(_address(gx), (c, h, w), (h * w, w, 1))
        assert not inside[:, :in0].any() and not inside[:, in0 + in_rows:].any(), "band touches rows outside its range"
        target[:, in0:in0 + in_rows] += inside[:, in0:in0 + in_rows]


@pytest.fixture
def host_pointers(monkeypatch):
    monkeypatch.setattr(cuda_layers, "device_pointer", lambda array: array.ctypes.data)


def _numpy_run(layer, shape, rng):
    """(x, params, y, gy, gx, gparams) of the layer's NumPy kernels on random float32 data."""
    x = rng.standard_normal(shape).astype(np.float32)
    in_shapes = [x.shape]
    params = {k: rng.standard_normal(s.shape).astype(np.float32) for k, s in layer.param_specs(in_shapes).items()}
    y = np.zeros(layer.infer_shape(in_shapes), np.float32)
    layer.forward(KernelContext(np, workspace=np.zeros(layer.workspace_bytes(in_shapes, FORWARD), np.uint8)),
                  [x], params, {}, y, {})
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gparams, gx = {k: np.zeros_like(v) for k, v in params.items()}, np.zeros_like(x)
    layer.backward(KernelContext(np, workspace=np.zeros(layer.workspace_bytes(in_shapes, BACKWARD), np.uint8)),
                   gy, Saved((x,)), params, {}, [gx], gparams)
    return x, params, y, gy, gx, gparams


CONVS = [
    dict(out_channels=6, kernel=3, padding=1),
    dict(out_channels=4, kernel=3, stride=2, padding=1, bias=False),
    dict(out_channels=6, kernel=(3, 2), stride=(2, 1), padding=(1, 0), dilation=(1, 2)),
    dict(out_channels=6, kernel=3, padding=2, dilation=2, groups=3),
    dict(out_channels=8, kernel=1),
    dict(out_channels=6, kernel=1, groups=3, bias=False),
    dict(out_channels=5, kernel=1, stride=2),
]


@pytest.mark.parametrize("options", CONVS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("workspace_rows", [1, 3, None])
def test_gemm_convolution_matches_the_numpy_kernel(options, workspace_rows, host_pointers):
    layer = Conv2d(**options)
    x, params, y_ref, gy, gx_ref, grads_ref = _numpy_run(layer, (2, 6, 9, 8), np.random.default_rng(0))
    in_shapes = [x.shape]

    kernel = GemmConv2d(layer, in_shapes, HostModule())
    g = ConvGeometry.of(layer, in_shapes)
    rows = g.ho if workspace_rows is None else workspace_rows
    nbytes = 0 if g.pointwise else rows * g.col_rows * g.wo * 4 + 60  # bands of `rows` output rows
    y = np.full_like(y_ref, np.nan)
    kernel.forward(KernelContext(np, workspace=np.zeros(nbytes, np.uint8) if nbytes else None), [x], params, {}, y, {})
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    grads = {k: np.full_like(v, np.nan) for k, v in params.items()}
    gx = np.full_like(x, np.nan)
    kernel.backward(KernelContext(np, workspace=np.zeros(nbytes, np.uint8) if nbytes else None),
                    gy, Saved((x,)), params, {}, [gx], grads)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-4)
    for k in params:
        np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-4, atol=1e-3)
    gx_only = np.full_like(x, np.nan)  # cuDNN did the weight gradient: the input gradient alone
    kernel.backward_parts(KernelContext(np, workspace=np.zeros(nbytes, np.uint8) if nbytes else None),
                          gy, x, gx_only, params, grads, weight_grad=False, bias_grad=False)
    np.testing.assert_allclose(gx_only, gx_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("stride", [1, 2, (3, 2)], ids=str)
@pytest.mark.parametrize("partials", [5, 2, 1])
def test_pointwise_gemms_match_the_numpy_convolution(stride, partials):
    """cuda_pointwise's three operations (batched cuBLAS GEMMs; strided pixels gathered into
    the workspace and the data gradient spread back; the weight gradient's partial sums in the
    workspace, or none) against the layer's NumPy kernels, on host memory."""
    from snrt.backends.cuda_pointwise import PointwiseGemm, pointwise_shape
    from snrt.backends.cudnn_graphs import conv_spec
    from snrt.layers.base import scratch_aligned

    layer = Conv2d(out_channels=6, kernel=1, stride=stride, bias=False)
    x, params, y_ref, gy, gx_ref, grads_ref = _numpy_run(layer, (5, 4, 3, 7), np.random.default_rng(4))
    shape = pointwise_shape(conv_spec(layer, [x.shape]))
    assert (shape.n, shape.c, shape.o, shape.ho, shape.wo) == (5, 4, 6, *y_ref.shape[2:])
    gathered = scratch_aligned(shape.gathered_bytes)
    limit = None if partials == 5 else gathered + partials * 6 * 4 * 4 + 3
    y, gx, gw = np.full_like(y_ref, np.nan), np.full_like(x, np.nan), np.full_like(params["weight"], np.nan)
    w = params["weight"]
    ops = {op: PointwiseGemm(HostModule(), op, shape, limit) for op in ("fprop", "dgrad", "wgrad")}
    assert ops["wgrad"].partials == partials
    assert ops["fprop"].workspace_bytes == ops["dgrad"].workspace_bytes == shape.gathered_bytes
    assert (shape.gathered_bytes > 0) == (stride != 1)
    assert limit is None or ops["wgrad"].workspace_bytes <= limit

    held = {op: np.full(ops[op].workspace_bytes, 255, np.uint8) for op in ops}  # exactly what each asks for
    workspace = {op: held[op].ctypes.data if held[op].size else 0 for op in ops}
    ops["fprop"].execute({"x": x.ctypes.data, "w": w.ctypes.data, "y": y.ctypes.data}, workspace["fprop"])
    ops["dgrad"].execute({"dy": gy.ctypes.data, "w": w.ctypes.data, "dx": gx.ctypes.data}, workspace["dgrad"])
    ops["wgrad"].execute({"x": x.ctypes.data, "dy": gy.ctypes.data, "dw": gw.ctypes.data}, workspace["wgrad"])
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gw, grads_ref["weight"], rtol=1e-5, atol=1e-5)


def test_a_cudnn_convolution_runs_the_pointwise_gemms_it_timed_faster(tmp_path, monkeypatch):
    """CudnnConv2d of a 1x1 convolution with a cuDNN graph per operation (stand-ins, timed at
    2 ms) and GEMMs timed at 1 ms: it plans the GEMMs' workspace and seconds and runs them
    in its forward and backward (on host memory, the layer's NumPy kernels as reference)."""
    from types import SimpleNamespace

    from snrt.backends import cuda_pointwise, cudnn_graphs
    from snrt.backends.cudnn_graphs import CudnnConv2d

    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SNRT_CUDNN_ENGINES", raising=False)
    monkeypatch.setattr(cudnn_graphs, "device_pointer", lambda array: array.ctypes.data)
    monkeypatch.setattr(cuda_pointwise.PointwiseGemm, "time", lambda self: 1e-3)
    layer = Conv2d(out_channels=6, kernel=1)
    x, params, y_ref, gy, gx_ref, grads_ref = _numpy_run(layer, (5, 4, 3, 7), np.random.default_rng(5))
    in_shapes = [x.shape]
    context = SimpleNamespace(refusals={}, workspace_limit_bytes=None,
                              choice_key=lambda description, limit: f"{description} | {limit}")
    kernel = CudnnConv2d(layer, in_shapes, SimpleNamespace(module=HostModule(), cudnn=context),
                         GemmConv2d(layer, in_shapes, HostModule()))
    kernel._graphs = {(op, None): SimpleNamespace(seconds=2e-3, workspace_bytes=0, name="cudnn")
                      for op in ("fprop", "dgrad", "wgrad")}
    assert kernel.measured_seconds(FORWARD) == 1e-3 and kernel.measured_seconds(BACKWARD) == 2e-3
    assert kernel.workspace_bytes(in_shapes, BACKWARD) == 5 * 6 * 4 * 4  # a partial sum per sample
    assert [graph.name for graph in kernel.graphs()] == ["cublas"] * 3
    y = np.full_like(y_ref, np.nan)
    kernel.forward(KernelContext(np), [x], params, {}, y, {})
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    grads = {k: np.full_like(v, np.nan) for k, v in params.items()}
    gx = np.full_like(x, np.nan)
    workspace = np.zeros(kernel.workspace_bytes(in_shapes, BACKWARD), np.uint8)
    kernel.backward(KernelContext(np, workspace=workspace), gy, Saved((x,)), params, {}, [gx], grads)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
    for k in params:
        np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-5, atol=1e-4)
    spatial = CudnnConv2d(Conv2d(out_channels=6, kernel=3), in_shapes, SimpleNamespace(module=HostModule(), cudnn=context),
                          None)
    spatial._graphs = dict(kernel._graphs)
    assert spatial.graph("wgrad", None).name == "cudnn"  # not pointwise: cuDNN's graph, nothing timed


@pytest.mark.parametrize("options", [dict(kernel=3, padding=1), dict(kernel=3, stride=2), dict(kernel=1, padding=1),
                                     dict(kernel=1, groups=2), dict(kernel=(1, 3), padding=(0, 1))], ids=str)
def test_only_pointwise_convolutions_are_offered_to_the_gemms(options):
    from snrt.backends.cuda_pointwise import pointwise_shape
    from snrt.backends.cudnn_graphs import conv_spec

    assert pointwise_shape(conv_spec(Conv2d(out_channels=4, **options), [(2, 4, 8, 8)])) is None


def test_the_pointwise_weight_gradient_keeps_its_partials_within_the_cap_and_the_limit():
    from snrt.backends.cuda_pointwise import PARTIALS_CAP_BYTES, PointwiseShape, weight_partials

    small, large = PointwiseShape(32, 64, 256, 56, 56), PointwiseShape(32, 1024, 2048, 14, 14)
    assert weight_partials(small, None) == 32
    assert weight_partials(large, None) == PARTIALS_CAP_BYTES // (1024 * 2048 * 4) == 4
    assert weight_partials(small, 3 * 64 * 256 * 4 + 5) == 3
    assert weight_partials(large, 1 << 20) == weight_partials(small, 0) == 1
    strided = PointwiseShape(32, 64, 256, 56, 56, 2, 2)  # the gathered pixels come first
    assert strided.gathered_bytes == 32 * 64 * 28 * 28 * 4
    assert weight_partials(strided, strided.gathered_bytes + 3 * 64 * 256 * 4) == 3


TRANSPOSED = [
    dict(out_channels=4, kernel=2, stride=2),
    dict(out_channels=6, kernel=3, stride=2, padding=1, output_padding=1, groups=3, bias=False),
    dict(out_channels=5, kernel=(3, 2), padding=(1, 0), dilation=(1, 2)),
    dict(out_channels=4, kernel=1),
]


@pytest.mark.parametrize("options", TRANSPOSED, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("workspace_rows", [1, None])
def test_gemm_transposed_convolution_matches_the_numpy_kernel(options, workspace_rows, host_pointers):
    layer = ConvTranspose2d(**options)
    x, params, y_ref, gy, gx_ref, grads_ref = _numpy_run(layer, (2, 6, 5, 4), np.random.default_rng(2))
    kernel = CudaConvTranspose2d(layer, [x.shape], HostModule())
    # the adjoint convolution runs forward over gy and backward over y's shape: bands of its rows
    g = ConvGeometry.of(kernel.conv.layer, [y_ref.shape])
    rows = g.ho if workspace_rows is None else workspace_rows
    nbytes = 0 if g.pointwise else rows * g.col_rows * g.wo * 4 + 60

    def context():
        return KernelContext(np, workspace=np.zeros(nbytes, np.uint8) if nbytes else None)

    y = np.full_like(y_ref, np.nan)
    kernel.forward(context(), [x], params, {}, y, {})
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-4)
    grads, gx = {k: np.full_like(v, np.nan) for k, v in params.items()}, np.full_like(x, np.nan)
    kernel.backward(context(), gy, Saved((x,)), params, {}, [gx], grads)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-4, atol=1e-4)
    for k in params:
        np.testing.assert_allclose(grads[k], grads_ref[k], rtol=1e-4, atol=1e-3)


def test_gemm_convolution_refuses_a_workspace_smaller_than_one_row(host_pointers):
    layer = Conv2d(out_channels=4, kernel=3, padding=1)
    kernel = GemmConv2d(layer, [(1, 3, 8, 8)], HostModule())
    x = np.zeros((1, 3, 8, 8), np.float32)
    y = np.zeros((1, 4, 8, 8), np.float32)
    with pytest.raises(RuntimeError, match="needs at least 864 workspace bytes"):
        kernel.forward(KernelContext(np, workspace=np.zeros(100, np.uint8)), [x], {"weight": np.zeros((4, 3, 3, 3), np.float32),
                       "bias": np.zeros(4, np.float32)}, {}, y, {})


@pytest.mark.parametrize("scale", [2, (3, 2)], ids=["2", "3x2"])
def test_cublas_bilinear_upsample_matches_the_numpy_kernel(scale, host_pointers):
    layer = Upsample(scale=scale, mode="bilinear")
    x, _, y_ref, gy, gx_ref, _ = _numpy_run(layer, (2, 3, 5, 4), np.random.default_rng(3))
    kernel = CudaUpsample(layer, [x.shape], HostModule())

    def context(phase):
        return KernelContext(np, workspace=np.zeros(kernel.workspace_bytes([x.shape], phase), np.uint8))

    y = np.full_like(y_ref, np.nan)
    kernel.forward(context(FORWARD), [x], {}, {}, y, {})
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    gx = np.full_like(x, np.nan)
    kernel.backward(context(BACKWARD), gy, Saved((None,)), {}, {}, [gx], {})
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [True, False])
def test_cublas_linear_matches_the_numpy_kernel(bias, host_pointers):
    rng = np.random.default_rng(1)
    layer = Linear(out_features=5, bias=bias)
    x = rng.standard_normal((3, 2, 2, 2)).astype(np.float32)  # trailing dims are flattened
    params = {k: rng.standard_normal(s.shape).astype(np.float32) for k, s in layer.param_specs([x.shape]).items()}
    y_ref, y = np.zeros((3, 5), np.float32), np.zeros((3, 5), np.float32)
    layer.forward(KernelContext(np), [x], params, {}, y_ref, {})
    kernel = CublasLinear(layer, [x.shape], HostModule())
    kernel.forward(KernelContext(np), [x], params, {}, y, {})
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    gy = rng.standard_normal((3, 5)).astype(np.float32)
    ref = {k: np.zeros_like(v) for k, v in params.items()}
    got = {k: np.zeros_like(v) for k, v in params.items()}
    gx_ref, gx = np.zeros_like(x), np.zeros_like(x)
    layer.backward(KernelContext(np), gy, Saved((x,)), params, {}, [gx_ref], ref)
    kernel.backward(KernelContext(np), gy, Saved((x,)), params, {}, [gx], got)
    np.testing.assert_allclose(gx, gx_ref, rtol=1e-5, atol=1e-5)
    for k in params:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-5)


# ---- with the gpu extra (no device needed) ------------------------------------------------

# ---- one-pass kernels (updates, ReLU and Add backwards): arguments against C signatures ----

def kernel_signatures():
    """{kernel: [parameter type]} of the kernels KERNEL_SOURCE declares plainly (not by macro)."""
    declared = re.findall(r'extern "C" __global__ void (\w+)\(([^)]*)\)', cuda_source.KERNEL_SOURCE)
    return {name: [re.sub(r"\s*\w+$", "", p.strip()).replace("const ", "") for p in params.split(",")]
            for name, params in declared}


ARGUMENT_TYPES = {"long long": np.int64, "float": np.float32, "unsigned int": np.uint32, "int": np.int32}


def assert_arguments_match(name, args):
    types = kernel_signatures()[name]
    assert len(args) == len(types), f"{name} takes {len(types)} arguments, launched with {len(args)}"
    for i, (arg, declared) in enumerate(zip(args, types)):
        if declared.endswith("*"):
            assert isinstance(arg, (int, np.uint64, np.ndarray)), (name, i, declared, arg)
        else:
            assert type(arg) is ARGUMENT_TYPES[declared], (name, i, declared, type(arg))


def _flat(address, n):
    """A flat float32 view of n values at a host address or of an array; None for null."""
    if isinstance(address, np.ndarray):
        return address.reshape(-1)
    return _host_view(int(address), (int(n),), (1,)) if int(address) else None


class OnePassModule:
    """The one-pass kernels on host memory, written from their CUDA source in NumPy (float32
    throughout, as the kernels compute); every launch's arguments checked against the C
    signature."""

    def launch(self, name, blocks, args, threads=256):
        assert_arguments_match(name, args)
        getattr(self, name)(*args)

    @staticmethod
    def _scaled(g, scale, clip):
        g = g * scale
        return np.where(np.isnan(g), g, np.clip(g, -clip, clip)) if clip > 0 else g

    def snrt_sgd_step(self, w, g, m, n, scale, clip, weight_decay, momentum, nesterov, lr):
        w, g, m = _flat(w, n), _flat(g, n), _flat(m, n)
        gi = self._scaled(g, scale, clip) + weight_decay * w
        step = gi
        if m is not None:
            m[...] = momentum * m + gi
            step = gi + momentum * m if nesterov else m
        w -= lr * step

    def snrt_relu_backward(self, y, gy, gx, n):
        _flat(gx, n)[...] = np.sign(_flat(y, n)) * _flat(gy, n)

    def snrt_copy_to_two(self, source, a, b, n):
        for target in (_flat(a, n), _flat(b, n)):
            if target is not None:
                target[...] = _flat(source, n)

    def snrt_adam_step(self, w, g, m, v, n, scale, clip, decay, beta1, rest1, beta2, rest2, eps, step_size,
                       correction2, decoupled):
        w, g, m, v = (_flat(a, n) for a in (w, g, m, v))
        gi = self._scaled(g, scale, clip)
        if decoupled:
            w *= 1 - decay
        else:
            gi = gi + decay * w
        m[...] = beta1 * m + rest1 * gi
        v[...] = beta2 * v + rest2 * gi * gi
        w -= step_size * (m / (np.sqrt(v) * correction2 + eps))

    def snrt_sgd_step_at(self, w, g, m, n, s):
        self.snrt_sgd_step(w, g, m, n, *(np.float32(x) for x in s[:6]))

    def snrt_adam_step_at(self, w, g, m, v, n, s):
        self.snrt_adam_step(w, g, m, v, n, *(np.float32(x) for x in s[:11]))


class CapturedModule(OnePassModule):
    """OnePassModule whose launches are recorded, as a capture does, and run by `replay`."""

    def __init__(self):
        self.launches = []

    def launch(self, name, blocks, args, threads=256):
        assert_arguments_match(name, args)
        self.launches.append((name, args))

    def replay(self):
        for name, args in self.launches:
            getattr(self, name)(*args)


@pytest.mark.parametrize("optimizer", [
    SGD(), SGD(momentum=0.0, weight_decay=0.1), SGD(nesterov=True, weight_decay=0.01, clip_value=0.05),
    Adam(weight_decay=0.1), Adam(weight_decay=0.1, decoupled=True, clip_value=0.3)], ids=repr)
def test_the_cuda_backends_one_kernel_updates_match_the_optimizers_own(optimizer):
    """CupyBackend.update launches snrt_sgd_step / snrt_adam_step with arguments of the C
    signature's types, in an order that computes what Optimizer.update computes (gradient
    scale and clipping included), over three updates."""
    cupy_backend = pytest.importorskip("snrt.backends.cupy_backend")
    from types import SimpleNamespace

    backend = SimpleNamespace(kernels=SimpleNamespace(module=OnePassModule()), _rows=None)
    rng = np.random.default_rng(3)
    w = rng.standard_normal(37).astype(np.float32)
    states = [np.abs(rng.standard_normal(37)).astype(np.float32) for _ in optimizer.state_names]
    expected_w, expected_states = w.copy(), [s.copy() for s in states]
    workspace = np.empty(w.nbytes, np.uint8)
    for count in (1, 2, 3):
        g = rng.standard_normal(37).astype(np.float32)
        cupy_backend.CupyBackend.update(backend, optimizer, w, g.copy(), states, 0.1, 0.05, count, workspace, 0.5)
        optimizer.update(np, expected_w, g.copy(), expected_states, 0.1, 0.05, count, workspace, 0.5)
    np.testing.assert_allclose(w, expected_w, rtol=1e-5, atol=1e-6)
    for state, expected in zip(states, expected_states):
        np.testing.assert_allclose(state, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("optimizer", [SGD(nesterov=True, weight_decay=0.01, clip_value=0.05), SGD(momentum=0.0),
                                       Adam(weight_decay=0.1, decoupled=True)], ids=repr)
def test_a_captured_update_reads_the_scalars_each_replay_writes_to_its_row(optimizer):
    """In a capture CupyBackend.update launches snrt_*_step_at on its row of UpdateRows; in a
    replay it only rewrites the row, so the captured launch computes the update of each
    iteration's learning rate and step count."""
    cupy_backend = pytest.importorskip("snrt.backends.cupy_backend")
    from types import SimpleNamespace

    module = CapturedModule()
    rows = object.__new__(cupy_backend.UpdateRows)
    rows.host = np.zeros((1, cupy_backend.UpdateRows.WIDTH), np.float32)
    rows.device, rows.mode, rows.next = rows.host, "capture", 0  # the kernels read the rows as written
    backend = SimpleNamespace(kernels=SimpleNamespace(module=module), _rows=rows)
    rng = np.random.default_rng(5)
    w = rng.standard_normal(29).astype(np.float32)
    states = [np.abs(rng.standard_normal(29)).astype(np.float32) for _ in optimizer.state_names]
    expected_w, expected_states = w.copy(), [s.copy() for s in states]
    g = rng.standard_normal(29).astype(np.float32)
    workspace = np.empty(w.nbytes, np.uint8)
    cupy_backend.CupyBackend.update(backend, optimizer, w, g, states, 0.1, 0.5, 1, workspace, 0.5)
    assert [name for name, _ in module.launches] == [f"snrt_{optimizer.fused_name}_step_at"]
    assert np.array_equal(w, expected_w), "a capture runs nothing"
    for count, lr in ((1, 0.05), (2, 0.02), (3, 0.01)):
        rows.mode, rows.next = "replay", 0
        cupy_backend.CupyBackend.update(backend, optimizer, w, g, states, 0.1, lr, count, workspace, 0.5)
        assert rows.next == 1 and len(module.launches) == 1
        module.replay()
        optimizer.update(np, expected_w, g.copy(), expected_states, 0.1, lr, count, workspace, 0.5)
        np.testing.assert_allclose(w, expected_w, rtol=1e-5, atol=1e-6)
    for state, expected in zip(states, expected_states):
        np.testing.assert_allclose(state, expected, rtol=1e-5, atol=1e-6)
    rows.mode = "capture"
    with pytest.raises(cupy_backend.NotCapturable, match="float16 parameter"):
        cupy_backend.CupyBackend.update(backend, optimizer, w.astype(np.float16), g, states, 0.1, 0.5, 1,
                                        workspace)


@pytest.mark.parametrize("inputs", [2, 3, 4])
def test_the_one_pass_relu_and_add_backwards_match_the_layers_own(inputs):
    """CudaReLU's backward (NaN and zero outputs included) and CudaAdd's for 2 to 4 inputs,
    one of them without a gradient, give what the layers' xp code gives."""
    from snrt.backends.cuda_layers import CudaAdd, CudaReLU
    from snrt.layers.activation import ReLU
    from snrt.layers.join import Add

    rng = np.random.default_rng(1)
    ctx = KernelContext(np, True, 0, 0, 0, None)
    y = np.maximum(rng.standard_normal((2, 3, 5)).astype(np.float32), 0)
    y[0, 0, :2] = np.nan, 0.0
    gy = rng.standard_normal(y.shape).astype(np.float32)
    gx, expected = np.empty_like(y), np.empty_like(y)
    CudaReLU(ReLU(), [y.shape], OnePassModule()).backward(ctx, gy, Saved(xs=(None,), y=y), {}, {}, [gx], {})
    ReLU().backward(ctx, gy, Saved(xs=(None,), y=y), {}, {}, [expected], {})
    np.testing.assert_array_equal(gx, expected)
    gxs = [np.zeros_like(gy) for _ in range(inputs)]
    gxs[1] = None
    CudaAdd(Add(), [gy.shape] * inputs, OnePassModule()).backward(ctx, gy, Saved(xs=(None,) * inputs), {}, {}, gxs, {})
    assert all(np.array_equal(gx, gy) for gx in gxs if gx is not None)


@pytest.mark.parametrize("over_gy", [None, 0, 1], ids=["apart", "first-over-gy", "second-over-gy"])
def test_add_relu_on_cuda_is_adds_then_relus_kernels_and_may_write_over_gy(over_gy):
    """The CUDA backend's AddReLU: Add's and ReLU's kernels composed (AddThenReLU), no workspace,
    its backward the layer's bits with an input gradient in gy's own array or apart."""
    from types import SimpleNamespace

    from snrt.backends.cuda_kernels import _add_relu
    from snrt.backends.cuda_layers import CudaAdd, CudaReLU
    from snrt.layers.fused import AddReLU

    module = OnePassModule()
    kinds = {"Add": CudaAdd, "ReLU": CudaReLU}
    kernels = SimpleNamespace(kernel_for=lambda layer, shapes: kinds[layer.type_name](layer, shapes, module))
    layer, shape = AddReLU(), (2, 3, 5)
    kernel = _add_relu(layer, [shape, shape], kernels)
    assert kernel.name == "cuda+relu" and kernel.measured_seconds(BACKWARD) is None
    assert kernel.workspace_bytes([shape, shape], BACKWARD) == 0 < layer.workspace_bytes([shape, shape], BACKWARD)
    rng = np.random.default_rng(6)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(2)]
    xs[0][0, 0, :2] = np.nan, -xs[1][0, 0, 1]  # a NaN, and a sum of exactly 0
    gy = rng.standard_normal(shape).astype(np.float32)
    ctx = KernelContext(np, True, 0, 0, 0, np.zeros(layer.workspace_bytes([shape, shape], BACKWARD), np.uint8))
    ys, grads = [], []
    for runner in (kernel, layer):
        y, given = np.empty_like(gy), gy.copy()
        runner.forward(ctx, xs, {}, {}, y, {})
        gxs = [given if i == over_gy else np.full_like(gy, np.nan) for i in range(2)]
        runner.backward(ctx, given, Saved(xs=(None, None), y=y), {}, {}, gxs, {})
        ys.append(y)
        grads.append(gxs)
    np.testing.assert_array_equal(ys[0], ys[1])
    for got, want in zip(*grads):
        np.testing.assert_array_equal(got, want)


class BatchNormModule:
    """snrt_bn_* on host memory, read from their CUDA source into NumPy: a block per channel
    and slice of samples, its partial sum in float32, a channel's partials added in order;
    every launch's arguments checked against the C signature and the grid's block count."""

    def launch(self, name, blocks, args, threads=256):
        assert_arguments_match(name, args)
        getattr(self, name)(blocks, *args)

    @staticmethod
    def _slices(x, n, c, hw, slices):
        """[(channel, block, the slice's values)] of x (n, c, hw) in block order."""
        per = -(-n // slices)
        x = _flat(x, n * c * hw).reshape(n, c, hw)
        return [(b // slices, b, x[(b % slices) * per:(b % slices + 1) * per, b // slices]) for b in range(c * slices)]

    @staticmethod
    def _total(partials, ch, slices):
        total = np.float32(0)
        for s in range(slices):
            total = np.float32(total + partials[ch * slices + s])
        return total

    def snrt_bn_sums(self, blocks, x, sums, n, c, hw, slices):
        assert blocks == c * slices
        for ch, b, values in self._slices(x, int(n), int(c), int(hw), int(slices)):
            sums[b] = values.sum(dtype=np.float32)

    def _mean(self, sums, ch, slices, count):
        return np.float32(self._total(sums, ch, slices) * np.float32(1.0 / count))

    def snrt_bn_squares(self, blocks, x, sums, squares, n, c, hw, slices):
        for ch, b, values in self._slices(x, int(n), int(c), int(hw), int(slices)):
            squares[b] = ((values - self._mean(sums, ch, int(slices), int(n * hw))) ** 2).sum(dtype=np.float32)

    def snrt_bn_normalize(self, blocks, x, y, weight, bias, sums, squares, mean, inv_std, running_mean, running_var,
                          n, c, hw, slices, eps, momentum, keep, unbias, update_running, relu):
        n, c, hw, slices = map(int, (n, c, hw, slices))
        y = _flat(y, n * c * hw).reshape(n, c, hw)
        per = -(-n // slices)
        for ch, b, values in self._slices(x, n, c, hw, slices):
            m = self._mean(sums, ch, slices, n * hw)
            var = np.float32(self._total(squares, ch, slices) / np.float32(n * hw))
            inv = np.float32(1) / np.sqrt(np.float32(var + eps))
            if b % slices == 0:
                mean[ch], inv_std[ch] = m, inv
                if update_running:
                    running_mean[ch] = running_mean[ch] * keep + momentum * m
                    running_var[ch] = running_var[ch] * keep + momentum * (var * unbias)
            scale = inv * weight[ch] if isinstance(weight, np.ndarray) else inv
            shift = bias[ch] if isinstance(bias, np.ndarray) else np.float32(0)
            out = (values - m) * scale + shift
            y[(b % slices) * per:(b % slices + 1) * per, ch] = np.maximum(out, np.float32(0)) if relu else out

    def snrt_bn_forward_eval(self, blocks, x, y, weight, bias, running_mean, running_var, mean, inv_std, total, c, hw,
                             eps):
        c, hw = int(c), int(hw)
        inv = np.float32(1) / np.sqrt(running_var + eps)
        scale = inv * weight if isinstance(weight, np.ndarray) else inv
        shift = (bias if isinstance(bias, np.ndarray) else np.float32(0)) - running_mean * scale
        x3, y3 = _flat(x, total).reshape(-1, c, hw), _flat(y, total).reshape(-1, c, hw)
        y3[...] = x3 * scale[:, None] + shift[:, None]
        mean[...], inv_std[...] = running_mean, inv

    @staticmethod
    def _grad_in(g, x, ch, weight, bias, mean, inv_std, relu):
        """gy, or masked by ReLU's gradient at the output computed again (snrt_bn_grad_in)."""
        if not relu:
            return g
        scale = inv_std[ch] * weight[ch] if isinstance(weight, np.ndarray) else inv_std[ch]
        v = (x - mean[ch]) * scale + (bias[ch] if isinstance(bias, np.ndarray) else np.float32(0))
        return np.where(v > 0, np.float32(1), np.where(np.isnan(v), v, np.float32(0))) * g

    def snrt_bn_grad_sums(self, blocks, x, gy, weight, bias, mean, inv_std, sums, dots, n, c, hw, slices, relu):
        n, c, hw, slices = map(int, (n, c, hw, slices))
        gys = self._slices(gy, n, c, hw, slices)
        for (ch, b, values), (_, _, g) in zip(self._slices(x, n, c, hw, slices), gys):
            g = self._grad_in(g, values, ch, weight, bias, mean, inv_std, relu)
            sums[b] = g.sum(dtype=np.float32)
            dots[b] = (g * (values - mean[ch])).sum(dtype=np.float32)

    def snrt_bn_grad_input(self, blocks, x, gy, weight, bias, mean, inv_std, sums, dots, gx, gweight, gbias, n, c, hw,
                           slices, training, relu):
        n, c, hw, slices = map(int, (n, c, hw, slices))
        per = -(-n // slices)
        gys = self._slices(gy, n, c, hw, slices)
        for (ch, b, values), (_, _, g) in zip(self._slices(x, n, c, hw, slices), gys):
            g = self._grad_in(g, values, ch, weight, bias, mean, inv_std, relu)
            inv, m = inv_std[ch], mean[ch]
            sum_gy = self._total(sums, ch, slices)
            sum_gy_xhat = np.float32(self._total(dots, ch, slices) * inv)
            if b % slices == 0 and isinstance(gweight, np.ndarray):
                gweight[ch], gbias[ch] = sum_gy_xhat, sum_gy
            if not isinstance(gx, np.ndarray):
                continue
            scale = inv * weight[ch] if isinstance(weight, np.ndarray) else inv
            c1 = np.float32(-inv * sum_gy_xhat / np.float32(n * hw))
            c0 = np.float32(-m * c1 - sum_gy / np.float32(n * hw))
            out = ((values * c1 + c0) + g) * scale if training else g * scale
            gx.reshape(n, c, hw)[(b % slices) * per:(b % slices + 1) * per, ch] = out


@pytest.mark.parametrize("shape", [(5, 3, 4, 6), (32, 2, 3, 3), (3, 5000, 2, 1), (7, 4)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_the_cuda_batch_norm_kernels_compute_the_layers_values(shape, affine):
    """CudaBatchNorm's launches (slices of samples, partial sums in its workspace), read into
    NumPy, against the layer's xp kernels: training forward with the running statistics, a
    recomputed forward that leaves them, eval, and the backward with and without gx."""
    from snrt.backends.cuda_layers import CudaBatchNorm, batchnorm_slices
    from snrt.layers.norm import BatchNorm

    layer = BatchNorm(affine=affine, momentum=0.3)
    rng = np.random.default_rng(8)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    in_shapes = [x.shape]
    kernel = CudaBatchNorm(layer, in_shapes, BatchNormModule())
    slices, per = batchnorm_slices(shape[0], shape[1], int(np.prod(shape[2:])))
    assert slices * per >= shape[0] > (slices - 1) * per and shape[1] * slices <= max(2048 + shape[1], shape[1])
    params = {k: rng.uniform(0.5, 1.5, spec.shape).astype(np.float32) for k, spec in layer.param_specs(in_shapes).items()}
    gy = rng.standard_normal(shape).astype(np.float32)
    results = []
    for k in (layer, kernel):
        state = {name: np.full(spec.shape, 0.5, np.float32) for name, spec in layer.state_specs(in_shapes).items()}
        aux = {name: np.zeros(spec.shape, np.float32) for name, spec in layer.aux_specs(in_shapes).items()}
        out = {}
        for phase_name, training, recompute in (("train", True, False), ("again", True, True), ("eval", False, False)):
            y = np.full(shape, np.nan, np.float32)
            workspace = np.zeros(k.workspace_bytes(in_shapes, FORWARD), np.uint8)
            k.forward(KernelContext(np, training=training, workspace=workspace), [x], params, state, y, aux,
                      recompute=recompute)
            out[phase_name] = y
            if phase_name != "eval":
                out[f"{phase_name} state"] = {name: v.copy() for name, v in state.items()}
        k.forward(KernelContext(np, training=True, workspace=np.zeros(k.workspace_bytes(in_shapes, FORWARD), np.uint8)),
                  [x], params, state, np.empty_like(x), aux, recompute=True)
        for with_gx in (True, False):
            gx = np.full_like(x, np.nan) if with_gx else None
            grads = {name: np.full_like(v, np.nan) for name, v in params.items()}
            workspace = np.zeros(k.workspace_bytes(in_shapes, BACKWARD), np.uint8)
            k.backward(KernelContext(np, training=True, workspace=workspace), gy, Saved((x,)), params, aux, [gx], grads)
            out[f"gx {with_gx}"], out[f"grads {with_gx}"] = gx, grads
        results.append(out)
    expected, got = results
    for key, value in expected.items():
        if isinstance(value, dict):
            for name in value:
                np.testing.assert_allclose(got[key][name], value[name], rtol=2e-5, atol=2e-5, err_msg=f"{key} {name}")
        elif value is None:
            assert got[key] is None
        else:
            np.testing.assert_allclose(got[key], value, rtol=2e-5, atol=2e-5, err_msg=key)
    np.testing.assert_array_equal(results[1]["train state"]["running_mean"], results[1]["again state"]["running_mean"])


def test_a_cudnn_batch_norm_runs_the_cuda_kernels_it_timed_faster(tmp_path, monkeypatch):
    """CudnnBatchNorm with cuDNN graphs timed at 2 ms (stand-ins) and its CUDA kernels at 1 ms:
    it plans the kernels' workspace and seconds and runs them (read into NumPy)."""
    from types import SimpleNamespace

    from snrt.backends import cudnn_graphs
    from snrt.backends.cuda_layers import CudaBatchNorm
    from snrt.backends.cudnn_graphs import CudnnBatchNorm
    from snrt.layers.norm import BatchNorm

    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("SNRT_CUDNN_ENGINES", raising=False)
    monkeypatch.setattr(cudnn_graphs.KernelsInstead, "time", lambda self: 1e-3)
    layer, in_shapes = BatchNorm(), [(6, 3, 4, 4)]
    context = SimpleNamespace(refusals={}, workspace_limit_bytes=None,
                              choice_key=lambda description, limit: f"{description} | {limit}")
    fallback = CudaBatchNorm(layer, in_shapes, BatchNormModule())
    kernel = CudnnBatchNorm(layer, in_shapes, SimpleNamespace(module=None, cudnn=context), fallback)
    kernel._graphs = {(op, None): SimpleNamespace(seconds=2e-3, workspace_bytes=1 << 20, name="cudnn")
                      for op in ("forward", "backward")}
    assert kernel.measured_seconds(FORWARD) == kernel.measured_seconds(BACKWARD) == 1e-3
    for phase in (FORWARD, BACKWARD):
        assert kernel.workspace_bytes(in_shapes, phase) == fallback.workspace_bytes(in_shapes, phase) > 0
    assert [graph.name for graph in kernel.graphs()] == ["cuda", "cuda"]
    for expected, got in zip(*(_batch_norm_train(k, in_shapes[0], np.random.default_rng(9)) for k in (layer, kernel))):
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def _batch_norm_train(runner, shape, rng):
    """[y, gx, gradients, aux, state] of a training forward then backward of `runner` (a
    BatchNorm layer or kernel over 3 channels) on host arrays drawn from `rng`."""
    x, gy = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    params = {"weight": rng.uniform(0.5, 1.5, 3).astype(np.float32), "bias": rng.standard_normal(3).astype(np.float32)}
    state = {"running_mean": np.zeros(3, np.float32), "running_var": np.ones(3, np.float32)}
    aux = {"mean": np.empty(3, np.float32), "inv_std": np.empty(3, np.float32)}
    y, gx = np.empty_like(x), np.empty_like(x)
    gparams = {k: np.empty_like(v) for k, v in params.items()}
    workspace = np.empty(max(runner.workspace_bytes([shape], phase) for phase in (FORWARD, BACKWARD)), np.uint8)
    runner.forward(KernelContext(np, True, 0, 0, 0, workspace), [x], params, state, y, aux)
    runner.backward(KernelContext(np, True, 0, 0, 0, workspace), gy, Saved((x,), None), params, aux, [gx], gparams)
    return [y, gx, *gparams.values(), *aux.values(), *state.values()]


def test_timing_on_its_own_pool_leaves_the_stream_that_was_current(monkeypatch):
    """on_own_pool runs the measurement on a new stream and makes the one current before
    (a backend's compute stream, made current by use()) current again, on success, on
    running out of memory and on any other error: CuPy's `with stream:` would restore the
    null stream instead."""
    from types import ModuleType, SimpleNamespace

    from snrt.backends.cuda_source import on_own_pool

    class OutOfMemoryError(Exception):
        pass

    current = []

    class Stream:
        def __init__(self, non_blocking=False):
            self.synchronized = False

        def use(self):
            current[:] = [self]

        def synchronize(self):
            self.synchronized = True

    class Pool:
        def malloc(self, nbytes):
            raise AssertionError("nothing allocated here")

        def free_all_blocks(self):
            pass

    class UsingAllocator:
        def __init__(self, allocator):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *args):
            return False

    cupy = ModuleType("cupy")
    cupy.cuda = SimpleNamespace(MemoryPool=Pool, Stream=Stream, get_current_stream=lambda: current[0],
                                using_allocator=UsingAllocator, memory=SimpleNamespace(OutOfMemoryError=OutOfMemoryError))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    compute = Stream()
    compute.use()
    seen = []

    def measure(module, stream):
        seen.append(stream)
        assert module is cupy and current[0] is stream is not compute
        return 1.5

    assert on_own_pool(measure) == 1.5 and current[0] is compute and seen[0].synchronized

    def out_of_memory(module, stream):
        raise OutOfMemoryError()

    assert on_own_pool(out_of_memory) is None and current[0] is compute

    def failing(module, stream):
        raise ValueError("the library's error")

    with pytest.raises(ValueError):
        on_own_pool(failing)
    assert current[0] is compute


class MaxPoolModule:
    """snrt_maxpool_* on host memory, read from their CUDA source into Python loops (a thread
    per output, a thread per input element); each launch's arguments checked against the C
    signature of the kernel the macro declares (the uint8 or int32 instance)."""

    def launch(self, name, blocks, args, threads=256):
        phase, index = name.rsplit("_", 2)[1:]
        pointer = {"u8": np.uint8, "i32": np.int32}[index]
        if phase == "forward":
            assert [type(a) for a in args[:3]] == [np.ndarray] * 3 and args[2].dtype == pointer
        else:
            assert [type(a) for a in args[:3]] == [np.ndarray] * 3 and args[1].dtype == pointer
        assert all(type(a) is np.int64 for a in args[3:]) and len(args) == 14, name
        getattr(self, phase)(*args[:3], *map(int, args[3:]))

    @staticmethod
    def forward(x, y, argmax, nc, h, w, ho, wo, kh, kw, sh, sw, ph, pw):
        x, y, argmax = x.reshape(nc, h, w), y.reshape(nc, ho, wo), argmax.reshape(nc, ho, wo)
        for plane, oh, ow in np.ndindex(nc, ho, wo):
            best, index = np.float32(-np.inf), 0
            for a, b in np.ndindex(kh, kw):
                r, q = oh * sh - ph + a, ow * sw - pw + b
                if 0 <= r < h and 0 <= q < w:
                    v = x[plane, r, q]
                    if v > best:
                        index = a * kw + b
                    best = best if np.isnan(best) else (v if np.isnan(v) else max(best, v))
            y[plane, oh, ow], argmax[plane, oh, ow] = best, index

    @staticmethod
    def backward(gy, argmax, gx, nc, h, w, ho, wo, kh, kw, sh, sw, ph, pw):
        gy, argmax, gx = gy.reshape(nc, ho, wo), argmax.reshape(nc, ho, wo), gx.reshape(nc, h, w)
        for plane, r, q in np.ndindex(nc, h, w):
            acc = np.float32(0)
            for a, b in np.ndindex(kh, kw):
                top, left = r + ph - a, q + pw - b
                if top >= 0 and left >= 0 and top % sh == 0 and left % sw == 0 and top // sh < ho and left // sw < wo:
                    o = (plane, top // sh, left // sw)
                    acc = np.float32(acc + gy[o] * np.float32(argmax[o] == a * kw + b))
            gx[plane, r, q] = acc


@pytest.mark.parametrize("options", [dict(kernel=3, stride=2, padding=1), dict(kernel=2),
                                     dict(kernel=3, stride=2, ceil_mode=True), dict(kernel=(2, 3), stride=1),
                                     dict(kernel=16, stride=4, padding=8)], ids=str)
def test_the_cuda_max_pool_computes_the_layers_bits(options):
    """CudaMaxPool's launches, read into NumPy, give the layer's xp outputs, argmax indices
    (uint8, or int32 past 255 taps) and gradients bit for bit, ties and a NaN included."""
    from snrt.backends.cuda_layers import CudaMaxPool
    from snrt.layers.pool import MaxPool

    layer = MaxPool(**options)
    rng = np.random.default_rng(6)
    x = rng.integers(-3, 4, (2, 3, 9, 10)).astype(np.float32)  # many ties
    x[1, 2, 4, 4] = np.nan
    in_shapes = [x.shape]
    y_shape = layer.infer_shape(in_shapes)
    gy = rng.standard_normal(y_shape).astype(np.float32)
    runs = []
    for kernel in (layer, CudaMaxPool(layer, in_shapes, MaxPoolModule())):
        aux = {k: np.zeros(spec.shape, spec.dtype) for k, spec in layer.aux_specs(in_shapes).items()}
        y, gx = np.full(y_shape, 7.0, np.float32), np.full(x.shape, 7.0, np.float32)
        workspace = np.zeros(max(kernel.workspace_bytes(in_shapes, FORWARD), kernel.workspace_bytes(in_shapes, BACKWARD), 1),
                             np.uint8)
        kernel.forward(KernelContext(np, workspace=workspace), [x], {}, {}, y, aux)
        kernel.backward(KernelContext(np, workspace=workspace), gy, Saved((None,)), {}, aux, [gx], {})
        runs.append((y, aux["argmax"], gx))
    assert CudaMaxPool(layer, in_shapes, None).workspace_bytes(in_shapes, BACKWARD) == 0
    for expected, got in zip(*runs):
        np.testing.assert_array_equal(got, expected)
        assert got.dtype == expected.dtype


class FusedModule(OnePassModule, BatchNormModule):
    """The one-pass and BatchNorm kernels together, on host memory."""

    def launch(self, name, blocks, args, threads=256):
        (BatchNormModule if name.startswith("snrt_bn_") else OnePassModule).launch(self, name, blocks, args, threads)


def test_a_fused_batch_norm_relu_on_cuda_masks_inside_batch_norms_backward():
    """CudaReLUAfter over BatchNorm's CUDA kernels: forward with the ReLU inside their
    normalizing pass; backward by BatchNorm's two CUDA passes with the ReLU's mask inside,
    within a workspace of their partial sums alone (the layer's holds the output again): the
    layer's values. Over cuDNN's graph (a stand-in: BatchNorm's xp code), the forward is that
    kernel's then ReLU's, bit for bit the layer's."""
    from types import SimpleNamespace

    from snrt.backends.cuda_kernels import CudaReLUAfter
    from snrt.backends.cuda_layers import CudaBatchNorm, CudaReLU, XpKernel
    from snrt.layers.fused import BatchNormReLU

    module = FusedModule()
    kinds = {"BatchNorm": CudaBatchNorm, "ReLU": CudaReLU}
    kernels = SimpleNamespace(kernel_for=lambda layer, shapes: kinds[layer.type_name](layer, shapes, module),
                              module=module)
    layer, shape = BatchNormReLU(), (4, 3, 5, 5)
    kernel = CudaReLUAfter(layer, [shape], kernels)
    assert kernel.name == "cuda+relu" and kernel.measured_seconds(BACKWARD) is None
    kernel.relu = SimpleNamespace(forward=lambda *args, **kwargs: pytest.fail("ReLU ran apart from the kernels' pass"))
    assert kernel.workspace_bytes([shape], BACKWARD) == kernel.masked.own_workspace_bytes([shape], BACKWARD)
    assert kernel.workspace_bytes([shape], BACKWARD) < 4 * np.prod(shape) < layer.workspace_bytes([shape], BACKWARD)
    for got, want in zip(*(_batch_norm_train(runner, shape, np.random.default_rng(2)) for runner in (kernel, layer))):
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    x[0, 0, 0, 0] = np.nan
    params = {"weight": np.full(3, 1.5, np.float32), "bias": np.full(3, -0.25, np.float32)}
    by_xp = SimpleNamespace(kernel_for=lambda layer, shapes: (XpKernel if layer.type_name == "BatchNorm" else CudaReLU)(
        layer, shapes, module), module=module)
    outputs = []
    for runner in (CudaReLUAfter(layer, [shape], by_xp), kernel, layer):
        state = {"running_mean": np.zeros(3, np.float32), "running_var": np.ones(3, np.float32)}
        aux = {"mean": np.empty(3, np.float32), "inv_std": np.empty(3, np.float32)}
        y = np.full_like(x, 7.0)
        runner.forward(KernelContext(np, True, 0, 0, 0, np.zeros(runner.workspace_bytes([shape], FORWARD) + 1, np.uint8)),
                       [x], params, state, y, aux)
        outputs.append(y)
    np.testing.assert_array_equal(outputs[0], outputs[2])  # BatchNorm's kernel, then ReLU's: the layer's bits
    np.testing.assert_allclose(outputs[1], outputs[2], rtol=2e-5, atol=2e-5)  # inside the kernels' pass
    assert np.isnan(outputs[2]).any() and np.array_equal(np.isnan(outputs[1]), np.isnan(outputs[2]))  # NaN kept


@pytest.mark.parametrize("layer, in_shapes", [(Conv2d(out_channels=4, kernel=3), [(2, 3, 8, 8)]),
                                              (Linear(out_features=5), [(2, 7)])], ids=["Conv2d", "Linear"])
def test_the_cuda_kernel_choice_reserves_the_fp32_staging_of_2_byte_tensors(layer, in_shapes):
    """With 2-byte tensors a CUDA kernel runs on fp32 copies carved from its workspace, ahead
    of its own fp32 workspace, as on the CPU: the kernel choice reserves both."""
    pytest.importorskip("cupy")
    from snrt.backends.cuda_kernels import CudaKernels
    from snrt.layers.staging import staged_workspace_bytes

    kernels = CudaKernels(use_cudnn=False)
    for phase in (FORWARD, BACKWARD):
        own = kernels.workspace_bytes(layer, in_shapes, phase)
        assert kernels.workspace_bytes(layer, in_shapes, phase, 2) == staged_workspace_bytes(layer, in_shapes, phase, own)
        assert kernels.workspace_bytes(layer, in_shapes, phase, 2) > own


def test_tf32_plans_and_runs_with_tf32_kernels_and_fp32_with_fp32_ones(monkeypatch):
    """The CUDA backend runs every precision (2 bytes on staged fp32 copies): its kernel choice for
    tf32 admits TF32 cuDNN engines and computes GEMMs as CUBLAS_COMPUTE_32F_FAST_TF32, the one
    for fp32 neither (plain SGEMM); each is deterministic unless asked not to be."""
    cupy_backend = pytest.importorskip("snrt.backends.cupy_backend")
    from types import SimpleNamespace

    from snrt.precision import unsupported

    CupyBackend = cupy_backend.CupyBackend
    assert all(unsupported(p, CupyBackend) is None for p in ("fp32", "tf32", "bf16", "fp16"))
    monkeypatch.setattr(cupy_backend, "_DEFAULT_KERNELS", {})
    tf32, fp32 = CupyBackend.kernel_choice("tf32"), CupyBackend.kernel_choice("fp32")
    assert tf32.allow_tf32 and not fp32.allow_tf32 and CupyBackend.kernel_choice() is fp32
    assert fp32.deterministic and tf32.deterministic  # unless the run says otherwise:
    anything = CupyBackend.kernel_choice("fp32", deterministic=False)
    assert not anything.deterministic and not anything.allow_tf32 and anything is not fp32
    calls = []

    class Cublas:
        CUBLAS_OP_N, CUBLAS_OP_T, CUBLAS_POINTER_MODE_HOST = 0, 1, 0
        CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT = 77, -1

        def __getattr__(self, name):
            return lambda *args: calls.append((name, args))

    for kernels in (tf32, fp32):
        module = object.__new__(cuda_source.KernelModule)
        module.cublas, module.tf32 = Cublas(), kernels.allow_tf32
        module.cupy = SimpleNamespace(cuda=SimpleNamespace(device=SimpleNamespace(get_cublas_handle=lambda: 7),
                                                           get_current_stream=lambda: SimpleNamespace(ptr=0),
                                                           runtime=SimpleNamespace(CUDA_R_32F=0)))
        module._one, module._zero = np.ones(1, np.float32), np.zeros(1, np.float32)
        module.gemm(False, True, 4, 5, 6, 100, 6, 200, 6, 300, 5)
    gemms = [(name, args) for name, args in calls if "gemm" in name.lower()]
    assert [name for name, _ in gemms] == ["gemmStridedBatchedEx", "sgemmStridedBatched"]
    assert gemms[0][1][-2:] == (77, -1)


def test_every_cuda_kernel_compiles_with_nvrtc_for_the_toolkits_architectures():
    """The oldest architecture the installed NVRTC supports (sm_70 on CUDA 12, sm_75 on CUDA
    13, which dropped Volta), Ampere and Hopper."""
    pytest.importorskip("cupy")
    (major, _), archs = cuda_source.nvrtc_toolkit()
    assert archs[0] == {12: 70, 13: 75}.get(major, archs[0]), (major, archs)
    for arch in sorted({archs[0], 80, 90} & set(archs)):
        ptx = cuda_source.compile_ptx(arch=f"compute_{arch}").decode()
        for name in cuda_source.KERNEL_NAMES:
            assert f".entry {name}(" in ptx, (arch, name)


@pytest.mark.parametrize("capability,toolkit,refused", [
    (70, ((13, 0), (75, 80, 90)), "the GPU Tesla V100 (sm_70) is older than snrt supports on CUDA 13.0 (sm_75 and newer) "
                                  "(the gpu extra, for CUDA 12, compiles for sm_70 and newer)"),
    (60, ((12, 9), (70, 75, 80, 90)), "the GPU Tesla V100 (sm_60) is older than snrt supports on CUDA 12.9 (sm_70 and newer)"),
    (75, ((13, 0), (75, 80, 90)), None),
    (120, ((12, 9), (70, 75, 80, 90)), None),  # newer than the toolkit knows: PTX for the newest
], ids=["volta-on-13", "pascal-on-12", "turing-on-13", "newer-than-12"])
def test_a_gpu_older_than_the_toolkit_is_refused_naming_both(capability, toolkit, refused):
    assert cuda_source.unsupported_device_reason("Tesla V100", capability, toolkit) == refused


def test_nvrtc_check_reports_errors():
    pytest.importorskip("cupy")
    with pytest.raises(cuda_source.CompileError, match='identifier "undefined_name" is undefined'):
        cuda_source.compile_ptx('extern "C" __global__ void k(float* x) { x[0] = undefined_name; }')


def test_backend_modules_import_cleanly():
    pytest.importorskip("cupy")
    from snrt.backends import cudnn_graphs, cupy_backend

    assert cupy_backend.CupyBackend.name == "cuda" and cudnn_graphs.CudnnConv2d.name == "cudnn"
    reason = cuda_unavailable_reason()
    assert (reason is None) == cuda_available()
    if reason is not None:
        assert "cannot reach a CUDA device" in reason or "finds no CUDA device" in reason


def test_nccl_loads_and_its_data_types_are_the_ones_snrt_names():
    pytest.importorskip("cupy")
    import pickle

    from cupy.cuda import nccl

    from snrt.backends.cupy_backend import NCCL_TYPES

    assert nccl.available  # the nvidia-nccl-cu12 wheel of the gpu extra
    assert NCCL_TYPES == {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}
    assert nccl.get_version() >= 21800
    unique_id = nccl.get_unique_id()  # what rank 0 sends the others over MPI: it must pickle
    assert pickle.loads(pickle.dumps(unique_id)) == unique_id


def _validate_or_need_a_driver(graph):
    """validate() lowers the graph to cuDNN: on a GPU it must pass; without one it can only
    fail for want of the CUDA driver (the frontend's Python IR checks ran before that)."""
    try:
        graph.validate()
    except Exception as e:
        if cuda_available():
            raise
        assert "driver" in str(e).lower() or "cudaGetDeviceCount" in str(e), e


def test_cudnn_graphs_are_described_for_every_convolution_in_configs():
    cudnn = pytest.importorskip("cudnn")
    from snrt.backends.cudnn_graphs import CONV_OPS, conv_spec, describe_conv

    shapes = config_shapes("Conv2d")
    assert len(shapes) > 100
    for (layer, in_shapes), where in shapes.items():
        spec = conv_spec(layer, in_shapes)
        assert spec.y == layer.infer_shape(in_shapes)
        assert spec.x[1] == spec.w[1] * spec.groups
        for op in CONV_OPS:
            graph, tensors = describe_conv(cudnn, spec, op)
            out = {"fprop": "y", "dgrad": "dx", "wgrad": "dw"}[op]
            expected = {"y": spec.y, "dx": spec.x, "dw": spec.w}[out]
            assert tuple(tensors[out].dim) == expected, (where, op)
            assert tuple(tensors[out].stride) == row_major_strides(expected), (where, op)
            for role, tensor in tensors.items():
                assert tuple(tensor.stride) == row_major_strides(tensor.dim), (where, op, role)
            (node,) = graph.inspect()["nodes"]
            params = node["params"]
            assert list(params["padding"]) == list(layer.padding), (where, op)
            assert list(params["stride"]) == list(layer.stride), (where, op)
            assert list(params["dilation"]) == list(layer.dilation), (where, op)
    _validate_or_need_a_driver(graph)  # lowering needs the driver: the last graph is a sample


def _assert_layouts_are_explicit(graph, tensors, where):
    """Every tensor of a described graph (scalars aside) carries dims and packed row-major
    strides that snrt set itself: the frontend lowers only set ones, and cuDNN picks its own
    layout (channels-last for a convolution's output) for the rest. No tensor is missing
    from `tensors`, so every one is bound to an arena view."""
    assert len(graph.inspect()["tensors"]) == len(tensors), where
    for role, tensor in tensors.items():
        if tensor.is_pass_by_value:
            continue
        assert tensor.dim_assigned and tensor.stride_assigned, (where, role, "layout left to cuDNN")
        assert tuple(tensor.stride) == row_major_strides(tensor.dim), (where, role)


def test_every_cudnn_tensor_has_the_layout_of_its_arena_view():
    cudnn = pytest.importorskip("cudnn")
    from snrt.backends.cudnn_graphs import (BATCHNORM_OPS, CONV_OPS, batchnorm_spec, conv_spec, describe_batchnorm,
                                            describe_conv)

    for type_name, spec_of, describe, ops in (("Conv2d", conv_spec, describe_conv, CONV_OPS),
                                              ("BatchNorm", batchnorm_spec, describe_batchnorm, BATCHNORM_OPS)):
        for (layer, in_shapes), where in config_shapes(type_name).items():
            spec = spec_of(layer, in_shapes)
            for op in ops:
                _assert_layouts_are_explicit(*describe(cudnn, spec, op), (where, op))


def test_the_frontend_offers_every_call_engine_timing_makes():
    """Engine selection and timing (cudnn_engines.py, CudnnContext.time_engines) use the
    frontend's per-plan calls and the tensors' pass-by-value flag and uid: each exists, with
    the parameters passed by name, in the pinned frontend."""
    import inspect

    cudnn = pytest.importorskip("cudnn")
    from snrt.backends.cudnn_graphs import BatchNormSpec, describe_batchnorm

    for method in ("get_execution_plan_count", "get_plan_name_at_index", "get_workspace_size_plan_at_index",
                   "build_plan_at_index", "execute_plan_at_index", "get_workspace_size", "execute"):
        assert callable(getattr(cudnn.pygraph, method, None)), method
    assert {"index", "handle"} <= set(inspect.signature(cudnn.pygraph.execute_plan_at_index).parameters)
    assert list(inspect.signature(cudnn.set_stream).parameters) == ["handle", "stream"]
    _, tensors = describe_batchnorm(cudnn, BatchNormSpec((4, 8, 2, 2), 8, 1e-5, 0.1), "forward")
    assert {role for role, t in tensors.items() if t.get_is_pass_by_value()} == {"epsilon", "momentum"}
    assert all(isinstance(t.uid, int) and t.get_dim() for t in tensors.values())


def test_cudnn_fprop_shape_inference_agrees_with_snrt():
    """The frontend infers conv_fprop's output itself: it must be snrt's output shape."""
    cudnn = pytest.importorskip("cudnn")
    from snrt.backends.cudnn_graphs import conv_spec, describe_conv

    for (layer, in_shapes), where in config_shapes("Conv2d").items():
        spec = conv_spec(layer, in_shapes)
        f32 = cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32)
        x = graph.tensor(name="x", dim=list(spec.x), data_type=f32)
        w = graph.tensor(name="w", dim=list(spec.w), data_type=f32)
        y = graph.conv_fprop(image=x, weight=w, padding=list(spec.padding), stride=list(spec.stride),
                             dilation=list(spec.dilation))
        assert tuple(y.dim) == layer.infer_shape(in_shapes), where
        assert describe_conv(cudnn, spec, "fprop")[1]["y"].dim == y.dim


def test_cudnn_graphs_are_described_for_every_batchnorm_in_configs():
    cudnn = pytest.importorskip("cudnn")
    from snrt.backends.cudnn_graphs import BATCHNORM_OPS, batchnorm_spec, describe_batchnorm

    shapes = config_shapes("BatchNorm")
    assert len(shapes) > 100
    for (layer, in_shapes), where in shapes.items():
        spec = batchnorm_spec(layer, in_shapes)
        channels = in_shapes[0][1]
        assert spec.stats == (1, channels, 1, 1) and spec.x[:2] == tuple(in_shapes[0][:2])
        assert int(np.prod(spec.x)) == int(np.prod(in_shapes[0]))  # the same bytes as snrt's buffer
        for op in BATCHNORM_OPS:
            graph, tensors = describe_batchnorm(cudnn, spec, op)
            big = ("y",) if op == "forward" else ("dx",)
            small = ("mean", "inv_std", "next_running_mean") if op == "forward" else ("dscale", "dbias")
            for role in big:
                assert tuple(tensors[role].dim) == spec.x, (where, op, role)
            for role in small:
                assert tuple(tensors[role].dim) == spec.stats, (where, op, role)
            assert tensors.get("epsilon") is None or tensors["epsilon"].is_pass_by_value
    _validate_or_need_a_driver(graph)


def test_tensors_too_large_for_cudnn_go_to_the_fallback_without_asking_it():
    """A convolution whose tensors exceed 2^31 - 1 elements is refused before any cuDNN call
    (its heuristics are never asked), and plans with the GEMM fallback's workspace."""
    from types import SimpleNamespace

    from snrt.backends.cudnn_graphs import CudnnConv2d

    layer, in_shapes = Conv2d(out_channels=10 ** 12, kernel=5), [(4, 1, 28, 28)]
    kernels = SimpleNamespace(module=None, cudnn=SimpleNamespace(refusals={}, workspace_limit_bytes=None))
    fallback = GemmConv2d(layer, in_shapes, None)
    kernel = CudnnConv2d(layer, in_shapes, kernels, fallback)
    for phase in (FORWARD, BACKWARD):
        assert kernel.workspace_bytes(in_shapes, phase) == fallback.workspace_bytes(in_shapes, phase)
    assert all(kernel.graph(op, None) is None for op in ("fprop", "dgrad", "wgrad"))
    (why,) = kernels.cudnn.refusals.values()
    assert "more than 2147483647 elements" in why


def test_a_cudnn_kernels_measured_seconds_are_its_planned_graphs_timed_seconds():
    """Forward: conv_fprop's seconds; backward: conv_dgrad's and conv_wgrad's summed; None
    when one of them was not timed or went to the fallback (the cost model then rates it)."""
    from types import SimpleNamespace

    from snrt.backends.cudnn_graphs import CudnnConv2d

    layer, in_shapes = Conv2d(out_channels=8, kernel=3), [(4, 3, 8, 8)]
    kernels = SimpleNamespace(module=None, cudnn=SimpleNamespace(refusals={}, workspace_limit_bytes=1 << 20))
    kernel = CudnnConv2d(layer, in_shapes, kernels, GemmConv2d(layer, in_shapes, None))
    kernel._graphs = {(op, 1 << 20): SimpleNamespace(seconds=seconds, workspace_bytes=0)
                      for op, seconds in (("fprop", 1e-3), ("dgrad", 2e-3), ("wgrad", 3e-3))}
    assert kernel.measured_seconds(FORWARD) == 1e-3
    assert kernel.measured_seconds(BACKWARD) == pytest.approx(5e-3)
    kernel._graphs[("wgrad", 1 << 20)].seconds = None
    assert kernel.measured_seconds(BACKWARD) is None
    kernel._graphs[("fprop", 1 << 20)] = None  # cuDNN refused it: the GEMM fallback runs
    assert kernel.measured_seconds(FORWARD) is None


def test_a_missing_cudnn_library_is_one_error_saying_what_to_install(monkeypatch):
    pathfinder = pytest.importorskip("cuda.pathfinder")
    from snrt.backends.cudnn_graphs import import_cudnn

    def not_found(name):
        raise pathfinder.DynamicLibNotFoundError(f"Failure finding lib{name}.so")

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    with pytest.raises(SnrtError, match=r"cuDNN 9 \(libcudnn.so.9\) was not found: the gpu extras install it") as error:
        import_cudnn()
    assert "snrt[gpu-cuda13]" in str(error.value) and "LD_LIBRARY_PATH" in str(error.value)


def test_cublas_is_called_directly_with_the_headers_argument_counts():
    """KernelModule's GEMMs go to cuBLAS through ctypes (CuPy's wrappers refuse a capturing
    stream): each symbol is bound with the handle and as many arguments as cublas_api.h
    declares, returning its status; CuPy's module supplies the constants."""
    from types import SimpleNamespace

    library = SimpleNamespace(**{symbol: SimpleNamespace() for symbol, _ in cuda_source.DirectCublas.CALLS.values()})
    direct = cuda_source.DirectCublas(SimpleNamespace(CUBLAS_OP_T=1), library)
    arity = {"cublasSetStream_v2": 2, "cublasSetPointerMode_v2": 2, "cublasSgemmStridedBatched": 18,
             "cublasGemmStridedBatchedEx": 23}
    for symbol, count in arity.items():
        function = getattr(library, symbol)
        assert len(function.argtypes) == count and function.restype is ctypes.c_int, symbol
    longs = [i for i, t in enumerate(library.cublasGemmStridedBatchedEx.argtypes) if t is ctypes.c_longlong]
    assert longs == [10, 14, 19]  # strideA, strideB, strideC
    assert direct.CUBLAS_OP_T == 1 and callable(direct.sgemmStridedBatched)


def test_the_loaded_cublas_library_is_found_and_its_status_raised():
    """With CuPy's cuBLAS loaded (no GPU needed), the direct calls resolve in that library;
    a call on no handle returns CUBLAS_STATUS_NOT_INITIALIZED, raised naming the symbol."""
    pytest.importorskip("cupy")
    from cupy_backends.cuda.libs import cublas

    direct = cuda_source.DirectCublas(cublas, cuda_source.loaded_library("libcublas.so"))
    with pytest.raises(RuntimeError, match="cublasSetPointerMode_v2 failed with cuBLAS status 1"):
        direct.setPointerMode(0, cublas.CUBLAS_POINTER_MODE_HOST)
    with pytest.raises(OSError, match="no libsnrt-nothing"):
        cuda_source.loaded_library("libsnrt-nothing")


class _Stream:
    """A stand-in CUDA stream that logs what is asked of it; `forked` says whether a capture
    reached it."""

    def __init__(self, name, log, forked=False):
        self.name, self.log, self.forked, self.ptr = name, log, forked, hash(name) & 0xFFFF

    def begin_capture(self):
        self.log.append(f"{self.name} begin_capture")

    def end_capture(self):
        self.log.append(f"{self.name} end_capture")
        return f"graph of {self.name}"

    def is_capturing(self):
        return self.forked

    def wait_event(self, event):
        self.log.append(f"{self.name} waits")


@pytest.mark.parametrize("fails", [False, True], ids=["captured", "a-step-fails"])
def test_cupy_backend_captures_on_the_compute_stream_joins_the_copy_streams_and_launches_after_the_rows(
        monkeypatch, fails):
    """CupyBackend.capturing begins and ends the capture on the compute stream with the guard
    armed, joins each copy stream the capture reached, and ends the capture before passing a
    step's error on; replaying copies the rows to the device, then launches the graph, both
    on the compute stream."""
    cupy_backend = pytest.importorskip("snrt.backends.cupy_backend")
    import contextlib
    from types import SimpleNamespace

    log = []

    class Event:
        def __init__(self, disable_timing=False):
            pass

        def record(self, stream):
            log.append(f"record on {stream.name}")

        def synchronize(self):
            pass

    monkeypatch.setattr(cupy_backend.cupy.cuda, "Event", Event)
    monkeypatch.setattr(cupy_backend.runtime, "memcpyAsync",
                        lambda dst, src, n, kind, stream: log.append(f"copy {n} bytes on {stream}"))
    backend = object.__new__(cupy_backend.CupyBackend)
    backend.compute_stream = _Stream("compute", log)
    backend.to_host_stream, backend.to_device_stream = _Stream("d2h", log, forked=True), _Stream("h2d", log)

    @contextlib.contextmanager
    def armed(what):
        log.append(f"guard armed: {what}")
        try:
            yield
        finally:
            log.append("guard disarmed")

    backend.guard = SimpleNamespace(armed=armed)
    rows = object.__new__(cupy_backend.UpdateRows)
    rows.host = np.zeros((3, cupy_backend.UpdateRows.WIDTH), np.float32)
    rows.device = SimpleNamespace(data=SimpleNamespace(ptr=4096))
    rows.copied, rows.mode, rows.next = Event(), None, 0
    backend._rows = rows
    with contextlib.ExitStack() as stack:
        if fails:
            stack.enter_context(pytest.raises(RuntimeError, match="a step failed"))
        with backend.capturing(3) as captured:
            assert rows.mode == "capture"
            log.append("steps")
            if fails:
                raise RuntimeError("a step failed")
    assert rows.mode is None
    if fails:
        assert log == ["compute begin_capture", "guard armed: a step of a CUDA graph's capture", "steps",
                       "guard disarmed", "compute end_capture"]
        return
    assert log == ["compute begin_capture", "guard armed: a step of a CUDA graph's capture", "steps",
                   "record on d2h", "compute waits", "guard disarmed", "compute end_capture"]
    assert captured.graph == "graph of compute"
    captured.graph = SimpleNamespace(launch=lambda stream: log.append(f"launch on {stream.name}"))
    log.clear()
    with backend.replaying(captured):
        assert rows.mode == "replay" and rows.next == 0
    assert rows.mode is None
    assert log == [f"copy {rows.host.nbytes} bytes on {backend.compute_stream.ptr}", "record on compute",
                   "launch on compute"]
