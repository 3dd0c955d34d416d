"""The CPU backend's kernel choice: the layers' own NumPy code, except where a compiled kernel
measures faster (results/bench_layers.md).

BatchNorm in training, compiled with numba: one channel at a time, its statistics (forward)
or gradient sums (backward) and then its output, while the channel's values are still in
cache: two passes over the channel, one trip through memory, where the NumPy layer makes
five to eight passes with per-channel broadcasts whose inner loops are only H*W long. Sums
are float64 (statistics: sum(x) and sum(x*x), var = E[x^2] - mean^2). A tensor of at least
SPLIT_CHANNELWISE values has its channels split among the kernel threads. Dense convolution
runs by the direct kernel of cpu_conv.py where it serves, or by the layer's im2col where that
measured at least 10% faster for its shape and phase on this machine (cpu_choice.py).
Depthwise convolution (cpu_depthwise.py), GroupNorm and LayerNorm (cpu_norm.py), the
activations (cpu_activation.py), MaxPool and GlobalAvgPool (cpu_pool.py), AdaptiveAvgPool and
nearest Upsample (cpu_resample.py), the channel products of Mul and Scale (cpu_channel.py),
Add and Concat (cpu_join.py) and Dropout (cpu_dropout.py) have modules of their own, as has
Linear's forward for a few samples (cpu_linear.py, BLAS with the weight untransposed).

Determinism: a kernel on the kernel threads (cpu_parallel.run_split) gives each output value to
one thread; all are compiled with `reassoc` and `contract` only (cpu_common.COMPILED), so a sum
is vectorised in one order fixed by the compiled code: the same inputs give the same bits in
every run, every policy and on any number of threads (a recomputed BatchNorm reproduces the
stored output); NaN and inf propagate (check mode relies on it).

Kernels are "layer-like", as the CUDA ones are (snrt/backends/cuda_layers.py): the layer's
`forward`, `backward` and `workspace_bytes` signatures, everything else from the layer.
numba compiles a kernel on its first call for each dtype and caches the machine code beside
this file (`cache=True`): about 0.7 s the first time, under 0.3 s to load in a new process.
That cache is emptied where any compiled source changed (compiled_cache.py).
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_activation import CompiledActivation, CompiledSoftmax
from snrt.backends.cpu_channel import CompiledGateMul, CompiledScale
from snrt.backends.cpu_choice import setting
from snrt.backends.cpu_common import COMPILED, THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.backends.cpu_conv import ChosenConv2d
from snrt.backends.cpu_depthwise import CompiledDepthwiseConv2d
from snrt.backends.cpu_dropout import CompiledDropout
from snrt.backends.cpu_join import CompiledAdd, CompiledConcat
from snrt.backends.cpu_linear import TransposedLinear
from snrt.backends.cpu_pool import CompiledAvgPool, CompiledGlobalAvgPool, CompiledMaxPool
from snrt.backends.cpu_norm import CompiledGroupNorm, CompiledLayerNorm
from snrt.backends.cpu_resample import CompiledAdaptiveAvgPool, CompiledUpsample
from snrt.layers.base import FLOAT32_BYTES, LayerKernels, by_channel
from snrt.layers.fused import BatchNormReLU
from snrt.layers.norm import blend_running
from snrt.layers.staging import fp32_kernel_workspace_bytes

ZERO = np.float32(0.0)
SPLIT_CHANNELWISE = 1 << 17  # BatchNorm runs on one thread below this many values (2^16: split slower, 2^17 faster)

@njit(**COMPILED)
def channel_sums(a, b, c):
    """(sum of a[:, c, :], sum of a[:, c, :] * b[:, c, :]) in float64; a, b (N, C, K)."""
    total = 0.0
    products = 0.0
    for i in range(a.shape[0]):
        for j in range(a.shape[2]):
            v = np.float64(a[i, c, j])
            total += v
            products += v * b[i, c, j]
    return total, products


@njit(**COMPILED)
def relu_masked_sums(gy, x, a, b, c):
    """channel_sums(g, x, c) of g = gy * sign(max(x * a + b, 0)): ReLU's gradient at the output
    of a BatchNorm whose channel c has scale a and shift b, that output computed again."""
    total = 0.0
    products = 0.0
    for i in range(gy.shape[0]):
        for j in range(gy.shape[2]):
            v = x[i, c, j] * a + b
            v = np.float64(np.sign(ZERO if v <= ZERO else v) * gy[i, c, j])
            total += v
            products += v * x[i, c, j]
    return total, products


@njit(inline="always")
def scale_and_shift(weight, bias, mean, inv_std, c):
    """(weight * inv_std, bias - mean * scale) of channel c, in x's dtype: BatchNorm's y = x *
    scale + shift (empty weight and bias: weight 1, bias 0)."""
    scale = weight[c] * inv_std[c] if weight.size else inv_std[c]
    shift = (bias[c] if bias.size else 0.0) - mean[c] * scale
    return scale, shift


@njit(**THREADED)
def batchnorm_forward(x, weight, bias, eps, relu, y, mean, inv_std, var, scale_shift, c0, c1):
    """Per channel c in [c0, c1) of x (N, C, K): mean[c], biased var[c] (float64) and inv_std[c] over the
    N*K values, then y = x * scale + shift (scale_and_shift, kept in scale_shift (2, C), x's
    dtype), and with `relu` y = max(y, 0) (a NaN stays NaN)."""
    n, _, k = x.shape
    count = n * k
    for c in range(c0, c1):
        total, squares = channel_sums(x, x, c)
        mu = total / count
        var[c] = max(squares / count - mu * mu, 0.0)
        mean[c] = mu
        inv_std[c] = 1.0 / np.sqrt(var[c] + eps)
        scale_shift[0, c], scale_shift[1, c] = scale_and_shift(weight, bias, mean, inv_std, c)
        a, b = scale_shift[0, c], scale_shift[1, c]
        for i in range(n):
            for j in range(k):
                v = x[i, c, j] * a + b
                y[i, c, j] = ZERO if relu and v <= ZERO else v


@njit(**THREADED)
def batchnorm_backward(x, gy, weight, bias, relu, mean, inv_std, gweight, gbias, gx, coefficients, c0, c1):
    """Per channel c in [c0, c1): gbias = sum(gy), gweight = sum(gy * xhat) (float64 sums), then, unless
    gx has no samples, gx = a * gy + b * x + d with a = weight * inv_std, b = -a * inv_std *
    gweight / M, d = -b * mean - a * gbias / M (kept in coefficients (3, C), x's dtype).
    Empty weight, gweight and gbias: weight 1, the sums are not stored. With `relu` (a
    BatchNorm fused with ReLU), g = gy * sign(y), ReLU's gradient at the output y computed
    again from x as the forward computes it, stands for gy: written into gx's channel first
    (while it is in cache) and read as the unfused kernel reads gy, so the bits are those of
    ReLU's kernel and this one apart."""
    n, _, k = x.shape
    count = n * k
    for c in range(c0, c1):
        g = gy
        if relu:
            coefficients[0, c], coefficients[1, c] = scale_and_shift(weight, bias, mean, inv_std, c)
            scale, shift = coefficients[0, c], coefficients[1, c]  # the forward's, as it keeps them (x's dtype)
            if gx.shape[0]:
                for i in range(n):
                    for j in range(k):
                        v = x[i, c, j] * scale + shift
                        gx[i, c, j] = np.sign(ZERO if v <= ZERO else v) * gy[i, c, j]
                g = gx
                sum_gy, sum_gy_x = channel_sums(g, x, c)
            else:
                sum_gy, sum_gy_x = relu_masked_sums(gy, x, scale, shift, c)
        else:
            sum_gy, sum_gy_x = channel_sums(gy, x, c)
        mu, istd = np.float64(mean[c]), np.float64(inv_std[c])
        sum_gy_xhat = (sum_gy_x - mu * sum_gy) * istd
        if gweight.size:
            gweight[c] = sum_gy_xhat
            gbias[c] = sum_gy
        if gx.shape[0] == 0:
            continue
        a = weight[c] * istd if weight.size else istd
        b = -a * istd * sum_gy_xhat / count
        coefficients[0, c] = a
        coefficients[1, c] = b
        coefficients[2, c] = -b * mu - a * sum_gy / count
        ca, cb, cd = coefficients[0, c], coefficients[1, c], coefficients[2, c]
        for i in range(n):
            for j in range(k):
                gx[i, c, j] = ca * g[i, c, j] + cb * x[i, c, j] + cd


class CompiledBatchNorm(LayerLike):
    """BatchNorm's training steps by the kernels above; eval steps run the layer's own code.
    Same contract as snrt.layers.norm.BatchNorm: aux `mean` and `inv_std`, running statistics
    blended unless the forward is a recomputation. BatchNormReLU (snrt/layers/fused.py) too:
    the ReLU inside the same passes, no workspace."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not ctx.training:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self.layer.check_training([xs[0].shape])
        x3 = by_channel(xs[0])
        n, channels, k = x3.shape
        var = np.empty(channels, np.float64)
        none = np.empty(0, x3.dtype)  # no affine part: weight 1, bias 0
        run_split(batchnorm_forward, 0, channels, threads_for(x3.size, SPLIT_CHANNELWISE),
                  (x3, params.get("weight", none), params.get("bias", none), self.layer.eps,
                   isinstance(self.layer, BatchNormReLU), by_channel(y),
                   aux["mean"], aux["inv_std"], var, np.empty((2, channels), x3.dtype)))
        if not recompute:
            count = n * k
            blend_running(state["running_mean"], aux["mean"], self.layer.momentum)
            blend_running(state["running_var"], (var * (count / (count - 1))).astype(x3.dtype), self.layer.momentum)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if not ctx.training:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        x3 = by_channel(saved.xs[0])
        gx3 = by_channel(gxs[0]) if gxs[0] is not None else x3[:0]  # no samples: sums only
        none = np.empty(0, x3.dtype)  # no affine part: weight 1, no parameter gradients
        run_split(batchnorm_backward, 0, x3.shape[1], threads_for(x3.size, SPLIT_CHANNELWISE), (
            x3, by_channel(gy), params.get("weight", none), params.get("bias", none), isinstance(self.layer, BatchNormReLU),
            aux["mean"], aux["inv_std"], gparams.get("weight", none), gparams.get("bias", none), gx3,
            np.empty((3, x3.shape[1]), x3.dtype)))


class CpuKernels(LayerKernels):
    """The CPU's kernel of every layer: a compiled kernel where REGISTRY has one, else the layer."""

    REGISTRY = {  # type name: the kernels to ask, in turn
        "BatchNorm": (CompiledBatchNorm,), "BatchNormReLU": (CompiledBatchNorm,),
        "Conv2d": (CompiledDepthwiseConv2d, ChosenConv2d),
        "MaxPool": (CompiledMaxPool,), "AvgPool": (CompiledAvgPool,), "GlobalAvgPool": (CompiledGlobalAvgPool,),
        "GroupNorm": (CompiledGroupNorm,),
        "LayerNorm": (CompiledLayerNorm,), "AdaptiveAvgPool": (CompiledAdaptiveAvgPool,),
        "Upsample": (CompiledUpsample,), "Mul": (CompiledGateMul,), "Scale": (CompiledScale,),
        "Softmax": (CompiledSoftmax,), "Add": (CompiledAdd,), "AddReLU": (CompiledAdd,),
        "Concat": (CompiledConcat,), "Linear": (TransposedLinear,),
        "Dropout": (CompiledDropout,), "Dropout2d": (CompiledDropout,),
        **{name: (CompiledActivation,) for name in ("GELU", "SiLU", "Sigmoid", "ELU", "ReLU", "ReLU6")}}

    def kernel_for(self, layer, in_shapes):
        for kernel_class in self.REGISTRY.get(layer.type_name, ()):
            if kernel_class.serves(layer, in_shapes):
                return kernel_class(layer)
        return layer

    @staticmethod
    def settings():
        """SNRT_CPU_KERNELS as it is now: an iteration planned under another value sized the
        convolutions' workspace for other kernels (snrt/scheduler/session.py keeps one)."""
        return setting()

    def workspace_bytes(self, layer, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """The layer's fp32 workspace; with 2-byte tensors, after their fp32 staging (every
        CPU kernel computes in fp32, snrt/layers/staging.py)."""
        return fp32_kernel_workspace_bytes(self.kernel_for(layer, in_shapes), layer, in_shapes, phase, itemsize)

    def measured_seconds(self, layer, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """What a dense convolution's chosen kernel was measured to take (ChosenConv2d); None for
        every other layer, which the cost model's rates predict."""
        kernel = self.kernel_for(layer, in_shapes)
        return kernel.measured_seconds(in_shapes, phase, itemsize) if isinstance(kernel, ChosenConv2d) else None

    def update_workspace_bytes(self, param_bytes):
        """None: every update is one compiled pass (snrt/optim.py sgd_step, adam_step)."""
        return 0


CPU_KERNELS = CpuKernels()
