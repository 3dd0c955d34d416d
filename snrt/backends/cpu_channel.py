"""Per-channel products on the CPU: Mul by a channel gate (a squeeze-and-excitation block's
x * g with g (N, C) or (N, C, 1, 1)) and Scale (ConvNeXt's layer scale, x * weight[c]).

The layers broadcast in NumPy, and their backward writes gy * x to a planned workspace of x's
size before summing it. These kernels go over each (sample, channel) row once: forward
y = x * s, backward gx = gy * s and the factor's gradient summed in the same pass (float64
sums, each in a fixed order), so they need no workspace; from SPLIT_VALUES values the channels
are split among the kernel threads. float32 only; other dtypes and other gate shapes run the
layer's code.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES, by_channel

SPLIT_VALUES = 1 << 19  # a product of fewer values runs on one thread (it is bound by memory)


@njit(**THREADED)
def scale_rows(x, factors, y, c0, c1):
    """y[n, c, :] = x[n, c, :] * factors[n, c], or factors[0, c] when factors is (1, C), for the
    channels c0 <= c < c1; x, y (N, C, K)."""
    n, _, k = x.shape
    for s in range(n):
        for c in range(c0, c1):
            a = factors[s if factors.shape[0] > 1 else 0, c]
            for j in range(k):
                y[s, c, j] = x[s, c, j] * a


@njit(**THREADED)
def scale_rows_backward(x, gy, factors, gx, gfactors, c0, c1):
    """gx = gy * factors as in scale_rows (unless gx has no samples) and gfactors[n, c] = the
    sum of gy * x over the row (factors (N, C)), or gfactors[0, c] = that sum over the samples
    too (factors (1, C)), for the channels c0 <= c < c1."""
    n, _, k = x.shape
    per_sample = factors.shape[0] > 1
    for c in range(c0, c1):
        total = 0.0
        for s in range(n):
            a = factors[s if per_sample else 0, c]
            row = 0.0
            for j in range(k):
                row += np.float64(gy[s, c, j]) * x[s, c, j]
                if gx.shape[0]:
                    gx[s, c, j] = gy[s, c, j] * a
            if per_sample:
                gfactors[s, c] = row
            else:
                total += row
        if not per_sample:
            gfactors[0, c] = total


class _ChannelProduct(LayerLike):
    """A layer computing x (N, C, ...) times factors (N, C) or (1, C), by the kernels above."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.layer.workspace_bytes(in_shapes, phase, itemsize) if itemsize != FLOAT32_BYTES else 0

    @staticmethod
    def _product(x, factors, y):
        run_split(scale_rows, 0, x.shape[1], threads_for(x.size, SPLIT_VALUES),
                  (by_channel(x), factors, by_channel(y)))

    @staticmethod
    def _product_backward(x, gy, factors, gx, gfactors):
        gx3 = by_channel(gx) if gx is not None else by_channel(x)[:0]  # no samples: the factors' sums only
        run_split(scale_rows_backward, 0, x.shape[1], threads_for(x.size, SPLIT_VALUES),
                  (by_channel(x), by_channel(gy), factors, gx3, gfactors))


class CompiledGateMul(_ChannelProduct):
    """Mul whose gate (input 1) is (N, C) or (N, C, 1, ...) for x (N, C, ...)."""

    @staticmethod
    def serves(layer, in_shapes):
        x, gate = tuple(in_shapes[0]), tuple(in_shapes[1])
        return len(x) > 2 and gate[:2] == x[:2] and all(d == 1 for d in gate[2:])

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, gate = xs
        if x.dtype != np.float32:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self._product(x, gate.reshape(x.shape[:2]), y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, gate = saved.xs
        if x.dtype != np.float32:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        if gxs[1] is None:  # the gate takes no gradient: gx only
            if gxs[0] is not None:
                self._product(gy, gate.reshape(x.shape[:2]), gxs[0])
            return
        self._product_backward(x, gy, gate.reshape(x.shape[:2]), gxs[0], gxs[1].reshape(x.shape[:2]))


class CompiledScale(_ChannelProduct):
    """Scale (y = x * weight[c]) of an x with a map (N, C, ...)."""

    @staticmethod
    def serves(layer, in_shapes):
        return len(in_shapes[0]) > 2

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if xs[0].dtype != np.float32:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self._product(xs[0], params["weight"][None], y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if x.dtype != np.float32:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._product_backward(x, gy, params["weight"][None], gxs[0], gparams["weight"][None])
