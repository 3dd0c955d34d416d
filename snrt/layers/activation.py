"""Elementwise activations. Each backward reads only the output, and no kernel allocates:
every expression is written as in-place ufunc calls on the given buffers."""

from dataclasses import dataclass

from snrt.layers.base import Layer, Saves
from snrt.layers.registry import register


@register
@dataclass(frozen=True)
class ReLU(Layer):
    """y = max(x, 0); gx = gy * [y > 0]. Any shape."""

    type_name = "ReLU"
    saves = Saves(output=True)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.maximum(xs[0], 0, out=y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            ctx.xp.sign(saved.y, out=gxs[0])  # y >= 0, so sign(y) is the 0/1 mask
            gxs[0] *= gy


@register
@dataclass(frozen=True)
class LeakyReLU(Layer):
    """y = x if x > 0 else slope * x, with 0 < slope < 1 (slope 0 is ReLU); gx = gy * (1 or slope)."""

    type_name = "LeakyReLU"
    saves = Saves(output=True)
    slope: float = 0.01

    def __post_init__(self):
        if isinstance(self.slope, bool) or not isinstance(self.slope, (int, float)) or not 0 < self.slope < 1:
            raise ValueError(f"option 'slope' must be a number in (0, 1) (use ReLU for 0), got {self.slope!r}")

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.multiply(xs[0], self.slope, out=y)
        ctx.xp.maximum(xs[0], y, out=y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        # slope > 0, so y has the sign of x: map sign(y) = +1 / -1 to 1 / slope (0 maps between).
        ctx.xp.sign(saved.y, out=gx)
        gx *= (1 - self.slope) / 2
        gx += (1 + self.slope) / 2
        gx *= gy


@register
@dataclass(frozen=True)
class Sigmoid(Layer):
    """y = 1 / (1 + exp(-x)), computed as (1 + tanh(x/2)) / 2 (no overflow); gx = gy y (1-y)."""

    type_name = "Sigmoid"
    saves = Saves(output=True)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.multiply(xs[0], 0.5, out=y)
        ctx.xp.tanh(y, out=y)
        y += 1
        y *= 0.5

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is not None:
            ctx.xp.subtract(1, saved.y, out=gx)
            gx *= saved.y
            gx *= gy


@register
@dataclass(frozen=True)
class Tanh(Layer):
    """y = tanh(x); gx = gy (1 - y^2). Any shape."""

    type_name = "Tanh"
    saves = Saves(output=True)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.tanh(xs[0], out=y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is not None:
            ctx.xp.multiply(saved.y, saved.y, out=gx)
            ctx.xp.subtract(1, gx, out=gx)
            gx *= gy
