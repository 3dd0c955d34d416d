"""Layers that join branches: elementwise sum (residual), product (gates) and channel
concatenation; and the per-channel scale a residual branch may end in."""

import math
from dataclasses import dataclass

from snrt.errors import ShapeError
from snrt.layers.base import BACKWARD, EXPENSIVE, FLOAT32_BYTES, Layer, ParamSpec, Saves, by_channel, numel
from snrt.layers.registry import register


@register
@dataclass(frozen=True)
class Add(Layer):
    """y = x0 + x1 + ...; every input has the same shape; gx_i = gy. Backward reads nothing;
    it writes every input's gradient but those the plan lets take over gy's buffer (in a
    residual block both: nothing to do)."""

    type_name = "Add"
    recompute_cost = EXPENSIVE  # a join: its output is a checkpoint
    min_inputs = 2
    max_inputs = None
    passes_gradient = True

    def infer_shape(self, in_shapes):
        for i, shape in enumerate(in_shapes[1:], start=1):
            if tuple(shape) != tuple(in_shapes[0]):
                raise ShapeError(
                    f"all inputs must have the same shape; input 0 is {list(in_shapes[0][1:])} "
                    f"per sample, input {i} is {list(shape[1:])}"
                )
        return tuple(in_shapes[0])

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.add(xs[0], xs[1], out=y)
        for x in xs[2:]:
            y += x

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        for gx in gxs:
            if gx is not None:
                gx[...] = gy


@register
@dataclass(frozen=True)
class Mul(Layer):
    """y = x * g: x (N, C, ...) times a gate g of the same shape, or of a shape that leaves out
    trailing dims of x or has 1 there, e.g. (N, C) or (N, C, 1, 1) for a channel gate (a
    squeeze-and-excitation block), broadcast over them.

    gx = gy * g; gg = gy * x summed over the broadcast dims. Backward reads both inputs and,
    for a broadcast gate, one scratch tensor of x's size.
    """

    type_name = "Mul"
    recompute_cost = EXPENSIVE  # a join: its output is a checkpoint
    min_inputs = 2
    max_inputs = 2
    saves = Saves(inputs=(0, 1))

    def _gate_shape(self, in_shapes):
        """The gate's shape padded with trailing 1s to x's rank; ShapeError if it cannot broadcast."""
        x, g = tuple(in_shapes[0]), tuple(in_shapes[1])
        padded = g + (1,) * (len(x) - len(g))
        if len(g) > len(x) or any(d not in (1, e) for d, e in zip(padded[1:], x[1:])) or padded[0] != x[0]:
            raise ShapeError(f"the gate (input 1) of per-sample shape {list(g[1:])} does not broadcast to input 0's "
                             f"{list(x[1:])}: give it x's shape, or leave out or set to 1 trailing dims")
        return padded

    def _broadcast_axes(self, in_shapes):
        x, padded = tuple(in_shapes[0]), self._gate_shape(in_shapes)
        return tuple(i for i, (d, e) in enumerate(zip(padded, x)) if d != e)

    def infer_shape(self, in_shapes):
        self._gate_shape(in_shapes)
        return tuple(in_shapes[0])

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return numel(in_shapes[0]) * itemsize if phase == BACKWARD and self._broadcast_axes(in_shapes) else 0

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, g = xs
        ctx.xp.multiply(x, g.reshape(self._gate_shape([x.shape, g.shape])), out=y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, g = saved.xs
        gate_shape = self._gate_shape([x.shape, g.shape])
        if gxs[0] is not None:
            ctx.xp.multiply(gy, g.reshape(gate_shape), out=gxs[0])
        if gxs[1] is None:
            return
        axes, gg = self._broadcast_axes([x.shape, g.shape]), gxs[1].reshape(gate_shape)
        if not axes:
            ctx.xp.multiply(gy, x, out=gg)
            return
        product = ctx.scratch(x.shape, x.dtype)
        ctx.xp.multiply(gy, x, out=product)
        ctx.xp.sum(product, axis=axes, keepdims=True, out=gg)
        ctx.release_scratch()


@register
@dataclass(frozen=True)
class Scale(Layer):
    """y = x * weight[c], a learned factor per channel (axis 1) of (N, C, ...): ConvNeXt's layer
    scale, `init` its starting value (1e-6 there). gx = gy * weight, gweight = sum gy x over
    every axis but the channels (the product in a workspace of x's size); backward reads the
    input. Not weight-decayed."""

    type_name = "Scale"
    saves = Saves(inputs=(0,))
    init: float = 1.0

    def __post_init__(self):
        if isinstance(self.init, bool) or not isinstance(self.init, (int, float)) or not math.isfinite(self.init):
            raise ValueError(f"option 'init' must be a finite number, got {self.init!r}")

    def infer_shape(self, in_shapes):
        if len(in_shapes[0]) < 2:
            raise ShapeError(f"input must have channels (N, C, ...), got {list(in_shapes[0][1:])} per sample")
        return tuple(in_shapes[0])

    def param_specs(self, in_shapes):
        return {"weight": ParamSpec((in_shapes[0][1],), "constant", decay=False, fill=float(self.init))}

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return numel(in_shapes[0]) * itemsize if phase == BACKWARD else 0

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.multiply(by_channel(xs[0]), params["weight"][:, None], out=by_channel(y))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gy3, x3 = by_channel(gy), by_channel(saved.xs[0])
        product = ctx.scratch(x3.shape, x3.dtype)
        ctx.xp.multiply(gy3, x3, out=product)
        ctx.xp.sum(product, axis=(0, 2), out=gparams["weight"])
        ctx.release_scratch()
        if gxs[0] is not None:
            ctx.xp.multiply(gy3, params["weight"][:, None], out=by_channel(gxs[0]))


@register
@dataclass(frozen=True)
class Concat(Layer):
    """Concatenate along `axis` (1, channels, by default); other dims must agree.

    gx_i is the slice of gy that input i filled. Backward reads nothing.
    """

    type_name = "Concat"
    recompute_cost = EXPENSIVE  # a join: its output is a checkpoint
    min_inputs = 2
    max_inputs = None
    axis: int = 1

    def __post_init__(self):
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis < 1:
            raise ValueError(f"option 'axis' must be an int >= 1 (0 is the batch), got {self.axis!r}")

    def infer_shape(self, in_shapes):
        first = tuple(in_shapes[0])
        if self.axis >= len(first):
            raise ShapeError(f"axis {self.axis} is out of range for inputs of rank {len(first)}")
        total = 0
        for i, shape in enumerate(in_shapes):
            rest = tuple(shape[: self.axis]) + tuple(shape[self.axis + 1 :])
            if len(shape) != len(first) or rest != first[: self.axis] + first[self.axis + 1 :]:
                raise ShapeError(
                    f"inputs must agree except on axis {self.axis}; input 0 is {list(first[1:])} "
                    f"per sample, input {i} is {list(shape[1:])}"
                )
            total += shape[self.axis]
        return first[: self.axis] + (total,) + first[self.axis + 1 :]

    def _slices(self, shapes):
        start = 0
        for shape in shapes:
            index = [slice(None)] * len(shape)
            index[self.axis] = slice(start, start + shape[self.axis])
            start += shape[self.axis]
            yield tuple(index)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        for x, index in zip(xs, self._slices([x.shape for x in xs])):
            y[index] = x

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if ctx.in_shapes is None and any(gx is None for gx in gxs):
            raise ValueError("Concat backward without an input's gradient needs the inputs' shapes (ctx.in_shapes) "
                             "for the offsets")
        shapes = ctx.in_shapes or [gx.shape for gx in gxs]
        for gx, index in zip(gxs, self._slices(shapes)):
            if gx is not None:  # an input no parameter reaches (the images) gets no gradient
                gx[...] = gy[index]
