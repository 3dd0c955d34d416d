"""Fully connected layers and the reshapes that usually precede them."""

import math
from dataclasses import dataclass

from snrt.errors import ShapeError
from snrt.layers.base import EXPENSIVE, FLOAT32_BYTES, Cost, Layer, ParamSpec, Saves, numel
from snrt.layers.registry import register


def _flat_features(shape):
    return numel(shape[1:])


@register
@dataclass(frozen=True)
class Flatten(Layer):
    """(N, d1, d2, ...) -> (N, d1*d2*...). A copy, so that buffers stay independent."""

    type_name = "Flatten"

    def infer_shape(self, in_shapes):
        return (in_shapes[0][0], _flat_features(in_shapes[0]))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        y[...] = xs[0].reshape(y.shape)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if gxs[0] is not None:
            gxs[0][...] = gy.reshape(gxs[0].shape)


@register
@dataclass(frozen=True)
class Reshape(Flatten):
    """(N, ...) -> (N, *shape), the same values in the same order; one entry of `shape` may be
    -1 (inferred). A copy, like Flatten; backward reads nothing."""

    type_name = "Reshape"
    shape: tuple  # required: the per-sample shape, e.g. [64, 7, 7] or [-1]

    def __post_init__(self):
        shape = self.shape
        if (not isinstance(shape, (list, tuple)) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and (d > 0 or d == -1) for d in shape)
                or list(shape).count(-1) > 1):
            raise ValueError(f"option 'shape' must be a list of positive ints with at most one -1, got {shape!r}")
        object.__setattr__(self, "shape", tuple(shape))

    def infer_shape(self, in_shapes):
        size = math.prod(in_shapes[0][1:])
        known = math.prod(d for d in self.shape if d != -1)
        if (-1 in self.shape and size % known) or (-1 not in self.shape and known != size):
            raise ShapeError(f"cannot reshape {list(in_shapes[0][1:])} ({size} values per sample) to {list(self.shape)}")
        return (in_shapes[0][0], *(size // known if d == -1 else d for d in self.shape))


@register
@dataclass(frozen=True)
class Linear(Layer):
    """y = x W^T + b with x (N, in) (trailing dims are flattened), W (out, in), b (out,).

    Backward: gx = gy W, gW = gy^T x, gb = sum_n gy. Reads its input.
    """

    type_name = "Linear"
    recompute_cost = EXPENSIVE
    saves = Saves(inputs=(0,))
    out_features: int
    bias: bool = True

    def __post_init__(self):
        if not isinstance(self.out_features, int) or self.out_features < 1:
            raise ValueError(f"option 'out_features' must be a positive int, got {self.out_features!r}")

    def infer_shape(self, in_shapes):
        if len(in_shapes[0]) < 2:
            raise ShapeError(f"input must have a batch and a feature dimension, got {list(in_shapes[0])}")
        return (in_shapes[0][0], self.out_features)

    def param_specs(self, in_shapes):
        fan_in = _flat_features(in_shapes[0])
        specs = {"weight": ParamSpec((self.out_features, fan_in), "he_normal", fan_in, self.out_features)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_features,), "zeros", fan_in, self.out_features, decay=False)
        return specs

    def cost(self, in_shapes, phase):
        n, fan_in = in_shapes[0][0], _flat_features(in_shapes[0])
        gemm = 2 * n * fan_in * self.out_features
        moved = (n * fan_in + fan_in * self.out_features + n * self.out_features) * FLOAT32_BYTES
        return Cost(gemm, moved) if phase == "forward" else Cost(2 * gemm, 2 * moved)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0].reshape(xs[0].shape[0], -1)
        ctx.xp.matmul(x, params["weight"].T, out=y)
        if self.bias:
            y += params["bias"]

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        xp = ctx.xp
        x = saved.xs[0].reshape(saved.xs[0].shape[0], -1)
        if gxs[0] is not None:
            xp.matmul(gy, params["weight"], out=gxs[0].reshape(x.shape))
        xp.matmul(gy.T, x, out=gparams["weight"])
        if self.bias:
            xp.sum(gy, axis=0, out=gparams["bias"])
