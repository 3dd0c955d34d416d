"""Add, Add+ReLU and Concat on the CPU: one compiled pass on the kernel threads each way.

The layer's NumPy code (snrt/layers/join.py) runs on one core: y = x0 + x1 (then += each
further input), and its backward copies the output's gradient into each input's, reading it
once per input. These kernels split the flat tensor among the kernel threads (from
SPLIT_VALUES values; the adds are bound by memory), add in the layer's order, so the bits are
the layer's, and copy the gradient into two inputs' per read. AddReLU (snrt/layers/fused.py)
clips each sum as ReLU's kernel does in the same pass, and its backward masks gy as ReLU's
kernel does into two input gradients per read, or, where gy itself is one of them (a residual
chain's plan hands gy's buffer to both inputs), over gy in place, copied to any other.
Concat copies each input into its columns of the output (backward: each input's gradient out
of gy's), an input at a time split among the kernel threads by its values, where the layer's
NumPy assignment copies on one core (8 samples of 128 + 32 channels at 28x28, 2 threads:
0.088 -> 0.073 ms forward, 0.096 -> 0.072 backward). Contiguous float32 arrays (as arena views
are); anything else runs the layer's code. No workspace.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_activation import ZERO
from snrt.backends.cpu_common import THREADED, LayerLike, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import FLOAT32_BYTES, numel
from snrt.layers.fused import AddReLU, masked_gradient_targets

SPLIT_VALUES = 1 << 17  # a pass over fewer values runs on one thread (2^16: split slower)


def contiguous_float32(arrays):
    """Whether the kernels here serve `arrays` (else the layer's code runs)."""
    return all(a.dtype == np.float32 and a.flags.c_contiguous for a in arrays)


@njit(**THREADED)
def add_into(a, b, y, r0, r1):
    """y[r0:r1] = a[r0:r1] + b[r0:r1] over flat arrays (y another array than a: see add_in_place)."""
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
def add_in_place(y, x, r0, r1):
    """y[r0:r1] += x[r0:r1] over flat arrays (add_into over y itself, one name for it: see
    masked_in_place)."""
    ys, xs = y[r0:r1], x[r0:r1]
    for i in range(ys.size):
        ys[i] += xs[i]


@njit(**THREADED)
def add_relu_in_place(y, x, r0, r1):
    """y[r0:r1] = max(y[r0:r1] + x[r0:r1], 0) over flat arrays, add_relu_into over y itself."""
    ys, xs = y[r0:r1], x[r0:r1]
    for i in range(ys.size):
        v = ys[i] + xs[i]
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
def masked_in_place(y, gy, r0, r1):
    """gy[r0:r1] = sign(y) * gy, masked_to_two over gy itself: one array read and written
    (written through another name, the loop would run a value at a time where the two overlap:
    2^19 values 0.29 ms against 0.05, one thread)."""
    ys, gys = y[r0:r1], gy[r0:r1]
    for i in range(ys.size):
        gys[i] = np.sign(ys[i]) * gys[i]


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


@njit(**THREADED)
def copy_columns(narrow, wide, width, wide_width, start, into_wide, v0, v1):
    """Copy values v0..v1 of `narrow` (flat: rows of `width` values) to or from (`into_wide`
    or not) the columns start..start + width of `wide` (flat: rows of `wide_width`), each
    row's part a contiguous run (loops from 0 over slices: they vectorize)."""
    at = v0
    while at < v1:
        row = at // width
        column = at - row * width
        count = min(width - column, v1 - at)
        ours = narrow[at:at + count]
        theirs = wide[row * wide_width + start + column:row * wide_width + start + column + count]
        if into_wide:
            for i in range(count):
                theirs[i] = ours[i]
        else:
            for i in range(count):
                ours[i] = theirs[i]
        at += count


class CompiledConcat(LayerLike):
    """Concat by copy_columns: an input (or its gradient) is rows of its columns of the output,
    a row per index before the axis."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def _copy(self, parts, wide, shapes, into_wide):
        """Each of `parts` (None: skipped) to or from its columns of the output `wide`; `shapes`
        are the inputs' (the columns' widths)."""
        axis = self.layer.axis
        widths = [numel(shape[axis:]) for shape in shapes]
        flat, start, wide_width = wide.reshape(-1), 0, sum(widths)
        for part, width in zip(parts, widths):
            if part is not None and part.size:
                values = part.reshape(-1)
                run_split(copy_columns, 0, values.size, threads_for(values.size, SPLIT_VALUES),
                          (values, flat, width, wide_width, start, into_wide))
            start += width

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not contiguous_float32([y, *xs]):
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self._copy(xs, y, [x.shape for x in xs], True)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        if not contiguous_float32([gy, *targets]) or (ctx.in_shapes is None and len(targets) < len(gxs)):
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._copy(gxs, gy, ctx.in_shapes or [gx.shape for gx in gxs], False)


class CompiledAdd(LayerLike):
    """Add by add_into (a third input on: add_in_place) and copy_to_two; AddReLU by
    add_relu_into (more inputs: add_into, add_in_place, add_relu_in_place for the last) and
    masked_to_two or masked_in_place (more inputs: copy_to_two after it)."""

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    @staticmethod
    def _split(function, arrays):
        flat = tuple(a.reshape(-1) for a in arrays)
        run_split(function, 0, flat[0].size, threads_for(flat[0].size, SPLIT_VALUES), flat)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not contiguous_float32([y, *xs]):
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        relu, last = isinstance(self.layer, AddReLU), len(xs) - 1
        self._split(add_relu_into if relu and last == 1 else add_into, (xs[0], xs[1], y))
        for i in range(2, len(xs)):  # the ReLU with the last add
            self._split(add_relu_in_place if relu and i == last else add_in_place, (y, xs[i]))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        relu = isinstance(self.layer, AddReLU)
        if not contiguous_float32([gy, *targets, *([saved.y] if relu else [])]):
            return self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
        if relu and targets:  # the masked gradient into two (over gy where that is one of them), copied on
            first, others = masked_gradient_targets(gy, gxs)
            if first is gy:
                self._split(masked_in_place, (saved.y, gy))
                targets = list(others)
            else:
                self._split(masked_to_two, (saved.y, gy, first, others[0] if others else gy[:0]))
                gy, targets = first, list(others[1:])
        for first in range(0, len(targets), 2):
            pair = targets[first:first + 2]
            self._split(copy_to_two, (gy, pair[0], pair[1] if len(pair) == 2 else gy[:0]))
