"""MaxPool, AvgPool and GlobalAvgPool's forward on the CPU: compiled loops over each (sample,
channel) map, the window poolings' maps split among the kernel threads. (GlobalAvgPool's NumPy
sum over short rows, one per map, runs at a fraction of memory speed; its compiled sum is one
pass.)

The layers' NumPy code (snrt/layers/pool.py) makes one to four strided passes over the whole
batch per window offset, through scratch tensors of the output's size. Here MaxPool's output
rows take their window's rows one offset at a time (contiguous runs of each row's column
phases, see maxpool_forward): forward keeps the running maximum and the offset of the first
one (a strict improvement, as the layer and PyTorch; a NaN in the window makes the output
NaN, as NumPy's maximum does); backward adds each gy at its window's argmax. AvgPool goes
over each map once per window offset, as the layer goes over the batch, while the map is in
cache: the same sums in the same order, then the same product by 1 / divisor (backward: gy
times it, added at each offset in turn).
None needs workspace. Maps are independent and each is one thread's, so results do not
depend on the number of threads: the values (and MaxPool's indices) are the layer's, bit for
bit.
"""

from functools import lru_cache

import numpy as np
from numba import njit, uint64

from snrt.backends.cpu_common import COMPILED, EXACT, THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.backends.cpu_tiles import inside_range
from snrt.layers.base import FLOAT32_BYTES, by_channel

SPLIT_VALUES = 1 << 15  # outputs below which a pooling runs on one thread


@njit(**THREADED)
def maxpool_forward(x, kh, kw, sh, sw, ph, pw, y, argmax, m0, m1):
    """y and argmax (the window offset i*kw + j of the first maximum) of the maps m in
    [m0, m1) of the (N*C) maps of x (N, C, H, W). Each input row a window row reads is first
    split into its sw column phases, padded with -inf (phases[b, t] = x's column t*sw + b - pw),
    so that window column j reads phase j % sw from j // sw on: contiguous runs, compared
    without branches, that the compiler vectorizes (the strided loop's data-dependent branches
    mispredicted on every other value). -inf never improves on the -inf a maximum starts at, so the padding
    changes nothing."""
    _, channels, h, w = x.shape
    ho, wo = y.shape[2], y.shape[3]
    phase_length = wo + (kw - 1) // sw
    phases = np.empty((sw, phase_length), x.dtype)
    for m in range(m0, m1):
        s, c = m // channels, m % channels
        for r in range(ho):
            best, index = y[s, c, r], argmax[s, c, r]
            best[:] = -np.inf
            index[:] = 0
            for i in range(kh):
                hi = r * sh - ph + i
                if hi < 0 or hi >= h:
                    continue
                row = x[s, c, hi]
                for b in range(sw):
                    phase = phases[b]
                    t0, t1 = inside_range(pw, b, sw, w, phase_length)  # the columns inside the row
                    phase[:t0] = -np.inf
                    phase[t1:] = -np.inf
                    step, shift = uint64(sw), uint64(b - pw)  # unsigned (wrapping) indices: the loop vectorizes
                    for t in range(uint64(t0), uint64(t1)):
                        phase[t] = row[t * step + shift]
                for j in range(kw):
                    k = index.dtype.type(i * kw + j)
                    run = phases[j % sw, j // sw:]
                    for q in range(wo):
                        v, current = run[q], best[q]
                        better = v > current
                        best[q] = v if better | (v != v) else current  # a NaN sticks, as in NumPy's maximum
                        index[q] = k if better else index[q]


@njit(**THREADED)
def maxpool_backward(gy, argmax, kh, kw, sh, sw, ph, pw, gx, m0, m1):
    """gx = 0, then each gy[n, c, r, q] added at its window's argmax (when inside x), for the
    maps in [m0, m1), each map's outputs in order. The offsets' rows and columns come from a
    table (no division per output), and a position is tested inside x as unsigned values, so
    the indices need no wrapping of negative values."""
    _, channels, h, w = gx.shape
    ho, wo = gy.shape[2], gy.shape[3]
    rows, columns = np.empty(kh * kw, np.int64), np.empty(kh * kw, np.int64)
    for k in range(kh * kw):
        rows[k], columns[k] = k // kw - ph, k % kw - pw
    for m in range(m0, m1):
        s, c = m // channels, m % channels
        plane, grads, picks = gx[s, c], gy[s, c], argmax[s, c]
        plane[:] = 0.0
        for r in range(ho):
            for q in range(wo):
                k = picks[r, q]
                hi, wi = uint64(r * sh + rows[k]), uint64(q * sw + columns[k])
                if hi < h and wi < w:  # unsigned: a position above or left of x is large
                    plane[hi, wi] += grads[r, q]


@njit(**EXACT)
def avgpool_maps(x, y, kh, kw, sh, sw, ph, pw, inverse, forward, m0, m1):
    """For the maps m in [m0, m1) of the (N*C) maps of x (N, C, H, W) and y (N, C, Ho, Wo),
    inverse (Ho, Wo) being 1 / the divisor: forward, y = the sum of each window's elements
    inside x times inverse; else (backward, x holding gx and y gy) x = gy * inverse added at
    each element of every window. The map written is set to 0, then the window offsets (i, j)
    in turn add that element's rows over every output it lies inside, as the layer's passes
    do over the batch: the same sums in the same order, each product rounded before its sum
    (EXACT), so the layer's bits."""
    _, channels, h, w = x.shape
    ho, wo = y.shape[2], y.shape[3]
    for m in range(m0, m1):
        big, small = x[m // channels, m % channels], y[m // channels, m % channels]
        (small if forward else big)[:] = 0
        for i in range(kh):
            r0, r1 = inside_range(ph, i, sh, h, ho)
            for j in range(kw):
                q0, q1 = inside_range(pw, j, sw, w, wo)
                step, shift = uint64(sw), uint64(j - pw)  # unsigned (wrapping) indices: the loops vectorize
                for r in range(r0, r1):
                    row, outputs, factors = big[r * sh - ph + i], small[r], inverse[r]
                    if forward:
                        for q in range(uint64(q0), uint64(q1)):
                            outputs[q] += row[q * step + shift]
                    else:
                        for q in range(uint64(q0), uint64(q1)):
                            row[q * step + shift] += outputs[q] * factors[q]
        if forward:
            for r in range(ho):
                outputs, factors = small[r], inverse[r]
                for q in range(wo):
                    outputs[q] *= factors[q]


@njit(**COMPILED)
def global_average(x, y):
    """y[n, c] = the sum of x[n, c] (N, C, K) times 1 / K."""
    n, channels, k = x.shape
    scale = x.dtype.type(1.0 / k)
    for s in range(n):
        for c in range(channels):
            total = x.dtype.type(0)
            for j in range(k):
                total += x[s, c, j]
            y[s, c] = total * scale


class _CompiledWindowPool(LayerLike):
    """A window pooling's compiled kernel: no workspace (the layer's passes need scratch
    tensors of the output's size)."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def _geometry(self):
        layer = self.layer
        return (*layer.kernel, *layer.stride, *layer.padding)


class CompiledMaxPool(_CompiledWindowPool):
    """MaxPool by maxpool_forward and maxpool_backward."""

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        run_split(maxpool_forward, 0, x.shape[0] * x.shape[1], threads_for(y.size, SPLIT_VALUES),
                  (x, *self._geometry(), y, aux["argmax"]))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is not None:
            run_split(maxpool_backward, 0, gx.shape[0] * gx.shape[1], threads_for(gy.size, SPLIT_VALUES),
                      (gy, aux["argmax"], *self._geometry(), gx))


@lru_cache(maxsize=256)
def _inverse_divisor(layer, in_shape, out_shape, dtype):
    """The AvgPool layer's 1 / divisor (Ho, Wo) in `dtype` (a NumPy dtype name), once per shape."""
    return layer._inverse_divisor(np, in_shape, out_shape, np.dtype(dtype))


class CompiledAvgPool(_CompiledWindowPool):
    """AvgPool by avgpool_maps."""

    def _run(self, x, y, forward):
        """avgpool_maps over x's and y's maps, each thread a share of them."""
        inverse = _inverse_divisor(self.layer, x.shape, y.shape, y.dtype.name)
        run_split(avgpool_maps, 0, x.shape[0] * x.shape[1], threads_for(x.size + y.size, SPLIT_VALUES),
                  (x, y, *self._geometry(), inverse, forward))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self._run(xs[0], y, True)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            self._run(gxs[0], gy, False)


class CompiledGlobalAvgPool(LayerLike):
    """GlobalAvgPool with the compiled forward above; backward (one broadcast multiply) is the
    layer's."""

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        global_average(by_channel(xs[0]), y)
