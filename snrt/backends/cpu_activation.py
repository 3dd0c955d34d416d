"""GELU and SiLU on the CPU: compiled kernels with an exponential that vectorizes.

The layers' NumPy code (snrt/layers/activation.py) makes six to twenty passes over the tensor
and a scratch tensor. These kernels go over it once, a block of BLOCK values at a time: a
first loop takes the one exponential each activation needs, a second finishes the value.
numba would call the C library's expf one value at a time (about 5 ns each, slower than
NumPy's SIMD exp), so the exponential is written out: exp(v) = 2^n e^r with n = round(v /
ln 2) and |r| <= ln 2 / 2, e^r by its Taylor polynomial of degree 7 (relative error under 2e-7
in float32), 2^n the bits (n + 127) << 23 of a float32, built in an int32 block. Arguments are
clamped to [EXP_LOW, EXP_HIGH] (where the true value is a denormal, 0 or beyond float32, this
gives about 1e-38 or 1.6e38); a NaN or infinite input gives NaN (where PyTorch gives inf for
+inf: a run with infinite activations has diverged either way).

GELU's exact form takes erf from the same formula as the layer (Abramowitz and Stegun 7.1.26,
absolute error under 1.5e-7), whose exponential exp(-x^2 / 2) is also sqrt(2 pi) Phi'(x); its
tanh form and SiLU's sigmoid are 1 / (1 + exp(-t)). Backward recomputes what it needs from
the input, as the layers do: gx = gy (Phi + x Phi') for GELU, gy s (1 + x (1 - s)) for SiLU.
The kernels' workspace is the two blocks. float32 only; other dtypes run the layer's code.
"""

import math

import numpy as np
from numba import njit

from snrt.backends.cpu_common import COMPILED, LayerLike
from snrt.layers.activation import ERF_A, ERF_P, TANH_GELU_C, TANH_GELU_K
from snrt.layers.base import FLOAT32_BYTES, scratch_bytes

BLOCK = 1024  # values per block
F = np.float32  # every constant below is float32, so that no value is widened
EXP_LOW, EXP_HIGH = F(-87.0), F(88.0)  # exp of either is a normal float32
LOG2E, LN2_HI, LN2_LO = F(1 / math.log(2)), F(0.693145751953125), F(1.4286068203094173e-06)
TAYLOR = tuple(F(1 / math.factorial(k)) for k in range(2, 8))
ONE, HALF = F(1.0), F(0.5)
ERF_P32, ERF_A32 = F(ERF_P), tuple(F(a) for a in ERF_A)
INV_SQRT_2, INV_SQRT_2PI = F(1 / math.sqrt(2)), F(1 / math.sqrt(2 * math.pi))
TANH_2C, TANH_K, TANH_3K = F(2 * TANH_GELU_C), F(TANH_GELU_K), F(3 * TANH_GELU_K)
GELU_EXACT, GELU_TANH, SILU = 0, 1, 2  # the activations, by what their exponential's argument is


@njit(inline="always")
def _exponent(kind, v):
    """The argument of the one exponential `kind` takes of its input v."""
    if kind == GELU_EXACT:
        return -HALF * v * v  # exp(-z^2), z = v / sqrt 2
    if kind == GELU_TANH:
        return -TANH_2C * v * (ONE + TANH_K * v * v)  # (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u))
    return -v  # the sigmoid


@njit(inline="always")
def _exp_parts(t):
    """(e^r, n + 128) of exp(t) = 2^n e^r, t clamped to [EXP_LOW, EXP_HIGH]."""
    c = t if t > EXP_LOW else EXP_LOW
    c = c if c < EXP_HIGH else EXP_HIGH
    k = np.int32(c * LOG2E + F(128.5))  # truncating a positive number: the floor
    n = F(k) - F(128.0)
    r = c - n * LN2_HI - n * LN2_LO
    a2, a3, a4, a5, a6, a7 = TAYLOR
    return ONE + r * (ONE + r * (a2 + r * (a3 + r * (a4 + r * (a5 + r * (a6 + r * a7)))))), k


@njit(inline="always")
def _cdf(kind, v, e):
    """Phi(v) (the sigmoid for SiLU) given e = exp(_exponent(kind, v))."""
    if kind == GELU_EXACT:
        t = ONE / (ONE + ERF_P32 * abs(v * INV_SQRT_2))
        a1, a2, a3, a4, a5 = ERF_A32
        erf = ONE - t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5)))) * e
        return HALF + HALF * (erf if v >= 0 else -erf)
    return ONE / (ONE + e)


@njit(inline="always")
def _exponentials(kind, x, mantissas, powers, count):
    """mantissas[:count] and powers[:count] (int32 bits of 2^n) of exp(_exponent(kind, x))."""
    for i in range(count):
        t = _exponent(kind, x[i])
        mantissa, k = _exp_parts(t)
        mantissas[i] = mantissa + (t - t)  # NaN and infinite arguments give NaN
        powers[i] = (k - np.int32(1)) << np.int32(23)


@njit(**COMPILED)
def activation_forward(kind, x, y, mantissas, powers):
    """y = x * cdf(x) over flat x, a block at a time."""
    scales = powers.view(np.float32)
    for start in range(0, x.size, BLOCK):
        count = min(BLOCK, x.size - start)
        xs, ys = x[start:start + count], y[start:start + count]
        _exponentials(kind, xs, mantissas, powers, count)
        for i in range(count):
            v = xs[i]
            ys[i] = v * _cdf(kind, v, mantissas[i] * scales[i])


@njit(**COMPILED)
def activation_backward(kind, x, gy, gx, mantissas, powers):
    """gx = gy * d(x cdf(x))/dx over flat x, a block at a time."""
    scales = powers.view(np.float32)
    for start in range(0, x.size, BLOCK):
        count = min(BLOCK, x.size - start)
        xs, gys, gxs = x[start:start + count], gy[start:start + count], gx[start:start + count]
        _exponentials(kind, xs, mantissas, powers, count)
        for i in range(count):
            v, e = xs[i], mantissas[i] * scales[i]
            cdf = _cdf(kind, v, e)
            if kind == GELU_EXACT:
                slope = cdf + v * INV_SQRT_2PI * e
            elif kind == GELU_TANH:  # Phi + x Phi', as 1 - tanh^2 = 4 Phi (1 - Phi)
                slope = cdf + F(2.0) * cdf * (ONE - cdf) * v * TANH_2C * HALF * (ONE + TANH_3K * v * v)
            else:
                slope = cdf * (ONE + v * (ONE - cdf))
            gxs[i] = gys[i] * slope


class CompiledActivation(LayerLike):
    """GELU (either form) or SiLU by the kernels above."""

    def _kind(self):
        if self.layer.type_name == "SiLU":
            return SILU
        return GELU_TANH if self.layer.approximate == "tanh" else GELU_EXACT

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if itemsize != FLOAT32_BYTES:
            return self.layer.workspace_bytes(in_shapes, phase, itemsize)
        return scratch_bytes(BLOCK * FLOAT32_BYTES, BLOCK * FLOAT32_BYTES)

    def _blocks(self, ctx):
        return ctx.scratch((BLOCK,), np.float32), ctx.scratch((BLOCK,), np.int32)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if xs[0].dtype != np.float32:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        activation_forward(self._kind(), xs[0].reshape(-1), y.reshape(-1), *self._blocks(ctx))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if gxs[0] is None:
            return
        if x.dtype != np.float32:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        activation_backward(self._kind(), x.reshape(-1), gy.reshape(-1), gxs[0].reshape(-1), *self._blocks(ctx))
        ctx.release_scratch()
