"""Elementwise activations, and Softmax and Identity. No kernel allocates: every expression
is written as in-place ufunc calls on the given buffers and, where an expression needs a
second tensor, on a planned workspace of the input's size (`workspace_bytes`). Each class
states what its backward reads (`saves`): the output where the derivative is a function of
it, the input otherwise."""

import math
from dataclasses import dataclass
from typing import ClassVar

from snrt.errors import ShapeError
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, Layer, Saves, numel
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
class ReLU6(Layer):
    """y = min(max(x, 0), 6) (MobileNet's); gx = gy * [0 < y < 6], the mask as y (6 - y) > 0.
    Any shape. (Masks come from comparisons written out as 1.0 / 0.0: NumPy's sign in place,
    out=its input, runs about 15x slower than a comparison.)"""

    type_name = "ReLU6"
    saves = Saves(output=True)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.clip(xs[0], 0, 6, out=y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is not None:
            ctx.xp.subtract(6, saved.y, out=gx)
            gx *= saved.y
            ctx.xp.greater(gx, 0, out=gx)
            gx *= gy


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
        _sigmoid(ctx.xp, xs[0], y)

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


def _sigmoid(xp, x, out):
    """out = 1 / (1 + exp(-x)) as (1 + tanh(x/2)) / 2: no overflow, no temporary."""
    xp.multiply(x, 0.5, out=out)
    xp.tanh(out, out=out)
    out += 1
    out *= 0.5


class _OneScratch(Layer):
    """Base of activations whose kernels need one scratch tensor of the input's size in the
    phases listed in `scratch_phases`."""

    scratch_phases: ClassVar[tuple] = ()

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return numel(in_shapes[0]) * itemsize if phase in self.scratch_phases else 0

    @staticmethod
    def _scratch(ctx, like):
        return ctx.scratch(like.shape, like.dtype)


@register
@dataclass(frozen=True)
class SiLU(_OneScratch):
    """y = x * sigmoid(x) (Swish); gx = gy * s * (1 + x * (1 - s)) with s = sigmoid(x).
    Backward reads the input and one scratch tensor. Any shape."""

    type_name = "SiLU"
    saves = Saves(inputs=(0,))
    scratch_phases = (BACKWARD,)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        _sigmoid(ctx.xp, xs[0], y)
        y *= xs[0]

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx, x = gxs[0], saved.xs[0]
        if gx is None:
            return
        s = self._scratch(ctx, x)
        _sigmoid(ctx.xp, x, s)
        ctx.xp.subtract(1, s, out=gx)
        gx *= x
        gx += 1
        gx *= s
        gx *= gy
        ctx.release_scratch()


@register
@dataclass(frozen=True)
class ELU(_OneScratch):
    """y = x for x > 0, alpha * (exp(x) - 1) otherwise; gx = gy for y > 0, gy * (y + alpha)
    otherwise. Backward reads the output (and a scratch tensor); forward a scratch tensor."""

    type_name = "ELU"
    saves = Saves(output=True)
    scratch_phases = (FORWARD, BACKWARD)
    alpha: float = 1.0

    def __post_init__(self):
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0 < self.alpha < math.inf:
            raise ValueError(f"option 'alpha' must be a positive number, got {self.alpha!r}")

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp, x = ctx.xp, xs[0]
        negative = self._scratch(ctx, x)
        xp.minimum(x, 0, out=negative)
        xp.expm1(negative, out=negative)
        negative *= self.alpha
        xp.maximum(x, 0, out=y)
        y += negative
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        xp, gx, y = ctx.xp, gxs[0], saved.y
        if gx is None:
            return
        positive = self._scratch(ctx, y)
        xp.greater(y, 0, out=positive)  # 1 where y > 0, else 0
        xp.minimum(y, 0, out=gx)
        gx += self.alpha  # y + alpha where y <= 0, alpha where y > 0 ...
        positive *= 1 - self.alpha
        gx += positive  # ... and 1 there
        gx *= gy
        ctx.release_scratch()


# erf(z) for z >= 0 as 1 - t (a1 + t (a2 + t (a3 + t (a4 + t a5)))) exp(-z^2), t = 1 / (1 + p z)
# (Abramowitz and Stegun 7.1.26, absolute error below 1.5e-7), odd for z < 0.
ERF_P = 0.3275911
ERF_A = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
TANH_GELU_C, TANH_GELU_K = math.sqrt(2 / math.pi), 0.044715


@register
@dataclass(frozen=True)
class GELU(_OneScratch):
    """y = x * Phi(x), Phi the standard normal CDF (PyTorch's GELU): `approximate: none` with
    Phi from erf (to 1.5e-7), or `approximate: tanh`, Phi ~ (1 + tanh(c x (1 + k x^2))) / 2 with
    c = sqrt(2/pi), k = 0.044715. Backward reads the input and recomputes Phi into one scratch
    tensor: gx = gy (Phi + x Phi')."""

    type_name = "GELU"
    saves = Saves(inputs=(0,))
    scratch_phases = (FORWARD, BACKWARD)
    approximate: str = "none"

    def __post_init__(self):
        if self.approximate not in ("none", "tanh"):
            raise ValueError(f"option 'approximate' must be none or tanh, got {self.approximate!r}")

    def _cdf(self, xp, x, out, work):
        """out = Phi(x); `work` (x's shape) is clobbered."""
        if self.approximate == "tanh":
            xp.multiply(x, x, out=out)
            out *= TANH_GELU_K
            out += 1
            out *= x
            out *= TANH_GELU_C
            xp.tanh(out, out=out)
        else:  # erf(z), z = x / sqrt 2, by the formula above on |z|, then its sign
            xp.abs(x, out=out)
            out *= ERF_P / math.sqrt(2)
            out += 1
            xp.reciprocal(out, out=out)  # t
            xp.multiply(out, ERF_A[4], out=work)
            for a in reversed(ERF_A[:4]):  # Horner: work = t (a1 + t (a2 + ...))
                work += a
                work *= out
            xp.multiply(x, x, out=out)
            out *= -0.5
            xp.exp(out, out=out)  # exp(-z^2)
            work *= out
            xp.subtract(1, work, out=out)  # erf(|z|)
            xp.sign(x, out=work)
            out *= work
        out += 1
        out *= 0.5

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        work = self._scratch(ctx, xs[0])
        self._cdf(ctx.xp, xs[0], y, work)
        y *= xs[0]
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        xp, gx, x = ctx.xp, gxs[0], saved.xs[0]
        if gx is None:
            return
        cdf = self._scratch(ctx, x)
        self._cdf(xp, x, cdf, gx)
        if self.approximate == "tanh":
            # Phi + x Phi' = Phi (1 + 4 (1 - Phi) x c (1 + 3 k x^2) / 2), as 1 - tanh^2 = 4 Phi (1 - Phi)
            xp.multiply(x, x, out=gx)
            gx *= 3 * TANH_GELU_K
            gx += 1
            gx *= x
            gx *= 2 * TANH_GELU_C
            xp.subtract(1, cdf, out=cdf)
            gx *= cdf
            gx += 1
            xp.subtract(1, cdf, out=cdf)
            gx *= cdf
        else:  # Phi' = exp(-x^2 / 2) / sqrt(2 pi)
            xp.multiply(x, x, out=gx)
            gx *= -0.5
            xp.exp(gx, out=gx)
            gx *= 1 / math.sqrt(2 * math.pi)
            gx *= x
            gx += cdf
        gx *= gy
        ctx.release_scratch()


@register
@dataclass(frozen=True)
class Identity(Layer):
    """y = x; gx = gy. Backward reads nothing, and writes nothing where the plan lets gx take
    over gy's buffer. Any shape (a named pass-through, e.g. a shortcut written as a layer)."""

    type_name = "Identity"
    passes_gradient = True

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        ctx.xp.copyto(y, xs[0])

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            ctx.xp.copyto(gxs[0], gy)


@register
@dataclass(frozen=True)
class Softmax(Layer):
    """y = exp(x - max) / sum exp(x - max) along `axis` (1, the channels or classes, by
    default); gx = y (gy - sum(gy y)) along it. Backward reads the output; both phases carve
    one scratch tensor of the input's size with `axis` reduced to 1."""

    type_name = "Softmax"
    keeps_fp32 = True
    saves = Saves(output=True)
    axis: int = 1

    def __post_init__(self):
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis < 1:
            raise ValueError(f"option 'axis' must be an int >= 1 (0 is the batch), got {self.axis!r}")

    def _reduced(self, shape):
        if self.axis >= len(shape):
            raise ShapeError(f"axis {self.axis} is out of range for inputs of rank {len(shape)}")
        return tuple(1 if i == self.axis else d for i, d in enumerate(shape))

    def infer_shape(self, in_shapes):
        self._reduced(in_shapes[0])
        return tuple(in_shapes[0])

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return numel(self._reduced(in_shapes[0])) * itemsize

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp, x = ctx.xp, xs[0]
        total = ctx.scratch(self._reduced(x.shape), x.dtype)
        xp.max(x, axis=self.axis, keepdims=True, out=total)
        xp.subtract(x, total, out=y)
        xp.exp(y, out=y)
        xp.sum(y, axis=self.axis, keepdims=True, out=total)
        y /= total
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        xp, gx, y = ctx.xp, gxs[0], saved.y
        if gx is None:
            return
        total = ctx.scratch(self._reduced(y.shape), y.dtype)
        xp.multiply(gy, y, out=gx)
        xp.sum(gx, axis=self.axis, keepdims=True, out=total)
        xp.subtract(gy, total, out=gx)
        gx *= y
        ctx.release_scratch()
