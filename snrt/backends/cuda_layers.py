"""CUDA kernels for the layers whose generic `xp` code allocates on CuPy.

Why these layers. The generic kernels in snrt/layers are written against `xp` and run on
CuPy unchanged, but some of them create temporaries that CuPy takes from its own memory
pool, outside the planned arena (see `NUMPY_ONLY` for the list and the reason per layer).
On CUDA those layers get a kernel here that uses only its buffers and the planned
workspace, so the backend's allocation guard (snrt/backends/cupy_backend.py) can refuse
every other allocation while kernels run. The other layers and the optimizer run their shared
`xp` code on CuPy: the CPU tests exercise the same logic, and tests/backends/test_xp_allocation.py
checks on the CPU that each such layer's forward and backward create no array outside their
buffers and workspace.

A kernel here is "layer-like": it has the layer's `forward`, `backward` and
`workspace_bytes` signatures and delegates everything else to the layer. `workspace_bytes`
says what each needs when the planner asks the backend (`CudaKernels.workspace_bytes`; CUDA
plans are made with it): nothing for Dropout, SoftmaxCrossEntropy, AvgPool, MaxPool and
Linear, BatchNorm's partial sums (2 floats per block of its training kernels), and for the
GEMM convolution one sample's column matrix, though it cuts that into bands of output rows
that fit whatever smaller workspace a step gives.

Some layers have a kernel here for speed alone: MaxPool (one pass each way where its xp code
makes four per window tap), ReLU's and Add's backwards, BatchNormReLU's backward (BatchNorm's
passes with the ReLU's mask inside, snrt/backends/cuda_kernels.py).

Everything is float32; a float64 plan runs the layers' own `xp` code. Dropout's mask, AvgPool
and MaxPool are bit-identical to the NumPy kernels (same integer hash, same summation order);
BatchNorm, the softmax and the GEMMs sum in a different order, so they agree to rounding.

The CUDA C they launch is in snrt/backends/cuda_source.py; cuDNN's convolution and
BatchNorm, with these kernels as their fallbacks, are in snrt/backends/cudnn_graphs.py; the
registry that picks a kernel per layer is snrt/backends/cuda_kernels.py.
"""

from dataclasses import dataclass

import numpy as np

from snrt.backends.cuda_source import NULL_POINTER, device_pointer, grid_for, int64_args
from snrt.errors import SnrtError
from snrt.layers.base import FLOAT32_BYTES, numel, scratch_bytes
from snrt.layers.random import stream_key

# Layers whose generic xp kernel allocates on CuPy, and what allocates (checked by reading
# snrt/layers/*.py; none uses np.lib.stride_tricks, ufunc.at or np-only functions).
NUMPY_ONLY = {
    "BatchNorm": "einsum (no out=, allocates its result and operands), (C,)-sized temporaries "
                 "(var, scale, sum_gy, c1) from arithmetic on arrays",
    "BatchNormReLU": "BatchNorm's (its first part)",
    "Conv2d": "matmul with out= a non-contiguous view (CuPy computes into a temporary and copies)",
    "ConvTranspose2d": "Conv2d's products (it runs the adjoint convolution's kernels)",
    "Linear": "matmul with a transposed operand may stage a contiguous copy",
    "SoftmaxCrossEntropy": "arange and fancy indexing (probs[rows, labels], gx[rows, labels] -= 1)",
    "Dropout": "arange of the whole tensor for the hash counters",
    "Dropout2d": "arange of the (N, C) mask's hash counters",
    "AvgPool": "the (Ho, Wo) divisor table from arange/minimum/maximum",
    "Upsample": "bilinear: matmul of a matrix and a 4-D tensor (CuPy's batched GEMM builds a device "
                "array of matrix pointers); nearest is slicing and allocates nothing",
}
# CuPy's CUB reductions take temporary storage from the memory pool; the backend turns the
# CUB accelerator off while it runs so the shared xp reductions (GlobalAvgPool) allocate
# nothing. Elementwise ufuncs with out=, slicing, fill and copyto allocate nothing.


class XpKernel:
    """The layer's own xp code (shared with the CPU backend)."""

    name = "xp"

    def __init__(self, layer, in_shapes, module=None):
        self.layer = layer

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.layer.workspace_bytes(in_shapes, phase, itemsize)

    def measured_seconds(self, phase):
        """Seconds `phase` was timed to take; None: not timed (the cost model's rates)."""
        return None

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)


class Float32Kernel(XpKernel):
    """Base of the CUDA kernels: float32 runs here, anything else on the layer's xp code."""

    def __init__(self, layer, in_shapes, module):
        super().__init__(layer, in_shapes)
        self.module = module

    def own_workspace_bytes(self, in_shapes, phase):
        return 0

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if itemsize != FLOAT32_BYTES:
            return self.layer.workspace_bytes(in_shapes, phase, itemsize)
        return self.own_workspace_bytes(in_shapes, phase)

    @staticmethod
    def is_float32(array):
        return array.dtype == np.float32


BATCHNORM_BLOCKS = 2048  # the training kernels' grid, about: channels times slices of samples


def batchnorm_slices(n, c, hw):
    """(slices, samples per slice) the BatchNorm training kernels cut each channel's n samples
    into: about BATCHNORM_BLOCKS blocks over the c channels, every slice holding at least one
    sample and fewer than 2^32 values (the kernels index a slice in 32 bits)."""
    if hw >= 1 << 32:
        raise SnrtError(f"BatchNorm over {hw} values per channel and sample: the CUDA kernels index fewer than 2^32")
    wanted = min(n, max(1, -(-BATCHNORM_BLOCKS // c)))
    per = min(-(-n // wanted), max(1, ((1 << 32) - 1) // hw))
    return -(-n // per), per


class CudaBatchNorm(Float32Kernel):
    """BatchNorm by snrt_bn_*; cuDNN's is in cudnn_graphs. In training each channel's samples
    are cut into slices (batchnorm_slices), a block per channel and slice, whose partial sums
    the next pass adds in order in the workspace: forward, the sums, the squared deviations,
    then the normalized output; backward, the sums of gy and gy * (x - mean), then gx. Without
    an affine part the weight, bias and their gradients go to the kernels as null pointers."""

    name = "cuda"

    def own_workspace_bytes(self, in_shapes, phase):
        """Two partial sums per block (none in eval, which this size does not know: reserved)."""
        n, c = in_shapes[0][:2]
        slices, _ = batchnorm_slices(n, c, numel(in_shapes[0][2:]))
        return scratch_bytes(2 * c * slices * FLOAT32_BYTES)

    def _grid(self, x):
        n, c = x.shape[:2]
        hw = numel(x.shape[2:])
        slices, _ = batchnorm_slices(n, c, hw)
        return c * slices, int64_args(n, c, hw, slices)

    def kernels_run(self, op):
        """True: these kernels run every operation (BatchNormReLU folds its ReLU into their
        forward where they run it; CudnnBatchNorm.kernels_run)."""
        return True

    def forward(self, ctx, xs, params, state, y, aux, recompute=False, relu=False):
        """BatchNorm's forward; with `relu` (float32 training only), BatchNormReLU's: max(y, 0)
        inside the normalizing pass."""
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        weight, bias = params.get("weight", NULL_POINTER), params.get("bias", NULL_POINTER)
        if not ctx.training:
            c, hw = x.shape[1], numel(x.shape[2:])
            self.module.launch("snrt_bn_forward_eval", grid_for(x.size), (
                x, y, weight, bias, state["running_mean"], state["running_var"], aux["mean"], aux["inv_std"],
                *int64_args(x.size, c, hw), np.float32(self.layer.eps)))
            return
        self.layer.check_training([x.shape])
        blocks, sizes = self._grid(x)
        sums, squares = ctx.scratch((2, blocks), np.float32)
        count = numel(x.shape) // x.shape[1]
        momentum = self.layer.momentum
        self.module.launch("snrt_bn_sums", blocks, (x, sums, *sizes))
        self.module.launch("snrt_bn_squares", blocks, (x, sums, squares, *sizes))
        self.module.launch("snrt_bn_normalize", blocks, (
            x, y, weight, bias, sums, squares, aux["mean"], aux["inv_std"], state["running_mean"], state["running_var"],
            *sizes, np.float32(self.layer.eps), np.float32(momentum), np.float32(1 - momentum),
            np.float32(count / (count - 1)), np.int32(0 if recompute else 1), np.int32(relu)))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams, relu=False):
        """BatchNorm's backward; with `relu`, BatchNormReLU's (float32 only): gy masked by the
        ReLU's gradient at the output computed again from x, inside the same two passes."""
        x = saved.xs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        gx = gxs[0]
        blocks, sizes = self._grid(x)
        sums, dots = ctx.scratch((2, blocks), np.float32)
        affine = (params.get("weight", NULL_POINTER), params.get("bias", NULL_POINTER), aux["mean"], aux["inv_std"])
        self.module.launch("snrt_bn_grad_sums", blocks, (x, gy, *affine, sums, dots, *sizes, np.int32(relu)))
        self.module.launch("snrt_bn_grad_input", blocks, (
            x, gy, *affine, sums, dots, NULL_POINTER if gx is None else gx, gparams.get("weight", NULL_POINTER),
            gparams.get("bias", NULL_POINTER), *sizes, np.int32(bool(ctx.training)), np.int32(relu)))
        ctx.release_scratch()


class CudaSoftmaxCrossEntropy(Float32Kernel):
    """Loss and softmax by snrt_xent_* (one block per row); labels int32 or int64. Per-pixel
    labels (logits (N, K, H, W)) have no CUDA kernel yet: refused when the kernel is chosen,
    before anything runs."""

    name = "cuda"

    def __init__(self, layer, in_shapes, module):
        if len(in_shapes[0]) != 2:
            raise SnrtError(f"SoftmaxCrossEntropy over {list(in_shapes[0][1:])} scores per sample (per-pixel labels) "
                            "has no CUDA kernel yet; train this network with --backend cpu")
        super().__init__(layer, in_shapes, module)

    @staticmethod
    def _suffix(labels):
        return {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}.get(np.dtype(labels.dtype))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        logits, labels = xs
        suffix = self._suffix(labels)
        if not self.is_float32(logits) or suffix is None:
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        n, k = logits.shape
        self.module.launch(f"snrt_xent_forward_{suffix}", n, (logits, labels, aux["probs"], y, *int64_args(n, k)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        labels, gx = saved.xs[1], gxs[0]
        suffix = self._suffix(labels)
        if gx is None:
            return
        if not self.is_float32(gx) or suffix is None:
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        n, k = gx.shape
        self.module.launch(f"snrt_xent_backward_{suffix}", grid_for(n * k),
                           (aux["probs"], labels, gy, gx, *int64_args(n, k)))


class CudaDropout(Float32Kernel):
    """Dropout and Dropout2d by snrt_dropout: the same mask as the NumPy kernels (per element,
    or per (sample, channel) for Dropout2d), without workspace."""

    name = "cuda"

    def _apply(self, ctx, source, target):
        p = self.layer.p
        threshold = self.layer.threshold
        key = stream_key(ctx.seed, ctx.iteration, ctx.node_index)
        self.module.launch("snrt_dropout", grid_for(target.size), (
            source, target, np.int64(target.size), np.int64(self.layer.mask_group(target.shape)), np.uint32(key),
            np.uint32(threshold), np.float32(1.0 / (1.0 - p))))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not self.is_float32(y) or not ctx.training or self.layer.p == 0:
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        self._apply(ctx, xs[0], y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None or not self.is_float32(gx) or not ctx.training or self.layer.p == 0:
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._apply(ctx, gy, gx)


class CudaReLU(Float32Kernel):
    """ReLU: the forward is the layer's (one xp kernel); the backward one snrt_relu_backward
    pass where the xp code makes two."""

    name = "cuda"

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None or not self.is_float32(gx):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self.module.launch("snrt_relu_backward", grid_for(gx.size), (saved.y, gy, gx, np.int64(gx.size)))


class CudaAdd(Float32Kernel):
    """Add: the forward is the layer's; the backward copies the output gradient to the input
    gradients two at a time (snrt_copy_to_two), reading it once per pair."""

    name = "cuda"

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        if not self.is_float32(gy):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        for first in range(0, len(targets), 2):
            pair = targets[first:first + 2]
            self.module.launch("snrt_copy_to_two", grid_for(gy.size),
                               (gy, pair[0], pair[1] if len(pair) == 2 else NULL_POINTER, np.int64(gy.size)))


class _WindowPoolKernel(Float32Kernel):
    """A pooling layer by two CUDA kernels, no workspace: `_forward` gathers each output's
    window, `_backward` each input element's outputs."""

    name = "cuda"

    def _geometry(self, x_shape, y_shape):
        """The kernels' size arguments: planes, input and output sizes, kernel, stride, padding."""
        layer = self.layer
        n, c, h, w = x_shape
        return int64_args(n * c, h, w, y_shape[2], y_shape[3], *layer.kernel, *layer.stride, *layer.padding)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        self._forward(x, y, aux)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        if not self.is_float32(gx):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._backward(gy, aux, gx)


class CudaAvgPool(_WindowPoolKernel):
    """AvgPool by snrt_avgpool_forward / _backward."""

    def _include_pad(self):
        return np.int32(bool(self.layer.count_include_pad))

    def _forward(self, x, y, aux):
        self.module.launch("snrt_avgpool_forward", grid_for(y.size),
                           (x, y, *self._geometry(x.shape, y.shape), self._include_pad()))

    def _backward(self, gy, aux, gx):
        self.module.launch("snrt_avgpool_backward", grid_for(gx.size),
                           (gy, gx, *self._geometry(gx.shape, gy.shape), self._include_pad()))


class CudaMaxPool(_WindowPoolKernel):
    """MaxPool by snrt_maxpool_forward / _backward (their uint8 or int32 instance, as the
    argmax indices are): the outputs, indices and gradients of the layer's xp code."""

    @staticmethod
    def _suffix(argmax):
        return "u8" if argmax.dtype == np.uint8 else "i32"

    def _forward(self, x, y, aux):
        argmax = aux["argmax"]
        self.module.launch(f"snrt_maxpool_forward_{self._suffix(argmax)}", grid_for(y.size),
                           (x, y, argmax, *self._geometry(x.shape, y.shape)))

    def _backward(self, gy, aux, gx):
        argmax = aux["argmax"]
        self.module.launch(f"snrt_maxpool_backward_{self._suffix(argmax)}", grid_for(gx.size),
                           (gy, argmax, gx, *self._geometry(gx.shape, gy.shape)))


class CublasLinear(Float32Kernel):
    """Linear by cuBLAS SGEMM on the given buffers: y = x W^T + b, gx = gy W, gW = gy^T x."""

    name = "cublas"

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        n, o = y.shape
        i = x.size // n
        self.module.gemm(False, True, n, o, i, device_pointer(x), i, device_pointer(params["weight"]), i,
                         device_pointer(y), o)
        if self.layer.bias:
            self.module.launch("snrt_bias_add", grid_for(y.size), (y, params["bias"], *int64_args(y.size, o, 1)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        n, o = gy.shape
        i = x.size // n
        if gxs[0] is not None:
            self.module.gemm(False, False, n, i, o, device_pointer(gy), o, device_pointer(params["weight"]), i,
                             device_pointer(gxs[0]), i)
        self.module.gemm(True, False, o, i, n, device_pointer(gy), o, device_pointer(x), i,
                         device_pointer(gparams["weight"]), i)
        if self.layer.bias:
            self.module.launch("snrt_channel_sum", o, (gy, gparams["bias"], *int64_args(n, o, 1)))


class CudaUpsample(Float32Kernel):
    """Bilinear Upsample by cuBLAS on the layer's own workspace: y[b] = Ah x[b] for every
    (n, c) map b as one strided-batched GEMM whose Ah has stride 0, then y = middle Aw^T as one
    GEMM over all (N C sH) rows; backward the transposes (gx = Ah^T gy Aw). The (sH, H) and
    (sW, W) weight matrices and the middle tensor are the workspace the layer plans."""

    name = "cublas"

    def own_workspace_bytes(self, in_shapes, phase):
        return self.layer.workspace_bytes(in_shapes, phase)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        self._resample(ctx, x, y, x.shape, adjoint=False)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None or not self.is_float32(gx):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._resample(ctx, gy, gx, gx.shape, adjoint=True)

    def _resample(self, ctx, source, target, in_shape, adjoint):
        """target = Ah source Aw^T per map, or Ah^T source Aw when `adjoint`; `in_shape` is the
        layer's input shape (N, C, H, W), which sizes Ah (sH, H) and Aw (sW, W)."""
        (n, c, hs, ws), (ht, wt) = source.shape, target.shape[2:]
        rows, cols = self.layer.weight_matrices(ctx, in_shape, source.dtype)
        middle = ctx.scratch((n, c, ht, ws), source.dtype)
        self.module.gemm(adjoint, False, ht, ws, hs, device_pointer(rows), in_shape[2], device_pointer(source), ws,
                         device_pointer(middle), ws, batch=n * c, stride_a=0, stride_b=hs * ws, stride_c=ht * ws)
        self.module.gemm(False, not adjoint, n * c * ht, wt, ws, device_pointer(middle), ws, device_pointer(cols),
                         in_shape[3], device_pointer(target), wt)
        ctx.release_scratch()


GEMM_WORKSPACE_CAP_BYTES = 64 << 20  # the GEMM convolution's preferred column band, at most


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one convolution, from the layer and its input shape."""

    n: int
    c: int
    h: int
    w: int
    o: int
    ho: int
    wo: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    groups: int

    @staticmethod
    def of(layer, in_shapes):
        n, c, h, w = in_shapes[0]
        _, o, ho, wo = layer.infer_shape(in_shapes)
        return ConvGeometry(n, c, h, w, o, ho, wo, *layer.kernel, *layer.stride, *layer.padding,
                            *layer.dilation, layer.groups)

    @property
    def pointwise(self):
        return (self.kh, self.kw, self.sh, self.sw, self.ph, self.pw, self.dh, self.dw) == (1, 1, 1, 1, 0, 0, 1, 1)

    @property
    def col_rows(self):
        return self.c * self.kh * self.kw

    def band_rows(self, workspace_bytes):
        """Output rows per band whose column matrix fits `workspace_bytes` (all of them on
        the 1x1 path, which reads x in place)."""
        if self.pointwise:
            return self.ho
        return min(self.ho, workspace_bytes // (self.col_rows * self.wo * FLOAT32_BYTES))

    def preferred_workspace_bytes(self):
        """One sample's column matrix, capped at GEMM_WORKSPACE_CAP_BYTES in whole rows (at
        least one row, even when a row is larger)."""
        if self.pointwise:
            return 0
        row = self.col_rows * self.wo * FLOAT32_BYTES
        return min(self.ho, max(1, GEMM_WORKSPACE_CAP_BYTES // row)) * row

    def bands(self, workspace_bytes):
        rows = self.band_rows(workspace_bytes)
        if rows < 1:
            need = self.col_rows * self.wo * FLOAT32_BYTES
            raise RuntimeError(f"the GEMM convolution needs at least {need} workspace bytes (one output row "
                               f"of the column matrix), the plan gave {workspace_bytes}")
        return [(r0, min(rows, self.ho - r0)) for r0 in range(0, self.ho, rows)]

    def input_rows(self, r0, rows):
        """[in0, in0 + count) of input rows a band of output rows [r0, r0 + rows) reads."""
        lo = max(0, r0 * self.sh - self.ph)
        hi = min(self.h, (r0 + rows - 1) * self.sh - self.ph + (self.kh - 1) * self.dh + 1)
        return lo, max(0, hi - lo)


class GemmConv2d(Float32Kernel):
    """Convolution by im2col + cuBLAS SGEMM, sample by sample in bands of output rows that
    fit the step's workspace (the fallback where cuDNN refuses a shape).

    Forward, per sample n, band, group g:  y[n, g][:, band] = W[g] @ col[g]  (written in place,
    ldc = Ho*Wo), then + b. Backward: gb = channel sums of gy; gW[g] += gy[n, g][:, band] @
    col[g]^T (beta 1 after the first band); gcol[g] = W[g]^T @ gy[n, g][:, band] over col, then
    col2im adds it into gx[n] (zeroed first). The 1x1 path reads x[n] / writes gx[n] directly.
    """

    name = "gemm"

    def own_workspace_bytes(self, in_shapes, phase):
        return ConvGeometry.of(self.layer, in_shapes).preferred_workspace_bytes()

    def _workspace(self, ctx, g):
        """(band list, column buffer or None) from the step's workspace."""
        capacity = 0 if ctx.workspace is None else ctx.workspace.nbytes
        bands = g.bands(capacity)
        if g.pointwise:
            return bands, None
        rows = max(rows for _, rows in bands)
        return bands, ctx.scratch((g.col_rows * rows * g.wo,), np.float32)

    def _im2col(self, g, x_ptr, col, r0, rows):
        self.module.launch("snrt_im2col", grid_for(g.col_rows * rows * g.wo), (
            np.uint64(x_ptr), col,
            *int64_args(g.c, g.h, g.w, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, r0, rows)))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        g = ConvGeometry.of(self.layer, [x.shape])
        bands, col = self._workspace(ctx, g)
        og, cg = g.o // g.groups, g.c // g.groups
        kk, plane = g.kh * g.kw, g.ho * g.wo
        w_ptr, f = device_pointer(params["weight"]), FLOAT32_BYTES
        for n in range(g.n):
            x_n, y_n = device_pointer(x) + n * g.c * g.h * g.w * f, device_pointer(y) + n * g.o * plane * f
            for r0, rows in bands:
                columns = rows * g.wo
                if col is not None:
                    self._im2col(g, x_n, col, r0, rows)
                for k in range(g.groups):
                    if col is None:  # 1x1: x[n, group] (Cg, H*W) is the column matrix
                        b, ldb = x_n + (k * cg * plane + r0 * g.wo) * f, plane
                    else:
                        b, ldb = device_pointer(col) + k * cg * kk * columns * f, columns
                    self.module.gemm(False, False, og, columns, cg * kk, w_ptr + k * og * cg * kk * f, cg * kk,
                                     b, ldb, y_n + (k * og * plane + r0 * g.wo) * f, plane)
        if self.layer.bias:
            self.module.launch("snrt_bias_add", grid_for(y.size), (y, params["bias"], *int64_args(y.size, g.o, plane)))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self.backward_parts(ctx, gy, x, gxs[0], params, gparams)

    def backward_parts(self, ctx, gy, x, gx, params, gparams, weight_grad=True, bias_grad=True):
        """The gradients asked for: gW when `weight_grad`, gb when `bias_grad` (and the layer
        has a bias), gx when `gx` is not None (cuDNN serves the rest)."""
        g = ConvGeometry.of(self.layer, [x.shape])
        og, cg = g.o // g.groups, g.c // g.groups
        kk, plane, f = g.kh * g.kw, g.ho * g.wo, FLOAT32_BYTES
        if bias_grad and self.layer.bias:
            self.module.launch("snrt_channel_sum", g.o, (gy, gparams["bias"], *int64_args(g.n, g.o, plane)))
        if not weight_grad and gx is None:
            return
        bands, col = self._workspace(ctx, g)
        if gx is not None and col is not None:
            gx.fill(0)
        w_ptr = device_pointer(params["weight"])
        gw_ptr = device_pointer(gparams["weight"]) if weight_grad else None
        first = True
        for n in range(g.n):
            x_n, gy_n = device_pointer(x) + n * g.c * g.h * g.w * f, device_pointer(gy) + n * g.o * plane * f
            for r0, rows in bands:
                columns = rows * g.wo
                if col is not None and weight_grad:  # gx alone overwrites col with the column gradient
                    self._im2col(g, x_n, col, r0, rows)
                for k in range(g.groups):
                    gy_band = gy_n + (k * og * plane + r0 * g.wo) * f
                    if col is None:
                        b, ldb = x_n + (k * cg * plane + r0 * g.wo) * f, plane
                    else:
                        b, ldb = device_pointer(col) + k * cg * kk * columns * f, columns
                    if weight_grad:
                        self.module.gemm(False, True, og, cg * kk, columns, gy_band, plane, b, ldb,
                                         gw_ptr + k * og * cg * kk * f, cg * kk, accumulate=not first)
                    if gx is None:
                        continue
                    target, ldc = b, ldb  # gcol over col; the 1x1 path writes gx[n] where x[n] is
                    if col is None:
                        target = device_pointer(gx) + n * g.c * g.h * g.w * f + (k * cg * plane + r0 * g.wo) * f
                    self.module.gemm(True, False, cg * kk, columns, og, w_ptr + k * og * cg * kk * f, cg * kk,
                                     gy_band, plane, target, ldc)
                first = False
                if gx is not None and col is not None:
                    in0, in_rows = g.input_rows(r0, rows)
                    gx_n = device_pointer(gx) + n * g.c * g.h * g.w * f
                    self.module.launch("snrt_col2im_add", grid_for(g.c * in_rows * g.w), (
                        col, np.uint64(gx_n), *int64_args(g.c, g.h, g.w, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
                                                     g.dh, g.dw, r0, rows, in0, in_rows)))
        ctx.release_scratch()


class CudaConvTranspose2d(Float32Kernel):
    """ConvTranspose2d by the GEMM convolution of its adjoint Conv2d (ConvTranspose2d.adjoint_conv):
    forward is the adjoint's input gradient of x (gcol = W^T x, col2im into y), then + b;
    backward is the adjoint's forward of gy (gx) and its weight gradient with gy as the input
    and x as the output gradient, gb the channel sums of gy. Bands of rows fit the workspace
    as the convolution's do."""

    name = "gemm"

    def __init__(self, layer, in_shapes, module):
        super().__init__(layer, in_shapes, module)
        conv, self.y_shape = layer.adjoint_conv(in_shapes)
        self.conv = GemmConv2d(conv, [self.y_shape], module)

    def own_workspace_bytes(self, in_shapes, phase):
        return self.conv.own_workspace_bytes([self.y_shape], phase)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        # the adjoint's input `x` is only a shape here: without its weight gradient it is not read
        self.conv.backward_parts(ctx, x, y, y, params, {}, weight_grad=False, bias_grad=False)
        if self.layer.bias:
            self.module.launch("snrt_bias_add", grid_for(y.size), (
                y, params["bias"], *int64_args(y.size, y.shape[1], numel(y.shape[2:]))))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, gx = saved.xs[0], gxs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        if self.layer.bias:
            self.module.launch("snrt_channel_sum", gy.shape[1], (
                gy, gparams["bias"], *int64_args(gy.shape[0], gy.shape[1], numel(gy.shape[2:]))))
        if gx is not None:
            self.conv.forward(ctx, [gy], {"weight": params["weight"]}, None, gx, None)
        self.conv.backward_parts(ctx, x, gy, None, params, gparams, weight_grad=True, bias_grad=False)


__all__ = ["GEMM_WORKSPACE_CAP_BYTES", "NUMPY_ONLY", "ConvGeometry", "CublasLinear", "CudaAvgPool", "CudaBatchNorm",
           "CudaConvTranspose2d", "CudaDropout", "CudaSoftmaxCrossEntropy", "CudaUpsample", "Float32Kernel", "GemmConv2d",
           "XpKernel"]
