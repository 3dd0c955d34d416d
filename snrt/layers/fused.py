"""The fused layer: a BatchNorm and the ReLU that alone reads its output, as one node.

The planner makes it (snrt/scheduler/fuse.py); a network file never names it. The fused node is
one step each way with one output, y = max(BatchNorm(x), 0), and it saves only its input x,
BatchNorm's: its backward computes BatchNorm's output again from x and the saved statistics
(the forward's arithmetic, so the same values) for ReLU's mask, g = gy * sign(y), then runs
BatchNorm's backward from g. So x, gy and gx are all the step holds at once, as many as each of
the two layers' backwards held (ReLU's: z, gy, g; BatchNorm's: x, g, gx), and the tensor between
the two layers and its gradient are never planned.

It computes what the two layers compute: the same bits in fp32 and bf16 (tested), and in fp16
too except that an output below fp16's smallest value (6e-8), stored as 0 by an unfused
BatchNorm, keeps its gradient. `ReLUAfter` composes a kernel of BatchNorm with a kernel of ReLU:
the layer's own code uses it with the layers, the CUDA backend with its kernels
(snrt/backends/cuda_kernels.py); the CPU's compiled BatchNorm applies the ReLU inside its own
passes instead (snrt/backends/cpu_kernels.py).

`AddReLU` fuses an Add and the ReLU that alone reads its sum, a residual block's end: y =
max(x0 + x1 + ..., 0), one step each way, saving its output as ReLU does (the sum is never
planned). Its backward computes g = gy * sign(y), ReLU's gradient, and hands it to every input:
in place over gy where the plan lets the input gradients take over gy's buffer
(Layer.gradient_in_place; in a residual block both inputs share it), so the step holds y and gy
alone, as ReLU's backward held y, gy and g. The same bits as the two layers, in every precision
(tested): the sum rounded to the storage dtype and then ReLU'd, or ReLU'd in fp32 and then
rounded, are the same number. `AddThenReLU` composes a kernel of Add with a kernel of ReLU whose
backward may write over its gy (one elementwise pass); the CPU runs one compiled pass each way
(snrt/backends/cpu_join.py).
"""

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from snrt.layers.activation import ReLU
from snrt.layers.base import (BACKWARD, FLOAT32_BYTES, Cost, Saved, Saves, by_channel, numel, scratch_aligned,
                              scratch_bytes)
from snrt.layers.join import Add
from snrt.layers.norm import BatchNorm

RELU = ReLU()


class ReLUAfter:
    """The kernel of BatchNormReLU `layer` from `first`, a kernel of BatchNorm, and `relu`, a
    kernel of ReLU (layer-like: `forward`, `backward` and `workspace_bytes` as a layer's).
    Backward workspace: the output again with its per-channel scale (the masked gradient is
    then written over it), then BatchNorm's workspace."""

    def __init__(self, layer, first, relu=RELU):
        self.layer, self.first, self.relu = layer, first, relu

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        first = self.first.workspace_bytes(in_shapes, phase, itemsize)
        if phase != BACKWARD:
            return first
        return scratch_aligned(scratch_bytes(numel(in_shapes[0]) * itemsize, in_shapes[0][1] * itemsize)) + first

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.first.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self.relu.forward(ctx, [y], {}, {}, y, {})

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is None and not gparams:
            return
        y = g = ctx.scratch(gy.shape, gy.dtype)  # the output again, the masked gradient then over it
        self.layer.output_again(ctx, saved.xs[0], params, aux, y)
        self.relu.forward(ctx, [y], {}, {}, y, {})
        self.relu.backward(ctx, gy, Saved((None,), y), {}, {}, [g], {})
        self.first.backward(ctx.rest(), g, Saved(saved.xs, None), params, aux, gxs, gparams)
        ctx.release_scratch()


@dataclass(frozen=True)
class BatchNormReLU(BatchNorm):
    """y = max(BatchNorm(x), 0), the options BatchNorm's (and so its parameters, state and
    statistics). Backward reads x: the mask from BatchNorm's output computed again."""

    type_name = "BatchNormReLU"
    saves = Saves(inputs=(0,))

    @cached_property
    def first(self):
        """The BatchNorm part as a layer of its own."""
        return BatchNorm(**{f.name: getattr(self, f.name) for f in dataclasses.fields(BatchNorm)})

    def cost(self, in_shapes, phase):
        """The two layers' work, less the tensor between them."""
        return _without_between(self.first.cost(in_shapes, phase), RELU.cost(in_shapes, phase), in_shapes)

    def output_again(self, ctx, x, params, aux, y):
        """y = BatchNorm's training output from x and the saved statistics, as its forward
        computes it ((x - mean) * scale + bias), allocating nothing but a scratch scale."""
        xp, x3, y3 = ctx.xp, by_channel(x), by_channel(y)
        scale = ctx.scratch(aux["inv_std"].shape, y.dtype)
        if self.affine:
            xp.multiply(params["weight"], aux["inv_std"], out=scale)
        else:
            scale[...] = aux["inv_std"]
        xp.subtract(x3, aux["mean"][:, None], out=y3)
        y3 *= scale[:, None]
        if self.affine:
            y3 += params["bias"][:, None]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return ReLUAfter(self, self.first).workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ReLUAfter(self, self.first).forward(ctx, xs, params, state, y, aux, recompute=recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        ReLUAfter(self, self.first).backward(ctx, gy, saved, params, aux, gxs, gparams)


def _without_between(first, relu, in_shapes):
    """The Cost of two fused layers' work, less the tensor between them (written once and read
    once more): `first` and `relu` the parts' Costs at `in_shapes`."""
    return Cost(first.flops + relu.flops, first.bytes + relu.bytes - 2 * numel(in_shapes[0]) * FLOAT32_BYTES)


def masked_gradient_targets(gy, gxs):
    """AddReLU's input gradient arrays of `gxs` to write: the one to compute first (gy itself
    when it is among them, so that gy is read before any copy writes over it; None when there
    is none to write), and the others, copies of it."""
    targets = [g for g in gxs if g is not None]
    if not targets:
        return None, ()
    first = next((g for g in targets if g is gy), targets[0])
    return first, tuple(g for g in targets if g is not first)


class AddThenReLU:
    """The kernel of AddReLU `layer` from `add`, a kernel of Add, and `relu`, a kernel of ReLU
    whose backward reads each element of gy before it writes that of gx, so may write over gy
    (a one-pass kernel). Forward: Add's, then ReLU's in place. Backward: ReLU's gradient into
    the first input gradient (over gy where that is gy's own array), then Add's backward copies
    it to the others. No workspace. Named "<Add kernel's name>+relu"; not timed as a whole."""

    def __init__(self, layer, add, relu):
        self.layer, self.add, self.relu = layer, add, relu
        self.name = f"{getattr(add, 'name', 'layer')}+relu"

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0

    def measured_seconds(self, phase):
        return None

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.add.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self.relu.forward(ctx, [y], {}, {}, y, {})

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        first, others = masked_gradient_targets(gy, gxs)
        if first is None:
            return
        self.relu.backward(ctx, gy, Saved((None,), saved.y), {}, {}, [first], {})
        if others:
            self.add.backward(ctx, first, Saved((None,) * len(gxs), None), {}, {}, list(others), {})


MASK_SLICE = 1 << 14  # values AddReLU's own code masks at a time where it writes over gy


@dataclass(frozen=True)
class AddReLU(Add):
    """y = max(x0 + x1 + ..., 0): an Add and the ReLU that alone reads it (module docstring).
    Backward reads the output; g = gy * sign(y) goes to every input, over gy where the plan lets
    the input gradients take over gy's buffer. This, the layer's own code, then masks gy a slice
    at a time, the slice's mask carved from its workspace (MASK_SLICE values); the kernels write
    over gy in one pass and need none."""

    type_name = "AddReLU"
    saves = Saves(output=True)
    passes_gradient = False
    gradient_in_place = True

    def cost(self, in_shapes, phase):
        return _without_between(super().cost(in_shapes, phase), RELU.cost(in_shapes[:1], phase), in_shapes)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return min(numel(in_shapes[0]), MASK_SLICE) * itemsize if phase == BACKWARD else 0

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        super().forward(ctx, xs, params, state, y, aux, recompute=recompute)
        RELU.forward(ctx, [y], {}, {}, y, {})

    @staticmethod
    def _mask_in_place(ctx, y, gy):
        """gy = sign(y) * gy, as ReLU's backward computes it (the mask, then times gy), a slice
        of MASK_SLICE values at a time; gy contiguous, as arena views are."""
        if not gy.flags.c_contiguous:
            raise ValueError("AddReLU writes its input gradient over gy, which must be contiguous")
        flat_y, flat_g = y.reshape(-1), gy.reshape(-1)
        mask = ctx.scratch((min(flat_g.size, MASK_SLICE),), gy.dtype)
        for start in range(0, flat_g.size, MASK_SLICE):
            part = flat_g[start:start + MASK_SLICE]
            ctx.xp.sign(flat_y[start:start + part.size], out=mask[:part.size])
            ctx.xp.multiply(mask[:part.size], part, out=part)
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        first, others = masked_gradient_targets(gy, gxs)
        if first is None:
            return
        if first is gy:
            self._mask_in_place(ctx, saved.y, gy)
        else:
            RELU.backward(ctx, gy, Saved((None,), saved.y), {}, {}, [first], {})
        for g in others:
            g[...] = first
