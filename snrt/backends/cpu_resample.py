"""AdaptiveAvgPool and nearest Upsample on the CPU: compiled loops, one pass each way.

The layers' NumPy code (snrt/layers/pool.py) makes one strided pass per output bin
(AdaptiveAvgPool) or per copy offset (Upsample), each a NumPy call over the whole batch with
short strided rows; these kernels walk every (sample, channel) map once, its rows contiguous.
AdaptiveAvgPool's bins are PyTorch's (the layer's `adaptive_bins`), passed as (start, end)
arrays; each bin's sum runs in a fixed order. Neither kernel needs workspace. From
SPLIT_VALUES values the maps are split among the kernel threads, each map one thread's.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, no_arguments_per_thread, run_split
from snrt.layers.base import FLOAT32_BYTES
from snrt.layers.pool import adaptive_bins

SPLIT_VALUES = 1 << 20  # input and output values below which a kernel runs on one thread


@njit(**THREADED)
def adaptive_avg_forward(x, row_bins, col_bins, y):
    """y[n, c, i, j] = the mean of x[n, c] over rows row_bins[i] and columns col_bins[j]."""
    n, channels = x.shape[0], x.shape[1]
    for s in range(n):
        for c in range(channels):
            for i in range(row_bins.shape[0]):
                r0, r1 = row_bins[i, 0], row_bins[i, 1]
                for j in range(col_bins.shape[0]):
                    c0, c1 = col_bins[j, 0], col_bins[j, 1]
                    total = x[s, c, r0, c0] * 0
                    for r in range(r0, r1):
                        for q in range(c0, c1):
                            total += x[s, c, r, q]
                    y[s, c, i, j] = total / ((r1 - r0) * (c1 - c0))


@njit(**THREADED)
def adaptive_avg_backward(gy, row_bins, col_bins, gx):
    """gx[n, c] = 0, then every bin's gy / its size added over the bin."""
    n, channels = gx.shape[0], gx.shape[1]
    for s in range(n):
        for c in range(channels):
            gx[s, c] = 0.0
            for i in range(row_bins.shape[0]):
                r0, r1 = row_bins[i, 0], row_bins[i, 1]
                for j in range(col_bins.shape[0]):
                    c0, c1 = col_bins[j, 0], col_bins[j, 1]
                    share = gy[s, c, i, j] / ((r1 - r0) * (c1 - c0))
                    for r in range(r0, r1):
                        for q in range(c0, c1):
                            gx[s, c, r, q] += share


@njit(**THREADED)
def nearest_forward(x, sh, sw, y):
    """y[n, c, i * sh + a, j * sw + b] = x[n, c, i, j]."""
    n, channels, h, w = x.shape
    for s in range(n):
        for c in range(channels):
            for i in range(h):
                for a in range(sh):
                    for j in range(w):
                        v = x[s, c, i, j]
                        for b in range(sw):
                            y[s, c, i * sh + a, j * sw + b] = v


@njit(**THREADED)
def nearest_backward(gy, sh, sw, gx):
    """gx[n, c, i, j] = the sum of gy over the sh x sw copies of pixel (i, j), in the order
    (a, b) of the copies: a whole row of gx at a time, each copy's row added in turn."""
    n, channels, h, w = gx.shape
    for s in range(n):
        for c in range(channels):
            for i in range(h):
                row = gx[s, c, i]
                row[:] = 0
                for a in range(sh):
                    copies = gy[s, c, i * sh + a]
                    for b in range(sw):
                        for j in range(w):
                            row[j] += copies[j * sw + b]


def _on_maps(kernel, source, args, target):
    """kernel(source, *args, target) (source and target (N, C, ...)) on each thread's share of
    the N*C maps, as arrays (1, maps, ...) whose maps run as one sample's channels."""
    maps = source.shape[0] * source.shape[1]
    source, target = source.reshape(1, maps, *source.shape[2:]), target.reshape(1, maps, *target.shape[2:])

    def share(m0, m1):
        kernel(source[:, m0:m1], *args, target[:, m0:m1])

    run_split(share, 0, maps, no_arguments_per_thread(source.size + target.size, SPLIT_VALUES), ())


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


class CompiledNearestUpsample(LayerLike):
    """Upsample in `nearest` mode by nearest_forward and nearest_backward (bilinear: the layer)."""

    @staticmethod
    def serves(layer, in_shapes):
        return layer.mode == "nearest"

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        _on_maps(nearest_forward, xs[0], self.layer.scale, y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            _on_maps(nearest_backward, gy, self.layer.scale, gxs[0])
