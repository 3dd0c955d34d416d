"""Fused layers: a BatchNorm or an Add with the ReLU that alone reads its output, as one node.

The planner makes them (snrt/scheduler/fuse.py); a network file never names them. A fused node
is one step each way with one output, y = max(first(x...), 0), and it saves what the fusion
needs, not what its parts did: the first part's saved inputs and y, whose sign is ReLU's mask.
The tensor between the parts and its gradient are never planned.

- forward: the first part writes y, ReLU then runs in place on it;
- backward: g = gy * sign(y) (ReLU's gradient), then the first part's backward from g. g goes
  into scratch for BatchNorm, and into an input gradient for Add, whose backward copies its
  output gradient to each input's (one of them then already holds it). BatchNorm's and Add's
  backwards never read their output, so y stands in for it.

These are the same operations in the same order as the two layers unfused, so a fused plan
computes the same bits as an unfused one. `ReLUAfter` composes any kernel of the first part
with any kernel of ReLU: the layers' own code uses it with the layers, the CUDA backend with its
kernels (snrt/backends/cuda_kernels.py); the CPU's compiled kernels apply the ReLU inside their
own passes instead (snrt/backends/cpu_kernels.py, cpu_join.py).
"""

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from snrt.layers.activation import ReLU
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, Cost, Saved, Saves, numel, scratch_aligned
from snrt.layers.join import Add
from snrt.layers.norm import BatchNorm

RELU = ReLU()


class ReLUAfter:
    """The kernel of fused layer `layer` from `first`, a kernel of its first part, and `relu`,
    a kernel of ReLU (layer-like: `forward`, `backward` and `workspace_bytes` as a layer's).
    Workspace: the first part's, and in backward, unless the layer's masked gradient goes into
    an input gradient (`masks_into_input_gradient`), that gradient (gy's size) before it."""

    def __init__(self, layer, first, relu=RELU):
        self.first, self.relu, self.in_place = first, relu, layer.masks_into_input_gradient

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        first = self.first.workspace_bytes(in_shapes, phase, itemsize)
        if phase != BACKWARD or self.in_place:
            return first
        return scratch_aligned(numel(in_shapes[0]) * itemsize) + first

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.first.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        self.relu.forward(ctx, [y], {}, {}, y, {})

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        targets = [gx for gx in gxs if gx is not None]
        if not targets and not gparams:
            return
        g = targets[0] if self.in_place and targets else ctx.scratch(gy.shape, gy.dtype)
        self.relu.backward(ctx, gy, Saved((None,), saved.y), {}, {}, [g], {})
        self.first.backward(ctx.rest(), g, Saved(saved.xs, None), params, aux, gxs, gparams)
        ctx.release_scratch()


class FusedReLU:
    """What a fused layer adds to the class of its first part, `part`, which it also subclasses
    (for the facts the parts share: options, parameters, state, aux, shapes): the saved output,
    the cost of both, the kernels by ReLUAfter. `first` is the first part as its own layer."""

    part = None  # the first part's layer class
    masks_into_input_gradient = False  # whether the first part's backward may read gy from an input gradient

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
    """y = max(BatchNorm(x), 0), the options BatchNorm's. Backward reads x and y (the mask)."""

    type_name = "BatchNormReLU"
    part = BatchNorm
    saves = Saves(inputs=(0,), output=True)


@dataclass(frozen=True)
class AddReLU(FusedReLU, Add):
    """y = max(x0 + x1 + ..., 0). Backward reads y (the mask): gx_i = gy * sign(y)."""

    type_name = "AddReLU"
    part = Add
    masks_into_input_gradient = True  # Add's backward copies gy into each input gradient
    saves = Saves(output=True)


FUSED_WITH_RELU = {cls.part: cls for cls in (BatchNormReLU, AddReLU)}  # first part's class -> fused class
