"""Add, and Add+ReLU, on the CPU: one compiled pass on the kernel threads each way.

The layer's NumPy code (snrt/layers/join.py) runs on one core: y = x0 + x1 (then += each
further input), and its backward copies the output's gradient into each input's, reading it
once per input. These kernels split the flat tensor among the kernel threads (from
SPLIT_VALUES values; the adds are bound by memory), add in the layer's order, so the bits are
the layer's, and copy the gradient into two inputs' per read. AddReLU (snrt/layers/fused.py)
clips each sum as ReLU's kernel does in the same pass, and its backward masks gy as ReLU's
kernel does into two input gradients per read (over gy itself where that is one of them).
Contiguous float32 arrays (as arena views are); anything else runs the layer's code. No
workspace.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_activation import CLIP_FORWARD, RELU, ZERO
from snrt.backends.cpu_common import THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES
from snrt.layers.fused import AddReLU, masked_gradient_targets

SPLIT_VALUES = 1 << 17  # a pass over fewer values runs on one thread (2^16: split slower)


@njit(**THREADED)
def add_into(a, b, y, r0, r1):
    """y[r0:r1] = a[r0:r1] + b[r0:r1] over flat arrays (y may be a)."""
    xs, zs, ys = a[r0:r1], b[r0:r1], y[r0:r1]
    for i in range(ys.size):
        ys[i] = xs[i] + zs[i]


@njit(**THREADED)
def add_relu_into(a, b, y, r0, r1):
    """y[r0:r1] = max(a[r0:r1] + b[r0:r1], 0) over flat arrays, ReLU's comparison (a NaN stays)."""
    xs, zs, ys = a[r0:r1], b[r0:r1], y[r0:r1]
    for i in range(ys.size):
        v = xs[i] + zs[i]
        ys[i] = ZERO if v <= ZERO else v


@njit(**THREADED)
def masked_to_two(y, gy, first, second, r0, r1):
    """first[r0:r1] = sign(y) * gy, ReLU's gradient at its output y (the product as ReLU's
    kernel computes it), and second's too unless it is empty, over flat arrays (first may be
    gy: each value is read before it is written)."""
    ys, gys, ones = y[r0:r1], gy[r0:r1], first[r0:r1]
    if second.size == 0:
        for i in range(ys.size):
            ones[i] = np.sign(ys[i]) * gys[i]
        return
    twos = second[r0:r1]
    for i in range(ys.size):
        v = np.sign(ys[i]) * gys[i]
        ones[i] = v
        twos[i] = v


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
    """Add by add_into and copy_to_two; AddReLU by add_relu_into (two inputs; more: add_into,
    then ReLU's kernel in place) and masked_to_two (more inputs: copy_to_two after it)."""

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
        relu = isinstance(self.layer, AddReLU)
        self._split(add_relu_into if relu and len(xs) == 2 else add_into, (xs[0], xs[1], y))
        for x in xs[2:]:
            self._split(add_into, (y, x, y))
        if relu and len(xs) > 2:
            self._split(CLIP_FORWARD[RELU], (y, y))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        relu = isinstance(self.layer, AddReLU)
        if not self._served([gy, *targets, *([saved.y] if relu else [])]):
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        if relu and targets:  # the masked gradient into two (over gy where that is one of them), copied on
            first, others = masked_gradient_targets(gy, gxs)
            self._split(masked_to_two, (saved.y, gy, first, others[0] if others else gy[:0]))
            gy, targets = first, list(others[1:])
        for first in range(0, len(targets), 2):
            pair = targets[first:first + 2]
            self._split(copy_to_two, (gy, pair[0], pair[1] if len(pair) == 2 else gy[:0]))
