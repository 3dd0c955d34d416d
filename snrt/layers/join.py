"""Layers that join branches: elementwise sum (residual) and channel concatenation."""

from dataclasses import dataclass

from snrt.errors import ShapeError
from snrt.layers.base import EXPENSIVE, Layer
from snrt.layers.registry import register


@register
@dataclass(frozen=True)
class Add(Layer):
    """y = x0 + x1 + ...; every input has the same shape; gx_i = gy. Backward reads nothing."""

    type_name = "Add"
    recompute_cost = EXPENSIVE  # a join: its output is a checkpoint
    min_inputs = 2
    max_inputs = None

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
        shapes = [gx.shape for gx in gxs if gx is not None]
        if len(shapes) != len(gxs):
            raise ValueError("Concat backward needs every input gradient buffer (for the offsets)")
        for gx, index in zip(gxs, self._slices(shapes)):
            gx[...] = gy[index]
