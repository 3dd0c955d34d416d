"""AdaptiveAvgPool and Upsample on the CPU: compiled loops, one pass each way.

The layers' NumPy code (snrt/layers/pool.py) makes one strided pass per output bin
(AdaptiveAvgPool) or per copy offset (nearest Upsample), each a NumPy call over the whole
batch with short strided rows, or two batched products with dense (sH, H) and (sW, W) weight
matrices of which two entries a row are not zero (bilinear Upsample); these kernels walk every
(sample, channel) map once, its rows contiguous. AdaptiveAvgPool's bins are PyTorch's (the
layer's `adaptive_bins`), passed as (start, end) arrays; each bin's sum runs in a fixed order.
Bilinear is separable, y = Ah x Aw^T per map with two taps a row of each: each input row is
interpolated along its columns once (w0 x[q0] + w1 x[q1]) into a thread's scratch rows, then
each output row is the blend h0 low + h1 high of two of them, a loop along the row that
vectorizes; backward runs the transposes in reverse (each output row of gy added, weighted,
into its two scratch rows, then each scratch row added into its input row's columns). Its
scratch rows, (H, sW) per thread, are the only workspace a kernel here needs (2-byte tensors
reach them staged in fp32). From SPLIT_VALUES values the maps are split among the kernel
threads, each map one thread's.
"""

from functools import lru_cache

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, fitting_threads, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES, numel, scratch_bytes
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
def bilinear_forward(x, row_taps, row_weights, col_taps, col_weights, y, m0, m1, rows):
    """y[m] from the four taps of x[m], for the maps m0 <= m < m1, in two passes: each input
    row r interpolated along its columns once, rows[r, j] = w0 x[m, r, q0] + w1 x[m, r, q1]
    (column j reads input columns col_taps[j] with col_weights[j]), then each output row i the
    blend h0 rows[low] + h1 rows[high] of its two (row_taps[i], row_weights[i]), a loop along
    the row that vectorizes. rows (H, sW): this thread's scratch."""
    for m in range(m0, m1):
        for r in range(x.shape[1]):
            source, target = x[m, r], rows[r]
            for j in range(y.shape[2]):
                target[j] = col_weights[j, 0] * source[col_taps[j, 0]] + col_weights[j, 1] * source[col_taps[j, 1]]
        for i in range(y.shape[1]):
            low, high, out = rows[row_taps[i, 0]], rows[row_taps[i, 1]], y[m, i]
            h0, h1 = row_weights[i, 0], row_weights[i, 1]
            for j in range(y.shape[2]):
                out[j] = h0 * low[j] + h1 * high[j]


@njit(**THREADED)
def bilinear_backward(gy, row_taps, row_weights, col_taps, col_weights, gx, m0, m1, rows):
    """gx[m] = the transpose of bilinear_forward applied to gy[m], for the maps m0 <= m < m1,
    its passes in reverse: rows[r] = the sum over the output rows i that read input row r of
    their weight times gy[m, i] (the output rows in order, a loop along the row that
    vectorizes), then gx[m, r] = 0 with each rows[r, j] added, weighted, into its two input
    columns (the columns in order). rows (H, sW): this thread's scratch."""
    for m in range(m0, m1):
        rows[:] = 0.0
        for i in range(gy.shape[1]):
            low, high, g = rows[row_taps[i, 0]], rows[row_taps[i, 1]], gy[m, i]
            h0, h1 = row_weights[i, 0], row_weights[i, 1]
            for j in range(gy.shape[2]):
                low[j] += h0 * g[j]
            for j in range(gy.shape[2]):
                high[j] += h1 * g[j]
        for r in range(gx.shape[1]):
            source, target = rows[r], gx[m, r]
            target[:] = 0.0
            for j in range(gy.shape[2]):
                target[col_taps[j, 0]] += col_weights[j, 0] * source[j]
                target[col_taps[j, 1]] += col_weights[j, 1] * source[j]


def _on_maps(kernel, source, args, target, threads=None, per_thread=()):
    """kernel(source, *args, target, m0, m1, *per_thread rows) (source and target (N, C, ...)
    seen as (N*C, ...) maps) on each thread's share of the maps: `threads` of them, by default
    as many as the maps' values call for."""
    maps = source.shape[0] * source.shape[1]
    if threads is None:
        threads = threads_for(source.size + target.size, SPLIT_VALUES)
    source, target = source.reshape(maps, *source.shape[2:]), target.reshape(maps, *target.shape[2:])
    run_split(kernel, 0, maps, threads, (source, *args, target), per_thread)


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
    """Upsample by nearest_forward and nearest_backward (no workspace), or bilinear_forward and
    bilinear_backward (the layer's bilinear_taps along each axis; each thread an (H, sW)
    scratch of rows interpolated along the columns)."""

    def _bilinear_threads(self, in_shapes, workspace_bytes=None):
        """The threads the bilinear kernels split the maps among (fewer where the planned
        `workspace_bytes` was sized for fewer)."""
        n, c, h, w = in_shapes[0]
        wanted = threads_for(n * c * h * w * (1 + numel(self.layer.scale)), SPLIT_VALUES)  # in and out values
        if workspace_bytes is None:
            return wanted
        return min(wanted, fitting_threads(workspace_bytes, lambda t: self._rows_bytes(in_shapes, t)))

    def _rows_shape(self, in_shapes, threads):
        _, _, h, w = in_shapes[0]
        return (threads, h, w * self.layer.scale[1])

    def _rows_bytes(self, in_shapes, threads, itemsize=FLOAT32_BYTES):
        return scratch_bytes(numel(self._rows_shape(in_shapes, threads)) * itemsize)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if self.layer.mode == "nearest":
            return 0
        return self._rows_bytes(in_shapes, self._bilinear_threads(in_shapes), itemsize)

    def _run(self, ctx, nearest, bilinear, source, target, maps):
        """nearest (kernel, its arguments) or bilinear (a kernel) on each map of `source` into
        `target`, both (N, C, ...); `maps` is the input's (H, W)."""
        if self.layer.mode == "nearest":
            return _on_maps(nearest[0], source, nearest[1], target)
        (h, w), (sh, sw) = maps, self.layer.scale
        in_shape = (*source.shape[:2], h, w)
        threads = self._bilinear_threads([in_shape], ctx.workspace.nbytes)
        rows = ctx.scratch(self._rows_shape([in_shape], threads), source.dtype)
        _on_maps(bilinear, source, (*_taps(h, h * sh, source.dtype), *_taps(w, w * sw, source.dtype)), target,
                 threads, (rows,))
        ctx.release_scratch()

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self._run(ctx, (nearest_forward(self.layer.scale), ()), bilinear_forward, xs[0], y, xs[0].shape[2:])

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            self._run(ctx, (nearest_backward, self.layer.scale), bilinear_backward, gy, gxs[0], gxs[0].shape[2:])
