"""Dropout and Dropout2d on the CPU: one compiled pass, the mask hashed in the loop that uses it.

The layers' NumPy code (snrt/layers/dropout.py) writes the random bits of every mask entry into
two scratch arrays (six passes for the hash), compares them with the threshold, scales, and then
multiplies: about ten passes over the tensor, a few microseconds each on a small one. Here each
value's mask entry is hashed where it is used, from the same counter (the element's index, or
its (sample, channel)'s for Dropout2d) and the same key (snrt/layers/random.py), so the masks,
and the products, are the layer's bit for bit: y = m x with m = 1 / (1 - p) in float32 where
the bits are at least the threshold, else 0 (a NaN or infinite x stays NaN where dropped, as
0 * x is). Backward is the same pass over gy. No workspace; float32 only (other dtypes, eval
mode and p = 0 run the layer's code). The pass runs on the kernel threads from SPLIT_VALUES
values, each thread a share of the flat tensor.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import COMPILED, THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES
from snrt.layers.random import MASK32, mix32, stream_key

SPLIT_VALUES = 1 << 14  # below this many values one thread does the pass (a hand-off costs a few µs)
_mix32 = njit(**COMPILED, inline="always")(mix32)  # the layer's finaliser, compiled


@njit(**COMPILED, inline="always")
def _kept(counter, key, threshold):
    """Whether the mask entry of `counter` keeps its values: the finaliser of counter *
    0x9E3779B1 + key, in 32 bits (as fill_random_bits hashes), is >= `threshold`."""
    return _mix32((counter & MASK32) * 0x9E3779B1 + key) >= threshold


@njit(**THREADED)
def masked_values(x, key, threshold, scale, out, i0, i1):
    """out[i] = m_i * x[i] for i in [i0, i1), m_i = `scale` where entry i is kept, else 0."""
    zero = np.float32(0)
    x, out = x[i0:i1], out[i0:i1]  # indexed from 0: a loop from i0 would not vectorize
    for i in range(x.size):
        out[i] = (scale if _kept(i0 + i, key, threshold) else zero) * x[i]


@njit(**THREADED)
def masked_maps(x, key, threshold, scale, size, out, c0, c1):
    """The same by maps of `size` values sharing their entry: out[c*size + j] = m_c *
    x[c*size + j] for the maps c in [c0, c1)."""
    zero = np.float32(0)
    for c in range(c0, c1):
        m = scale if _kept(c, key, threshold) else zero
        row, out_row = x[c * size:(c + 1) * size], out[c * size:(c + 1) * size]
        for i in range(size):
            out_row[i] = m * row[i]


class CompiledDropout(LayerLike):
    """Dropout by `masked_values`, Dropout2d by `masked_maps`."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0 if itemsize == FLOAT32_BYTES else self.layer.workspace_bytes(in_shapes, phase, itemsize)

    def _apply(self, ctx, x, out):
        """out = this call's mask times x (both of x's shape, float32)."""
        key = stream_key(ctx.seed, ctx.iteration, ctx.node_index)
        scale = np.float32(1.0 / (1.0 - self.layer.p))
        threads, group = threads_for(x.size, SPLIT_VALUES), self.layer.mask_group(x.shape)
        mask = (np.int64(key), np.int64(self.layer.threshold), scale)
        if group == 1:
            run_split(masked_values, 0, x.size, threads, (x.reshape(-1), *mask, out.reshape(-1)))
        else:
            run_split(masked_maps, 0, x.size // group, threads,
                      (x.reshape(-1), *mask, np.int64(group), out.reshape(-1)))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not ctx.training or self.layer.p == 0 or xs[0].dtype != np.float32:
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self._apply(ctx, xs[0], y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is None:
            return
        if not ctx.training or self.layer.p == 0 or gy.dtype != np.float32:
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._apply(ctx, gy, gxs[0])
