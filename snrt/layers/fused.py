"""Fused layers: a BatchNorm or an Add with the ReLU that alone reads its output, as one node.

The planner makes them (snrt/scheduler/fuse.py); a network file never names them. A fused node
is one step each way with one output, y = max(first(x...), 0), and it saves what the fusion
needs, not what its parts did; the tensor between the parts and its gradient are never planned.

- forward: the first part writes y, ReLU then runs in place on it;
- backward: g = gy * sign(y) (ReLU's gradient), then the first part's backward from g.

BatchNormReLU saves only its input: its backward computes BatchNorm's output again from x and
the saved statistics (the forward's arithmetic, so the same values) for the mask, so that x, gy
and gx are all it holds, one tensor fewer than BatchNorm's backward after ReLU's (z, gy, gx_z,
then x, gx_z, gx) asks for at once. AddReLU saves its output y for the mask (its inputs are not
saved), and its masked gradient goes straight into an input gradient, which Add's backward then
copies to the others.

Both compute what the two layers compute: the same bits in fp32 and bf16 (tested), and in fp16
too except that an output below fp16's smallest value (6e-8), stored as 0 by an unfused
BatchNorm, keeps its gradient. `ReLUAfter` composes any kernel of the first part with any kernel
of ReLU: the layers' own code uses it with the layers, the CUDA backend with its kernels
(snrt/backends/cuda_kernels.py); the CPU's compiled kernels apply the ReLU inside their own
passes instead (snrt/backends/cpu_kernels.py, cpu_join.py).
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
    """The kernel of fused layer `layer` from `first`, a kernel of its first part, and `relu`,
    a kernel of ReLU (layer-like: `forward`, `backward` and `workspace_bytes` as a layer's).
    Backward workspace: where the layer does not save its output, that output again
    (`layer.output_again`) with what computing it needs, the masked gradient then written over
    it; then the first part's workspace."""

    def __init__(self, layer, first, relu=RELU):
        self.layer, self.first, self.relu = layer, first, relu

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        first = self.first.workspace_bytes(in_shapes, phase, itemsize)
        if phase != BACKWARD or self.layer.saves.output:
            return first
        again = scratch_bytes(numel(in_shapes[0]) * itemsize, *self.layer.output_again_bytes(in_shapes, itemsize))
        return scratch_aligned(again) + first

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.first.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self.relu.forward(ctx, [y], {}, {}, y, {})

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        if not targets and not gparams:
            return
        y = saved.y
        if y is None:  # not saved: the forward's output again, the masked gradient then over it
            y = g = ctx.scratch(gy.shape, gy.dtype)
            self.layer.output_again(ctx, saved.xs, params, aux, y)
            self.relu.forward(ctx, [y], {}, {}, y, {})
        else:  # into an input gradient (Add's backward copies it to the others)
            g = targets[0]
        self.relu.backward(ctx, gy, Saved((None,), y), {}, {}, [g], {})
        self.first.backward(ctx.rest(), g, Saved(saved.xs, None), params, aux, gxs, gparams)
        ctx.release_scratch()


class FusedReLU:
    """What a fused layer adds to the class of its first part, `part`, which it also subclasses
    (for the facts the parts share: options, parameters, state, aux, shapes): the saved output,
    the cost of both, the kernels by ReLUAfter. `first` is the first part as its own layer."""

    part = None  # the first part's layer class

    @cached_property
    def first(self):
        return self.part(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self.part)})

    def cost(self, in_shapes, phase):
        """The parts' work, less the tensor between them (written once and read once more)."""
        first, relu = self.first.cost(in_shapes, phase), RELU.cost([self.infer_shape(in_shapes)], phase)
        between = 2 * numel(in_shapes[0]) * FLOAT32_BYTES
        return Cost(first.flops + relu.flops, first.bytes + relu.bytes - between)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return ReLUAfter(self, self.first).workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ReLUAfter(self, self.first).forward(ctx, xs, params, state, y, aux, recompute=recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        ReLUAfter(self, self.first).backward(ctx, gy, saved, params, aux, gxs, gparams)


@dataclass(frozen=True)
class BatchNormReLU(FusedReLU, BatchNorm):
    """y = max(BatchNorm(x), 0), the options BatchNorm's. Backward reads x (the mask from
    BatchNorm's output computed again)."""

    type_name = "BatchNormReLU"
    part = BatchNorm
    saves = Saves(inputs=(0,))

    def output_again_bytes(self, in_shapes, itemsize):
        """What output_again needs besides its output: the per-channel scale."""
        return (in_shapes[0][1] * itemsize,)

    def output_again(self, ctx, xs, params, aux, y):
        """y = BatchNorm's training output from x and the saved statistics, as its forward
        computes it ((x - mean) * scale + bias), allocating nothing but a scratch scale."""
        xp, x3, y3 = ctx.xp, by_channel(xs[0]), by_channel(y)
        scale = ctx.scratch(aux["inv_std"].shape, y.dtype)
        if self.affine:
            xp.multiply(params["weight"], aux["inv_std"], out=scale)
        else:
            scale[...] = aux["inv_std"]
        xp.subtract(x3, aux["mean"][:, None], out=y3)
        y3 *= scale[:, None]
        if self.affine:
            y3 += params["bias"][:, None]


@dataclass(frozen=True)
class AddReLU(FusedReLU, Add):
    """y = max(x0 + x1 + ..., 0). Backward reads y (the mask): gx_i = gy * sign(y)."""

    type_name = "AddReLU"
    part = Add
    saves = Saves(output=True)


FUSED_WITH_RELU = {cls.part: cls for cls in (BatchNormReLU, AddReLU)}  # first part's class -> fused class
