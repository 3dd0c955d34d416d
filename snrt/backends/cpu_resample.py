"""AdaptiveAvgPool and Upsample on the CPU: compiled loops, one pass each way.

The layers' NumPy code (snrt/layers/pool.py) makes one strided pass per output bin
(AdaptiveAvgPool) or per copy offset (nearest Upsample), each a NumPy call over the whole
batch with short strided rows, or two batched products with dense (sH, H) and (sW, W) weight
matrices of which two entries a row are not zero (bilinear Upsample); these kernels walk every
(sample, channel) map once, its rows contiguous. AdaptiveAvgPool's bins are PyTorch's (the
layer's `adaptive_bins`), passed as (start, end) arrays; each bin's sum runs in a fixed order.
Bilinear takes each output from its four taps (the layer's `bilinear_taps`) in PyTorch's order,
h0 (w0 x00 + w1 x01) + h1 (w0 x10 + w1 x11), and its backward adds each output's gradient
into the four, output by output. No kernel needs workspace (2-byte tensors reach them staged
in fp32). From SPLIT_VALUES values the maps are split among the kernel threads, each map one
thread's.
"""

from functools import lru_cache

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES
from snrt.layers.pool import adaptive_bins, bilinear_taps

SPLIT_VALUES = 1 << 17  # input and output values below which a kernel runs on one thread


@njit(**THREADED)
def adaptive_avg_forward(x, row_bins, col_bins, y, m0, m1):
    """y[m, i, j] = the mean of x[m] over rows row_bins[i] and columns col_bins[j], for the maps
    m0 <= m < m1 of x and y (maps, H, W)."""
    for m in range(m0, m1):
        for i in range(row_bins.shape[0]):
            r0, r1 = row_bins[i, 0], row_bins[i, 1]
            for j in range(col_bins.shape[0]):
                c0, c1 = col_bins[j, 0], col_bins[j, 1]
                total = x[m, r0, c0] * 0
                for r in range(r0, r1):
                    for q in range(c0, c1):
                        total += x[m, r, q]
                y[m, i, j] = total / ((r1 - r0) * (c1 - c0))


@njit(**THREADED)
def adaptive_avg_backward(gy, row_bins, col_bins, gx, m0, m1):
    """gx[m] = 0, then every bin's gy / its size added over the bin, for the maps m0 <= m < m1."""
    for m in range(m0, m1):
        gx[m] = 0.0
        for i in range(row_bins.shape[0]):
            r0, r1 = row_bins[i, 0], row_bins[i, 1]
            for j in range(col_bins.shape[0]):
                c0, c1 = col_bins[j, 0], col_bins[j, 1]
                share = gy[m, i, j] / ((r1 - r0) * (c1 - c0))
                for r in range(r0, r1):
                    for q in range(c0, c1):
                        gx[m, r, q] += share


@lru_cache(maxsize=None)
def nearest_forward(scale):
    """forward(x, y, m0, m1): y[m, i * sh + a, j * sw + b] = x[m, i, j] for the maps m0 <= m < m1,
    compiled for `scale` (sh, sw), whose copies of a value along a row are then stores the
    compiler vectorizes (1.7 -> 1.1 ms at 2x over 512 maps of 64x64 on 2 threads); the first
    output row of each input row is written, the other sh - 1 copied from it."""
    sh, sw = scale

    @njit(**THREADED)
    def forward(x, y, m0, m1):
        _, h, w = x.shape
        for m in range(m0, m1):
            for i in range(h):
                source, first = x[m, i], y[m, i * sh]
                for j in range(w):
                    v = source[j]
                    for b in range(sw):
                        first[j * sw + b] = v
                for a in range(1, sh):
                    y[m, i * sh + a, :] = first

    return forward


@njit(**THREADED)
def nearest_backward(gy, sh, sw, gx, m0, m1):
    """gx[m, i, j] = the sum of gy over the sh x sw copies of pixel (i, j), in the order (a, b)
    of the copies, for the maps m0 <= m < m1: a whole row of gx at a time, each copy's row
    added in turn."""
    _, h, w = gx.shape
    for m in range(m0, m1):
        for i in range(h):
            row = gx[m, i]
            row[:] = 0
            for a in range(sh):
                copies = gy[m, i * sh + a]
                for b in range(sw):
                    for j in range(w):
                        row[j] += copies[j * sw + b]


@njit(**THREADED)
def bilinear_forward(x, row_taps, row_weights, col_taps, col_weights, y, m0, m1):
    """y[m, i, j] from the four taps of x[m], for the maps m0 <= m < m1: row i reads input rows
    row_taps[i] (low, high) with row_weights[i], column j input columns col_taps[j] with
    col_weights[j]."""
    for m in range(m0, m1):
        for i in range(y.shape[1]):
            low, high, out = x[m, row_taps[i, 0]], x[m, row_taps[i, 1]], y[m, i]
            h0, h1 = row_weights[i, 0], row_weights[i, 1]
            for j in range(y.shape[2]):
                q0, q1, w0, w1 = col_taps[j, 0], col_taps[j, 1], col_weights[j, 0], col_weights[j, 1]
                out[j] = h0 * (w0 * low[q0] + w1 * low[q1]) + h1 * (w0 * high[q0] + w1 * high[q1])


@njit(**THREADED)
def bilinear_backward(gy, row_taps, row_weights, col_taps, col_weights, gx, m0, m1):
    """gx[m] = 0, then each gy[m, i, j] added into its four taps, weighted, in the order of i,
    then j, for the maps m0 <= m < m1."""
    for m in range(m0, m1):
        gx[m] = 0.0
        for i in range(gy.shape[1]):
            low, high, g = gx[m, row_taps[i, 0]], gx[m, row_taps[i, 1]], gy[m, i]
            h0, h1 = row_weights[i, 0], row_weights[i, 1]
            for j in range(gy.shape[2]):
                q0, q1, w0, w1 = col_taps[j, 0], col_taps[j, 1], col_weights[j, 0], col_weights[j, 1]
                low[q0] += h0 * w0 * g[j]
                low[q1] += h0 * w1 * g[j]
                high[q0] += h1 * w0 * g[j]
                high[q1] += h1 * w1 * g[j]


def _on_maps(kernel, source, args, target):
    """kernel(source, *args, target, m0, m1) (source and target (N, C, ...) seen as (N*C, ...)
    maps) on each thread's share of the maps."""
    maps = source.shape[0] * source.shape[1]
    source, target = source.reshape(maps, *source.shape[2:]), target.reshape(maps, *target.shape[2:])
    run_split(kernel, 0, maps, threads_for(source.size + target.size, SPLIT_VALUES), (source, *args, target))


def _bins(size, out):
    """int64 (out, 2) of the layer's bins along one axis."""
    return np.array(adaptive_bins(size, out), np.int64).reshape(out, 2)


class CompiledAdaptiveAvgPool(LayerLike):
    """AdaptiveAvgPool by adaptive_avg_forward and adaptive_avg_backward."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def _bins(self, shape):
        return _bins(shape[2], self.layer.output[0]), _bins(shape[3], self.layer.output[1])

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        _on_maps(adaptive_avg_forward, xs[0], self._bins(xs[0].shape), y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            _on_maps(adaptive_avg_backward, gy, self._bins(gxs[0].shape), gxs[0])


def _taps(size, out, dtype):
    """(int64 (out, 2) low and high indices, (out, 2) weights 1 - frac and frac in `dtype`)
    of bilinear_taps along one axis."""
    low, high, frac = bilinear_taps(size, out)
    return np.stack([low, high], axis=1).astype(np.int64), np.stack([1 - frac, frac], axis=1).astype(dtype)


class CompiledUpsample(LayerLike):
    """Upsample by nearest_forward and nearest_backward, or bilinear_forward and
    bilinear_backward (the layer's bilinear_taps along each axis)."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def _run(self, nearest, bilinear, source, target, maps):
        """nearest (kernel, its arguments) or bilinear (a kernel) on each map of `source` into
        `target`, both (N, C, ...); `maps` is the input's (H, W)."""
        if self.layer.mode == "nearest":
            return _on_maps(nearest[0], source, nearest[1], target)
        (h, w), (sh, sw) = maps, self.layer.scale
        _on_maps(bilinear, source, (*_taps(h, h * sh, source.dtype), *_taps(w, w * sw, source.dtype)), target)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self._run((nearest_forward(self.layer.scale), ()), bilinear_forward, xs[0], y, xs[0].shape[2:])

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            self._run((nearest_backward, self.layer.scale), bilinear_backward, gy, gxs[0], gxs[0].shape[2:])
