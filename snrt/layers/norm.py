"""Normalisation layers: batch, group and layer normalisation, and cross-channel local response
normalisation."""

import math
from dataclasses import dataclass

from snrt.errors import ShapeError
from snrt.layers.base import (
    BACKWARD,
    FLOAT32_BYTES,
    AuxSpec,
    Cost,
    Layer,
    ParamSpec,
    Saves,
    StateSpec,
    by_channel,
    numel,
    scratch_bytes,
)
from snrt.layers.registry import register


def _check_number(value, name, low, low_inclusive=True, high=None):
    """Raise ValueError naming the option unless `value` is a real number in the given range."""
    ok = not isinstance(value, bool) and isinstance(value, (int, float))
    if ok:
        ok = value >= low if low_inclusive else value > low
        ok = ok and (high is None or value <= high)
    if not ok:
        bound = f"{'>=' if low_inclusive else '>'} {low}" + ("" if high is None else f" and <= {high}")
        raise ValueError(f"option '{name}' must be a number {bound}, got {value!r}")


def _per_channel_dot(xp, a, b):
    """sum over every axis but 1 of a * b, for (N, C, K) arrays, without a full-size temporary."""
    return xp.einsum("nck,nck->c", a, b)


@register
@dataclass(frozen=True)
class BatchNorm(Layer):
    """y = weight * (x - mean) * inv_std + bias per channel (axis 1) of (N, C, H, W) or (N, C).

    Training: mean and biased variance over N, H, W (M = N*H*W values per channel), running
    statistics updated as running = (1 - momentum) * running + momentum * batch with the
    unbiased variance (not on a recomputed forward). Eval: running statistics. Aux `mean` and
    `inv_std` = 1/sqrt(var + eps) are the statistics used. Backward reads the input:
    gx = weight*inv_std * (gy - sum(gy)/M - xhat * sum(gy*xhat)/M) in training, weight*inv_std*gy
    in eval; gweight = sum(gy*xhat), gbias = sum(gy).
    """

    type_name = "BatchNorm"
    saves = Saves(inputs=(0,))
    fp32_aux = ("mean", "inv_std")  # statistics
    momentum: float = 0.1
    eps: float = 1e-5
    zero_init: bool = False  # scale starts at 0: a residual branch starts as nothing (Goyal et al. 2017)
    affine: bool = True  # a learned per-channel weight and bias

    def __post_init__(self):
        _check_number(self.momentum, "momentum", 0, high=1)
        _check_number(self.eps, "eps", 0, low_inclusive=False)
        for name in ("zero_init", "affine"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"option '{name}' must be true or false, got {getattr(self, name)!r}")
        if self.zero_init and not self.affine:
            raise ValueError("option 'zero_init' needs a weight to start at 0; it cannot go with 'affine: false'")

    def _channels(self, in_shapes):
        shape = tuple(in_shapes[0])
        if len(shape) not in (2, 4):
            raise ShapeError(f"input must be NCHW or (N, C), got {list(shape[1:])} per sample")
        return shape[1]

    def check_training(self, in_shapes):
        n, _, *spatial = in_shapes[0]
        count = n * math.prod(spatial)
        if count < 2:
            raise ValueError(f"BatchNorm needs more than 1 value per channel when training; input {tuple(in_shapes[0])} "
                             f"gives {count} (use a larger batch or image size)")

    def infer_shape(self, in_shapes):
        self._channels(in_shapes)
        return tuple(in_shapes[0])

    def param_specs(self, in_shapes):
        c = self._channels(in_shapes)
        if not self.affine:
            return {}
        return {
            "weight": ParamSpec((c,), "zeros" if self.zero_init else "ones", decay=False),
            "bias": ParamSpec((c,), "zeros", decay=False),
        }

    def state_specs(self, in_shapes):
        c = self._channels(in_shapes)
        return {"running_mean": StateSpec((c,), 0.0), "running_var": StateSpec((c,), 1.0)}

    def aux_specs(self, in_shapes):
        c = self._channels(in_shapes)
        return {"mean": AuxSpec((c,)), "inv_std": AuxSpec((c,))}

    def cost(self, in_shapes, phase):
        size = numel(in_shapes[0])
        if phase == BACKWARD:  # read x and gy (twice: statistics, then gx), write gx
            return Cost(7 * size, 5 * size * FLOAT32_BYTES)
        return Cost(6 * size, 3 * size * FLOAT32_BYTES)  # read x twice, write y

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp = ctx.xp
        x3, y3 = by_channel(xs[0]), by_channel(y)
        mean, inv_std = aux["mean"], aux["inv_std"]
        if ctx.training:
            self.check_training([xs[0].shape])
            count = x3.shape[0] * x3.shape[2]
            xp.sum(x3, axis=(0, 2), out=mean)
            mean *= 1.0 / count
            xp.subtract(x3, mean[:, None], out=y3)
            var = _per_channel_dot(xp, y3, y3) / count
            xp.add(var, self.eps, out=inv_std)
            if not recompute:
                blend_running(state["running_mean"], mean, self.momentum)
                blend_running(state["running_var"], var * (count / (count - 1)), self.momentum)
        else:
            mean[...] = state["running_mean"]
            xp.add(state["running_var"], self.eps, out=inv_std)
        xp.sqrt(inv_std, out=inv_std)
        xp.divide(1, inv_std, out=inv_std)
        scale = self._scale(params, inv_std)[:, None]
        if ctx.training:
            y3 *= scale
            if self.affine:
                y3 += params["bias"][:, None]
        else:
            xp.multiply(x3, scale, out=y3)
            shift = -mean * scale[:, 0]
            y3 += (shift + params["bias"] if self.affine else shift)[:, None]

    def _scale(self, params, inv_std):
        """weight * inv_std per channel (inv_std itself without an affine part)."""
        return params["weight"] * inv_std if self.affine else inv_std

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        xp = ctx.xp
        x3, gy3 = by_channel(saved.xs[0]), by_channel(gy)
        mean, inv_std = aux["mean"], aux["inv_std"]
        count = x3.shape[0] * x3.shape[2]
        sum_gy = xp.sum(gy3, axis=(0, 2))
        sum_gy_xhat = (_per_channel_dot(xp, gy3, x3) - mean * sum_gy) * inv_std
        if self.affine:
            gparams["weight"][...] = sum_gy_xhat
            gparams["bias"][...] = sum_gy
        if gxs[0] is None:
            return
        gx3 = by_channel(gxs[0])
        scale = self._scale(params, inv_std)[:, None]
        if not ctx.training:  # the statistics are constants: an affine map
            xp.multiply(gy3, scale, out=gx3)
            return
        # gx / scale = gy + x * c1 + c0 with c1 = -inv_std * sum(gy*xhat) / M
        c1 = -inv_std * sum_gy_xhat / count
        xp.multiply(x3, c1[:, None], out=gx3)
        gx3 += (-mean * c1 - sum_gy / count)[:, None]
        gx3 += gy3
        gx3 *= scale


def blend_running(running, batch, momentum):
    """running <- (1 - momentum) * running + momentum * batch, in place."""
    running *= 1 - momentum
    running += momentum * batch


def _channel_window_sum(src, out, before, after):
    """out[:, c] = sum of src[:, c - before .. c + after] (zero outside the channels)."""
    out[...] = src
    channels = src.shape[1]
    for d in range(1, min(after, channels - 1) + 1):
        out[:, : channels - d] += src[:, d:]
    for d in range(1, min(before, channels - 1) + 1):
        out[:, d:] += src[:, : channels - d]


@register
@dataclass(frozen=True)
class LRN(Layer):
    """Cross-channel local response normalisation (torch.nn.LocalResponseNorm), x (N, C, ...).

    s_c = k + alpha/size * sum_{j=c-size//2}^{c+(size-1)//2} x_j^2 (zero padded), y = x * s^-beta.
    Backward reads x and y (s is recomputed from x):
    gx_i = gy_i s_i^-beta - 2 alpha beta / size * x_i * sum_{c: i in window(c)} gy_c y_c / s_c.
    """

    type_name = "LRN"
    saves = Saves(inputs=(0,), output=True)
    size: int = 5
    alpha: float = 1e-4
    beta: float = 0.75
    k: float = 1.0

    def __post_init__(self):
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"option 'size' must be a positive int, got {self.size!r}")
        _check_number(self.alpha, "alpha", 0)
        _check_number(self.beta, "beta", 0)
        _check_number(self.k, "k", 0, low_inclusive=False)

    def infer_shape(self, in_shapes):
        shape = tuple(in_shapes[0])
        if len(shape) < 3:
            raise ShapeError(f"input must be (N, C, ...) with spatial dims, got {list(shape[1:])} per sample")
        return shape

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        full = numel(in_shapes[0]) * itemsize
        return scratch_bytes(full, full) if phase == BACKWARD else scratch_bytes(full)

    def cost(self, in_shapes, phase):
        size = numel(in_shapes[0])
        if phase == BACKWARD:  # read x, y, gy, write gx
            return Cost((2 * self.size + 12) * size, 4 * size * FLOAT32_BYTES)
        return Cost((self.size + 6) * size, 2 * size * FLOAT32_BYTES)

    def _scale(self, xp, x, squares, out):
        """out <- s = k + alpha/size * window sum of x^2 (`squares` is scratch)."""
        xp.multiply(x, x, out=squares)
        _channel_window_sum(squares, out, self.size // 2, (self.size - 1) // 2)
        out *= self.alpha / self.size
        out += self.k

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp = ctx.xp
        x = xs[0]
        self._scale(xp, x, ctx.scratch(x.shape, x.dtype), y)
        xp.power(y, -self.beta, out=y)
        y *= x
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        xp = ctx.xp
        x, y = saved.xs[0], saved.y
        t = ctx.scratch(x.shape, x.dtype)
        s = ctx.scratch(x.shape, x.dtype)
        self._scale(xp, x, t, s)
        xp.multiply(gy, y, out=t)
        t /= s  # gy_c y_c / s_c
        _channel_window_sum(t, gx, (self.size - 1) // 2, self.size // 2)
        gx *= x
        gx *= -2.0 * self.alpha * self.beta / self.size
        xp.power(s, -self.beta, out=s)
        s *= gy
        gx += s
        ctx.release_scratch()


class _Normalize(Layer):
    """Per-sample normalisation with a learned per-channel scale and shift (no running
    statistics, the same in training and eval). A subclass says which values share statistics
    by viewing x as (A, R, B): statistics over R for every (a, b), kept as aux `mean` and
    `inv_std` (A, 1, B). The affine part acts on the (N, C, K) view.

    Backward reads the input and the aux: with xhat = (x - mean) inv_std and gh = gy * weight,
    gx = inv_std (gh - mean_R(gh) - xhat mean_R(gh xhat)); gweight = sum gy xhat, gbias = sum gy
    over every axis but the channels. One scratch tensor of x's size in both phases (and two of
    the statistics' size in backward); no other allocation.
    """

    saves = Saves(inputs=(0,))
    fp32_aux = ("mean", "inv_std")  # statistics

    def _view(self, shape):
        """(A, R, B) of x's `shape`, statistics over R."""
        raise NotImplementedError

    def _check(self, in_shapes):
        if len(in_shapes[0]) < 2:
            raise ShapeError(f"input must have channels (N, C, ...), got {list(in_shapes[0][1:])} per sample")

    def infer_shape(self, in_shapes):
        self._check(in_shapes)
        self._view(tuple(in_shapes[0]))
        return tuple(in_shapes[0])

    def _stats_shape(self, shape):
        a, _, b = self._view(shape)
        return (a, 1, b)

    def param_specs(self, in_shapes):
        c = in_shapes[0][1]
        return {"weight": ParamSpec((c,), "ones", decay=False), "bias": ParamSpec((c,), "zeros", decay=False)}

    def aux_specs(self, in_shapes):
        stats = self._stats_shape(tuple(in_shapes[0]))
        return {"mean": AuxSpec(stats), "inv_std": AuxSpec(stats)}

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        size = numel(in_shapes[0]) * itemsize
        if phase == BACKWARD:
            stats = numel(self._stats_shape(tuple(in_shapes[0]))) * itemsize
            return scratch_bytes(size, stats, stats)
        return size

    def cost(self, in_shapes, phase):
        size = numel(in_shapes[0])
        if phase == BACKWARD:
            return Cost(12 * size, 7 * size * FLOAT32_BYTES)
        return Cost(8 * size, 4 * size * FLOAT32_BYTES)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp, x = ctx.xp, xs[0]
        view = self._view(x.shape)
        x3, y3, mean, inv_std = x.reshape(view), y.reshape(view), aux["mean"], aux["inv_std"]
        work = ctx.scratch(view, x.dtype)
        xp.sum(x3, axis=1, keepdims=True, out=mean)
        mean *= 1.0 / view[1]
        xp.subtract(x3, mean, out=y3)
        xp.multiply(y3, y3, out=work)
        xp.sum(work, axis=1, keepdims=True, out=inv_std)
        inv_std *= 1.0 / view[1]
        inv_std += self.eps
        xp.sqrt(inv_std, out=inv_std)
        xp.reciprocal(inv_std, out=inv_std)
        y3 *= inv_std
        y_c = by_channel(y)
        y_c *= params["weight"][:, None]
        y_c += params["bias"][:, None]
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        xp, x, gx = ctx.xp, saved.xs[0], gxs[0]
        view = self._view(x.shape)
        mean, inv_std = aux["mean"], aux["inv_std"]
        work = ctx.scratch(view, x.dtype)  # (A, R, B)
        s1, s2 = ctx.scratch(mean.shape, x.dtype), ctx.scratch(mean.shape, x.dtype)
        xp.subtract(x.reshape(view), mean, out=work)
        work *= inv_std  # xhat
        gy_c, weight = by_channel(gy), params["weight"][:, None]
        xp.sum(gy_c, axis=(0, 2), out=gparams["bias"])
        gx3 = None if gx is None else gx.reshape(view)
        if gx3 is not None:
            gx3[...] = work  # gx holds xhat from here on
        work_c = work.reshape(gy_c.shape)
        work_c *= gy_c
        xp.sum(work_c, axis=(0, 2), out=gparams["weight"])  # sum gy xhat
        if gx is None:
            ctx.release_scratch()
            return
        xp.multiply(gy_c, weight, out=work_c)  # work holds gh = gy * weight
        xp.sum(work, axis=1, keepdims=True, out=s1)
        work *= gx3  # gh * xhat
        xp.sum(work, axis=1, keepdims=True, out=s2)
        s1 *= -1.0 / view[1]
        s2 *= -1.0 / view[1]
        gx3 *= s2  # -xhat mean(gh xhat)
        xp.multiply(gy_c, weight, out=work.reshape(gy_c.shape))  # gh again
        gx3 += work
        gx3 += s1
        gx3 *= inv_std
        ctx.release_scratch()


@register
@dataclass(frozen=True)
class GroupNorm(_Normalize):
    """Group normalisation (Wu and He 2018, torch.nn.GroupNorm): the C channels of x (N, C, ...)
    in `groups` groups of C/groups; mean and variance over each sample's group (its channels
    and positions), then a per-channel scale and shift. groups 1 normalises each sample as a
    whole, groups = C each channel (instance normalisation)."""

    type_name = "GroupNorm"
    groups: int  # required
    eps: float = 1e-5

    def __post_init__(self):
        if isinstance(self.groups, bool) or not isinstance(self.groups, int) or self.groups < 1:
            raise ValueError(f"option 'groups' must be a positive int, got {self.groups!r}")
        _check_number(self.eps, "eps", 0, low_inclusive=False)

    def _view(self, shape):
        n, c = shape[:2]
        if c % self.groups:
            raise ShapeError(f"{c} channels do not split into {self.groups} groups")
        return (n * self.groups, numel(shape[1:]) // self.groups, 1)


@register
@dataclass(frozen=True)
class LayerNorm(_Normalize):
    """Layer normalisation over the channels (axis 1) at every position, with a per-channel
    scale and shift: for (N, C) features torch.nn.LayerNorm(C), for (N, C, H, W) feature maps
    the channels-first LayerNorm of ConvNeXt."""

    type_name = "LayerNorm"
    eps: float = 1e-6

    def __post_init__(self):
        _check_number(self.eps, "eps", 0, low_inclusive=False)

    def _view(self, shape):
        return (shape[0], shape[1], numel(shape[2:]))
