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

Add+ReLU is not fused: its backward would hold y, gy and both input gradients at once, where
each of the two layers' backwards holds three tensors, and that raised the peaks of offload and
superneurons by an activation (ResNet-50 b32 at 224x224: 636 -> 710 MiB, results/fusion.md).
Input gradients can now take over gy's buffer (Layer.passes_gradient, which Add has; in a
residual block both share it), which would keep such a backward at three tensors; the fused
layer is not built.
"""

import dataclasses
from dataclasses import dataclass
from functools import cached_property

from snrt.layers.activation import ReLU
from snrt.layers.base import (BACKWARD, FLOAT32_BYTES, Cost, Saved, Saves, by_channel, numel, scratch_aligned,
                              scratch_bytes)
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
        """The two layers' work, less the tensor between them (written once and read once more)."""
        first, relu = self.first.cost(in_shapes, phase), RELU.cost(in_shapes, phase)
        return Cost(first.flops + relu.flops, first.bytes + relu.bytes - 2 * numel(in_shapes[0]) * FLOAT32_BYTES)

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
