"""Add on the CPU: one compiled pass on the kernel threads each way.

The layer's NumPy code (snrt/layers/join.py) runs on one core: y = x0 + x1 (then += each
further input), and its backward copies the output's gradient into each input's, reading it
once per input. These kernels split the flat tensor among the kernel threads (from
SPLIT_VALUES values; the adds are bound by memory), add in the layer's order, so the bits are
the layer's, and copy the gradient into two inputs' per read. Contiguous float32 arrays (as
arena views are); anything else runs the layer's code. No workspace.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES

SPLIT_VALUES = 1 << 17  # a pass over fewer values runs on one thread (2^16: split slower)


@njit(**THREADED)
def add_into(a, b, y, r0, r1):
    """y[r0:r1] = a[r0:r1] + b[r0:r1] over flat arrays (y may be a)."""
    xs, zs, ys = a[r0:r1], b[r0:r1], y[r0:r1]
    for i in range(ys.size):
        ys[i] = xs[i] + zs[i]


@njit(**THREADED)
def copy_to_two(source, first, second, r0, r1):
    """first[r0:r1] = source[r0:r1], and second's too unless it is empty, over flat arrays."""
    values, ones = source[r0:r1], first[r0:r1]
    if second.size == 0:
        ones[:] = values
        return
    twos = second[r0:r1]
    for i in range(values.size):
        v = values[i]
        ones[i] = v
        twos[i] = v


class CompiledAdd(LayerLike):
    """Add by add_into and copy_to_two."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    @staticmethod
    def _served(arrays):
        return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)

    @staticmethod
    def _split(function, arrays):
        flat = tuple(a.reshape(-1) for a in arrays)
        run_split(function, 0, flat[0].size, threads_for(flat[0].size, SPLIT_VALUES), flat)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not self._served([y, *xs]):
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self._split(add_into, (xs[0], xs[1], y))
        for x in xs[2:]:
            self._split(add_into, (y, x, y))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        if not self._served([gy, *targets]):
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        for first in range(0, len(targets), 2):
            pair = targets[first:first + 2]
            self._split(copy_to_two, (gy, pair[0], pair[1] if len(pair) == 2 else gy[:0]))
