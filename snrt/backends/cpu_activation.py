"""Activations on the CPU: compiled kernels, with an exponential that vectorizes.

The layers' NumPy code (snrt/layers/activation.py) makes two to twenty passes over the tensor
and a scratch tensor. These kernels go over it once (Softmax, which reduces along an axis: three
times forward, twice backward; CompiledSoftmax). GELU (both forms), SiLU, Sigmoid and ELU
take one exponential per value, in the same loop that finishes the value. numba would call the
C library's expf one value at a time (about 5 ns each, slower than NumPy's SIMD exp), so the
exponential is written out: exp(v) = 2^n e^r with n = round(v / ln 2) and |r| <= ln 2 / 2,
e^r - 1 by its Taylor polynomial of degree 7 (relative error under 2e-7 in float32), 2^n the
float32 of bits (n + 127) << 23 (a bit cast, `float_from_bits`, which vectorizes). ELU's
exp(v) - 1 is 2^n (e^r - 1) + (2^n - 1), accurate near 0 where exp(v) - 1 would cancel.
Arguments are clamped to [EXP_LOW, EXP_HIGH] (where the true value is a denormal, 0 or beyond
float32, this gives about 1e-38 or 1.6e38; an infinite argument is clamped too); a NaN input
gives NaN.

GELU's exact form takes erf from the same formula as the layer (Abramowitz and Stegun 7.1.26,
absolute error under 1.5e-7), whose exponential exp(-x^2 / 2) is also sqrt(2 pi) Phi'(x); its
tanh form, SiLU's and Sigmoid's sigmoid are 1 / (1 + exp(-t)). GELU's and SiLU's backward
recompute what they need from the input, as the layers do: gx = gy (Phi + x Phi') for GELU,
gy s (1 + x (1 - s)) for SiLU. ReLU, ReLU6, Sigmoid and ELU read their output: gx = gy
sign(y), gy [0 < y < 6], gy (1 - y) y and gy (y > 0 ? 1 : y + alpha), in one pass (a NaN in
y gives NaN). ReLU's and ReLU6's forwards are one pass of comparisons that keep a NaN.

Each activation's kernels are compiled for it alone (EXPONENTIAL_FORWARD and the other tables
by kind): a loop that tests the kind of activation at run time did not vectorize as a whole.
The kernels run on the kernel threads (cpu_parallel.run_split), each thread a share of the flat
tensor: the exponential's from SPLIT_VALUES values, the one-pass kernels, bound by memory, from
SPLIT_PASS_VALUES; none takes workspace but Softmax (its blocks of partial results). float32
only; other dtypes run the layer's code.
"""

import math

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, fitting_threads, float_from_bits, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.activation import ERF_A, ERF_P, TANH_GELU_C, TANH_GELU_K
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, numel, scratch_bytes
from snrt.threads import kernel_threads

BLOCK = 1024  # values of a Softmax work item
SPLIT_VALUES = 1 << 17  # an exponential's tensor of fewer values runs on one thread
SPLIT_PASS_VALUES = 1 << 17  # the same for the one-pass kernels, bound by memory (2^16 ReLU values: 2-3x slower split)
F = np.float32  # every constant below is float32, so that no value is widened
EXP_LOW, EXP_HIGH = F(-87.0), F(88.0)  # exp of either is a normal float32
LOG2E, LN2_HI, LN2_LO = F(1 / math.log(2)), F(0.693145751953125), F(1.4286068203094173e-06)
TAYLOR = tuple(F(1 / math.factorial(k)) for k in range(2, 8))
ZERO, ONE, HALF, SIX = F(0.0), F(1.0), F(0.5), F(6.0)
ERF_P32, ERF_A32 = F(ERF_P), tuple(F(a) for a in ERF_A)
INV_SQRT_2, INV_SQRT_2PI = F(1 / math.sqrt(2)), F(1 / math.sqrt(2 * math.pi))
TANH_2C, TANH_K, TANH_3K = F(2 * TANH_GELU_C), F(TANH_GELU_K), F(3 * TANH_GELU_K)
# the activations: the first four by what their exponential's argument is; the last two take none
GELU_EXACT, GELU_TANH, SILU, SIGMOID, ELU, RELU, RELU6 = range(7)
KINDS = {"SiLU": SILU, "Sigmoid": SIGMOID, "ELU": ELU, "ReLU": RELU, "ReLU6": RELU6}
READS_OUTPUT = (SIGMOID, ELU, RELU, RELU6)  # backward from y; GELU's and SiLU's from x


@njit(inline="always")
def _exponent(kind, v):
    """The argument of the one exponential `kind` takes of its input v."""
    if kind == GELU_EXACT:
        return -HALF * v * v  # exp(-z^2), z = v / sqrt 2
    if kind == GELU_TANH:
        return -TANH_2C * v * (ONE + TANH_K * v * v)  # (1 + tanh(u)) / 2 = 1 / (1 + exp(-2u))
    if kind == ELU:
        return v
    return -v  # the sigmoid


@njit(inline="always")
def _exp_parts(t):
    """(e^r - 1, 2^n) of exp(t) = 2^n e^r, t clamped to [EXP_LOW, EXP_HIGH] (by min and max,
    which keep a NaN: e^r - 1 is then NaN)."""
    c = min(max(t, EXP_LOW), EXP_HIGH)
    k = np.int32(c * LOG2E + F(128.5))  # truncating a positive number: the floor
    n = F(k) - F(128.0)
    r = c - n * LN2_HI - n * LN2_LO
    a2, a3, a4, a5, a6, a7 = TAYLOR
    less_one = r * (ONE + r * (a2 + r * (a3 + r * (a4 + r * (a5 + r * (a6 + r * a7))))))
    return less_one, float_from_bits((k - np.int32(1)) << np.int32(23))


@njit(inline="always")
def _cdf(kind, v, e):
    """Phi(v) (the sigmoid for SiLU and Sigmoid) given e = exp(_exponent(kind, v))."""
    if kind == GELU_EXACT:
        t = ONE / (ONE + ERF_P32 * abs(v * INV_SQRT_2))
        a1, a2, a3, a4, a5 = ERF_A32
        erf = ONE - t * (a1 + t * (a2 + t * (a3 + t * (a4 + t * a5)))) * e
        return HALF + HALF * (erf if v >= 0 else -erf)
    return ONE / (ONE + e)


def _exponential_forward(kind):
    """forward(alpha, x, y, r0, r1): y[r0:r1] = the activation `kind` of x[r0:r1] (flat),
    compiled for that kind alone (a loop that tests the kind at run time does not vectorize)."""

    @njit(**THREADED)
    def forward(alpha, x, y, r0, r1):
        xs, ys = x[r0:r1], y[r0:r1]  # slices: a loop from 0 vectorizes
        for i in range(xs.size):
            v = xs[i]
            less_one, scale = _exp_parts(_exponent(kind, v))
            if kind == ELU:  # alpha (exp(v) - 1) = alpha (2^n (e^r - 1) + 2^n - 1)
                ys[i] = v if v > ZERO else alpha * (less_one * scale + (scale - ONE))
            elif kind == SIGMOID:
                ys[i] = _cdf(kind, v, (ONE + less_one) * scale)
            else:
                ys[i] = v * _cdf(kind, v, (ONE + less_one) * scale)

    return forward


def _exponential_backward(kind):
    """backward(x, gy, gx, r0, r1): gx[r0:r1] = gy * d(x cdf(x))/dx over flat x[r0:r1], for
    GELU (either form) or SiLU, compiled for `kind` alone."""

    @njit(**THREADED)
    def backward(x, gy, gx, r0, r1):
        xs, gys, gxs = x[r0:r1], gy[r0:r1], gx[r0:r1]
        for i in range(xs.size):
            v = xs[i]
            less_one, scale = _exp_parts(_exponent(kind, v))
            e = (ONE + less_one) * scale
            cdf = _cdf(kind, v, e)
            if kind == GELU_EXACT:
                slope = cdf + v * INV_SQRT_2PI * e
            elif kind == GELU_TANH:  # Phi + x Phi', as 1 - tanh^2 = 4 Phi (1 - Phi)
                slope = cdf + F(2.0) * cdf * (ONE - cdf) * v * TANH_2C * HALF * (ONE + TANH_3K * v * v)
            else:
                slope = cdf * (ONE + v * (ONE - cdf))
            gxs[i] = gys[i] * slope

    return backward


EXPONENTIAL_FORWARD = {kind: _exponential_forward(kind) for kind in (GELU_EXACT, GELU_TANH, SILU, SIGMOID, ELU)}
EXPONENTIAL_BACKWARD = {kind: _exponential_backward(kind) for kind in (GELU_EXACT, GELU_TANH, SILU)}


def _clip_forward(kind):
    """forward(x, y, r0, r1): y = max(x, 0) (ReLU) or min(max(x, 0), 6) (ReLU6) over flat
    x[r0:r1], compiled for `kind`; a NaN stays NaN."""

    @njit(**THREADED)
    def forward(x, y, r0, r1):
        xs, ys = x[r0:r1], y[r0:r1]
        for i in range(xs.size):
            v = xs[i]
            v = ZERO if v <= ZERO else v
            ys[i] = SIX if kind == RELU6 and v >= SIX else v

    return forward


def _output_backward(kind):
    """backward(alpha, y, gy, gx, r0, r1): gx = gy * dy/dx as a function of the output y, over
    flat arrays' [r0, r1), compiled for `kind` (READS_OUTPUT)."""

    @njit(**THREADED)
    def backward(alpha, y, gy, gx, r0, r1):
        ys, gys, gxs = y[r0:r1], gy[r0:r1], gx[r0:r1]
        for i in range(ys.size):
            v = ys[i]
            if kind == RELU:
                gxs[i] = np.sign(v) * gys[i]  # y >= 0: the 0/1 mask, and a NaN in y stays visible
            elif kind == RELU6:
                gxs[i] = gys[i] * (ONE if ZERO < v < SIX else ZERO * v)  # 0 * NaN: a NaN in y stays visible
            elif kind == SIGMOID:
                gxs[i] = (ONE - v) * v * gys[i]
            else:
                gxs[i] = gys[i] if v > ZERO else gys[i] * (v + alpha)

    return backward


CLIP_FORWARD = {kind: _clip_forward(kind) for kind in (RELU, RELU6)}
OUTPUT_BACKWARD = {kind: _output_backward(kind) for kind in READS_OUTPUT}


class CompiledActivation(LayerLike):
    """GELU (either form), SiLU, Sigmoid, ELU, ReLU and ReLU6 by the kernels above."""

    def _kind(self):
        if self.layer.type_name == "GELU":
            return GELU_TANH if self.layer.approximate == "tanh" else GELU_EXACT
        return KINDS[self.layer.type_name]

    def _alpha(self):
        return F(getattr(self.layer, "alpha", 0.0))

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0 if itemsize == FLOAT32_BYTES else self.layer.workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if x.dtype != np.float32:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        kind = self._kind()
        if kind in (RELU, RELU6):
            run_split(CLIP_FORWARD[kind], 0, x.size, threads_for(x.size, SPLIT_PASS_VALUES), (x.reshape(-1), y.reshape(-1)))
            return
        run_split(EXPONENTIAL_FORWARD[kind], 0, x.size, threads_for(x.size, SPLIT_VALUES),
                  (self._alpha(), x.reshape(-1), y.reshape(-1)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is None:
            return
        kind = self._kind()
        given = saved.y if kind in READS_OUTPUT else saved.xs[0]
        if given.dtype != np.float32:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        if kind in READS_OUTPUT:
            run_split(OUTPUT_BACKWARD[kind], 0, given.size, threads_for(given.size, SPLIT_PASS_VALUES),
                      (self._alpha(), given.reshape(-1), gy.reshape(-1), gxs[0].reshape(-1)))
            return
        run_split(EXPONENTIAL_BACKWARD[kind], 0, given.size, threads_for(given.size, SPLIT_VALUES),
                  (given.reshape(-1), gy.reshape(-1), gxs[0].reshape(-1)))


@njit(**THREADED)
def softmax_forward(x, y, channels, inner, chunks, w0, w1, largest, totals):
    """y = softmax of x along the middle axis of (outer, channels, inner), both flat, for the
    work items [w0, w1) (item w: outer index w // chunks, inner values of chunk w % chunks,
    BLOCK at a time): the largest value, the exponentials and their sum, then y /= the sum; a
    NaN anywhere along the axis gives NaN."""
    for w in range(w0, w1):
        i0 = (w % chunks) * BLOCK
        count = min(BLOCK, inner - i0)
        first = w // chunks * channels * inner + i0  # (o, 0, i0)
        m, s = largest[:count], totals[:count]
        m[:] = x[first:first + count]
        for c in range(1, channels):
            row = x[first + c * inner:first + c * inner + count]
            for i in range(count):
                v = row[i]
                m[i] = v if (v > m[i]) | (v != v) else m[i]
        s[:] = ZERO
        for c in range(channels):
            row, out = x[first + c * inner:first + c * inner + count], y[first + c * inner:first + c * inner + count]
            for i in range(count):
                less_one, scale = _exp_parts(row[i] - m[i])  # a NaN gives NaN
                e = (ONE + less_one) * scale
                out[i] = e
                s[i] += e
        for c in range(channels):
            out = y[first + c * inner:first + c * inner + count]
            for i in range(count):
                out[i] = out[i] / s[i]


@njit(**THREADED)
def softmax_backward(y, gy, gx, channels, inner, chunks, w0, w1, totals):
    """gx = y (gy - sum(gy y)) along the middle axis of (outer, channels, inner) arrays, flat,
    for the work items [w0, w1) as in softmax_forward."""
    for w in range(w0, w1):
        i0 = (w % chunks) * BLOCK
        count = min(BLOCK, inner - i0)
        first = w // chunks * channels * inner + i0
        s = totals[:count]
        s[:] = ZERO
        for c in range(channels):
            at = first + c * inner
            ys, gys = y[at:at + count], gy[at:at + count]
            for i in range(count):
                s[i] += gys[i] * ys[i]
        for c in range(channels):
            at = first + c * inner
            ys, gys, gxs = y[at:at + count], gy[at:at + count], gx[at:at + count]
            for i in range(count):
                gxs[i] = (gys[i] - s[i]) * ys[i]


class CompiledSoftmax(LayerLike):
    """Softmax by softmax_forward and softmax_backward: the tensor seen as (outer, channels,
    inner) around the layer's axis, three passes forward and two backward where the layer's
    code makes five and four, on the kernel threads when it holds SPLIT_VALUES values or more
    (each thread its own blocks of workspace: two forward, one backward)."""

    BLOCKS = {FORWARD: 2, BACKWARD: 1}

    def _blocks_bytes(self, phase, threads):
        return scratch_bytes(*[threads * BLOCK * FLOAT32_BYTES] * self.BLOCKS[phase])

    def _threads(self, size):
        return kernel_threads() if size >= SPLIT_VALUES else 1

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if itemsize != FLOAT32_BYTES:
            return self.layer.workspace_bytes(in_shapes, phase, itemsize)
        return self._blocks_bytes(phase, self._threads(numel(in_shapes[0])))

    def _split(self, ctx, phase, function, arrays, blocks):
        """function(*arrays flat, channels, inner, chunks, w0, w1, *blocks of float32 / int32
        per thread) over the work items of the (outer, channels, inner) view, split among the
        threads."""
        shape = arrays[0].shape
        outer, channels = math.prod(shape[:self.layer.axis]), shape[self.layer.axis]
        inner = math.prod(shape[self.layer.axis + 1:])
        chunks = -(-inner // BLOCK)
        threads = fitting_threads(ctx.workspace.nbytes, lambda count: self._blocks_bytes(phase, count))
        threads = max(1, min(threads, self._threads(arrays[0].size), outer * chunks))
        per_thread = tuple(ctx.scratch((threads, BLOCK), dtype) for dtype in blocks)
        flat = tuple(a.reshape(-1) for a in arrays)
        run_split(function, 0, outer * chunks, threads, (*flat, channels, inner, chunks), per_thread)
        ctx.release_scratch()

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self._split(ctx, FORWARD, softmax_forward, (x, y), (np.float32, np.float32))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx, y = gxs[0], saved.y
        if gx is None:
            return
        if y.dtype != np.float32 or not y.flags.c_contiguous:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._split(ctx, BACKWARD, softmax_backward, (y, gy, gx), (np.float32,))
