"""2-D pooling over NCHW inputs with PyTorch semantics: max, average, global and adaptive
average, and its inverse, upsampling (nearest and bilinear).

Windowed kernels loop over the kh*kw window offsets; for each offset the output positions
whose window element lies inside the input form one rectangle, so one strided slice of the
input meets one slice of the output (vectorised over N, C, Ho, Wo), and padding is never
materialised.
"""

from dataclasses import dataclass

import numpy as np

from snrt.errors import ShapeError
from snrt.layers.base import (
    BACKWARD,
    FLOAT32_BYTES,
    AuxSpec,
    Cost,
    Layer,
    numel,
    pair,
    scratch_bytes,
    with_reachable_strides,
)
from snrt.layers.registry import register


def _int_pair(value, name, minimum):
    """`pair(value, name)` with both entries >= minimum, or ValueError naming the option."""
    kind = "positive" if minimum == 1 else "non-negative"
    try:
        result = pair(value, name)
    except ValueError:
        result = None
    if result is None or min(result) < minimum:
        raise ValueError(f"option '{name}' must be a {kind} int or pair of {kind} ints, got {value!r}")
    return result


def _check_bool(value, name):
    if not isinstance(value, bool):
        raise ValueError(f"option '{name}' must be true or false, got {value!r}")


def _out_size(size, k, s, p, ceil_mode):
    """PyTorch's pooling output size along one axis (the last window starts inside input or left pad)."""
    out = (size + 2 * p - k + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _axis_span(offset, out_size, in_size, stride, pad):
    """Output indices [lo, hi) whose window element `offset` lies inside the input, and the
    input index of the element for output `lo`."""
    lo = max(0, -(-(pad - offset) // stride))
    hi = min(out_size, (in_size - 1 + pad - offset) // stride + 1)
    return lo, hi, lo * stride - pad + offset


def _window_sizes(xp, out_size, in_size, k, s, p, include_pad):
    """Per output index along one axis: the number of window elements the average divides by."""
    start = xp.arange(out_size) * s - p
    end = xp.minimum(start + k, in_size + p)
    if include_pad:
        return end - start
    return xp.minimum(end, in_size) - xp.maximum(start, 0)


@dataclass(frozen=True)
class _WindowPool(Layer):
    """Shared options, shape inference and window iteration of MaxPool and AvgPool."""

    kernel: int | tuple  # required: int or (kh, kw)
    stride: int | tuple | None = None  # None: the kernel
    padding: int | tuple = 0
    ceil_mode: bool = False

    def __post_init__(self):
        object.__setattr__(self, "kernel", _int_pair(self.kernel, "kernel", 1))
        stride = self.kernel if self.stride is None else self.stride
        object.__setattr__(self, "stride", _int_pair(stride, "stride", 1))
        object.__setattr__(self, "padding", _int_pair(self.padding, "padding", 0))
        _check_bool(self.ceil_mode, "ceil_mode")

    def _geometry(self, in_shapes):
        """(N, C, H, W, Ho, Wo) after validating the input shape against the options."""
        self.require_rank(in_shapes, 4)
        n, c, h, w = in_shapes[0]
        out = []
        for axis, size, k, s, p in zip(("height", "width"), (h, w), self.kernel, self.stride, self.padding):
            if p > k // 2:
                raise ShapeError(f"padding {p} must be at most half the kernel size {k} ({axis})")
            if k > size + 2 * p:
                raise ShapeError(
                    f"{self.type_name} window {k} is larger than the padded input {axis} {size} + 2*{p}"
                )
            out.append(_out_size(size, k, s, p, self.ceil_mode))  # >= 1 once the window fits
        return n, c, h, w, out[0], out[1]

    def infer_shape(self, in_shapes):
        n, c, _, _, ho, wo = self._geometry(in_shapes)
        return (n, c, ho, wo)

    def fitted(self, in_shapes):
        return with_reachable_strides(self, in_shapes, self.kernel)

    def _windows(self, in_shape, out_shape):
        """For each window offset k = i*kw + j: (k, output index, input index) of the
        rectangle of outputs whose element (i, j) lies inside the input."""
        _, _, h, w = in_shape
        ho, wo = out_shape[2:]
        (kh, kw), (sh, sw), (ph, pw) = self.kernel, self.stride, self.padding
        for i in range(kh):
            r0, r1, rx = _axis_span(i, ho, h, sh, ph)
            if r1 <= r0:
                continue
            rows_in = slice(rx, rx + (r1 - r0 - 1) * sh + 1, sh)
            for j in range(kw):
                c0, c1, cx = _axis_span(j, wo, w, sw, pw)
                if c1 <= c0:
                    continue
                cols_in = slice(cx, cx + (c1 - c0 - 1) * sw + 1, sw)
                yield (i * kw + j, (Ellipsis, slice(r0, r1), slice(c0, c1)), (Ellipsis, rows_in, cols_in))

    def _window_cost(self, in_shapes, phase, flops_per_element):
        out = numel(self.infer_shape(in_shapes))
        taps = self.kernel[0] * self.kernel[1]
        moved = (numel(in_shapes[0]) + out) * FLOAT32_BYTES
        return Cost(flops_per_element * taps * out, moved if phase != BACKWARD else 2 * moved)


@register
@dataclass(frozen=True)
class MaxPool(_WindowPool):
    """y[n,c,oh,ow] = max over the window at (oh*s - p, ow*s - p) of the -inf padded input.

    x (N, C, H, W) -> (N, C, Ho, Wo). Aux `argmax` holds the index i*kw + j of the (first)
    maximum within each window; backward scatters gy there and reads nothing else.
    """

    type_name = "MaxPool"

    def _index_dtype(self):
        """(dtype name, itemsize) of the argmax indices."""
        return ("uint8", 1) if self.kernel[0] * self.kernel[1] <= 255 else ("int32", 4)

    def aux_specs(self, in_shapes):
        return {"argmax": AuxSpec(self.infer_shape(in_shapes), self._index_dtype()[0])}

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        out = numel(self.infer_shape(in_shapes))
        if phase == BACKWARD:
            return scratch_bytes(out, out * itemsize)  # bool mask, masked gradient
        return scratch_bytes(out, out * self._index_dtype()[1])  # bool mask, index step

    def cost(self, in_shapes, phase):
        return self._window_cost(in_shapes, phase, 2)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp = ctx.xp
        x, argmax = xs[0], aux["argmax"]
        better = ctx.scratch(y.shape, bool)
        step = ctx.scratch(y.shape, argmax.dtype)
        y.fill(-xp.inf)
        argmax.fill(0)
        # Offsets come in increasing k, so the index of the last strict improvement (the first
        # maximum, as in PyTorch) is the largest k that improved: argmax = max(argmax, k*mask).
        # (Cheaper than copyto(where=), which is slow on strided views.)
        for k, out_idx, in_idx in self._windows(x.shape, y.shape):
            window, best, mask, index = x[in_idx], y[out_idx], better[out_idx], argmax[out_idx]
            xp.greater(window, best, out=mask)
            xp.maximum(best, window, out=best)
            xp.multiply(mask, argmax.dtype.type(k), out=step[out_idx])
            xp.maximum(index, step[out_idx], out=index)
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        xp = ctx.xp
        argmax = aux["argmax"]
        hit = ctx.scratch(gy.shape, bool)
        part = ctx.scratch(gy.shape, gy.dtype)
        gx.fill(0)
        for k, out_idx, in_idx in self._windows(gx.shape, gy.shape):
            xp.equal(argmax[out_idx], k, out=hit[out_idx])
            xp.multiply(gy[out_idx], hit[out_idx], out=part[out_idx])
            gx[in_idx] += part[out_idx]
        ctx.release_scratch()


@register
@dataclass(frozen=True)
class AvgPool(_WindowPool):
    """y[n,c,oh,ow] = sum over the window's elements inside the input / divisor.

    x (N, C, H, W) -> (N, C, Ho, Wo). The divisor is the window size clipped to the padded
    input (count_include_pad) or to the input itself; backward spreads gy / divisor back over
    each window and reads nothing but gy.
    """

    type_name = "AvgPool"
    count_include_pad: bool = True

    def __post_init__(self):
        super().__post_init__()
        _check_bool(self.count_include_pad, "count_include_pad")

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if phase == BACKWARD:
            return scratch_bytes(numel(self.infer_shape(in_shapes)) * itemsize)  # gy / divisor
        return 0

    def cost(self, in_shapes, phase):
        return self._window_cost(in_shapes, phase, 1)

    def _inverse_divisor(self, xp, in_shape, out_shape, dtype):
        """1 / divisor as an (Ho, Wo) array."""
        rows = _window_sizes(xp, out_shape[2], in_shape[2], self.kernel[0], self.stride[0],
                             self.padding[0], self.count_include_pad)
        cols = _window_sizes(xp, out_shape[3], in_shape[3], self.kernel[1], self.stride[1],
                             self.padding[1], self.count_include_pad)
        return (1.0 / (rows[:, None] * cols[None, :])).astype(dtype)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        y.fill(0)
        for _, out_idx, in_idx in self._windows(x.shape, y.shape):
            y[out_idx] += x[in_idx]
        y *= self._inverse_divisor(ctx.xp, x.shape, y.shape, y.dtype)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        scaled = ctx.scratch(gy.shape, gy.dtype)
        ctx.xp.multiply(gy, self._inverse_divisor(ctx.xp, gx.shape, gy.shape, gy.dtype), out=scaled)
        gx.fill(0)
        for _, out_idx, in_idx in self._windows(gx.shape, gy.shape):
            gx[in_idx] += scaled[out_idx]
        ctx.release_scratch()


@register
@dataclass(frozen=True)
class GlobalAvgPool(Layer):
    """(N, C, H, W) -> (N, C): y = mean over H, W; gx = gy / (H*W) broadcast. Reads nothing."""

    type_name = "GlobalAvgPool"

    def infer_shape(self, in_shapes):
        self.require_rank(in_shapes, 4)
        return tuple(in_shapes[0][:2])

    def cost(self, in_shapes, phase):
        size = numel(in_shapes[0])
        return Cost(size, (size + numel(in_shapes[0][:2])) * FLOAT32_BYTES)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        ctx.xp.sum(x.reshape(x.shape[0], x.shape[1], -1), axis=2, out=y)
        y *= 1.0 / (x.shape[2] * x.shape[3])

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is not None:
            ctx.xp.multiply(gy[:, :, None, None], 1.0 / (gx.shape[2] * gx.shape[3]), out=gx)


def adaptive_bins(size, out):
    """PyTorch's adaptive pooling windows along one axis: bin i covers [floor(i size / out),
    ceil((i + 1) size / out)); neighbouring bins overlap when out does not divide size."""
    return [(i * size // out, -(-(i + 1) * size // out)) for i in range(out)]


@register
@dataclass(frozen=True)
class AdaptiveAvgPool(Layer):
    """(N, C, H, W) -> (N, C, oh, ow) with `output` = oh or (oh, ow): each output the mean of its
    bin (PyTorch's adaptive_avg_pool2d bins); gx spreads gy / bin size back over each bin.
    Backward reads nothing (it carves one (N, C) scratch). output 1 is GlobalAvgPool that
    keeps the spatial dims."""

    type_name = "AdaptiveAvgPool"
    output: int | tuple = 1

    def __post_init__(self):
        object.__setattr__(self, "output", _int_pair(self.output, "output", 1))

    def infer_shape(self, in_shapes):
        self.require_rank(in_shapes, 4)
        return (*in_shapes[0][:2], *self.output)

    def _bins(self, shape):
        return [(r, c) for r in adaptive_bins(shape[2], self.output[0]) for c in adaptive_bins(shape[3], self.output[1])]

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        rows, cols = self.output
        for k, ((r0, r1), (c0, c1)) in enumerate(self._bins(x.shape)):
            out = y[:, :, k // cols, k % cols]
            ctx.xp.sum(x[:, :, r0:r1, c0:c1], axis=(2, 3), out=out)
            out *= 1.0 / ((r1 - r0) * (c1 - c0))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        gx[...] = 0
        cols = self.output[1]
        share = ctx.scratch(gx.shape[:2], gx.dtype)
        for k, ((r0, r1), (c0, c1)) in enumerate(self._bins(gx.shape)):
            ctx.xp.multiply(gy[:, :, k // cols, k % cols], 1.0 / ((r1 - r0) * (c1 - c0)), out=share)
            gx[:, :, r0:r1, c0:c1] += share[:, :, None, None]
        ctx.release_scratch()

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return numel(in_shapes[0][:2]) * itemsize if phase == BACKWARD else 0


def bilinear_taps(size, out):
    """(low, high, frac) of PyTorch's bilinear interpolation (align_corners false) along one
    axis, each of `out` values: output i samples the input at (i + 0.5) size / out - 0.5,
    clamped at 0, between input indices low and high (high = low at the last one) with weights
    1 - frac and frac."""
    position = np.maximum((np.arange(out) + 0.5) * (size / out) - 0.5, 0)
    low = np.minimum(np.floor(position).astype(int), size - 1)
    high = np.minimum(low + 1, size - 1)
    return low, high, position - low


def _bilinear_weights(size, out):
    """(out, size) host matrix of the weights of bilinear_taps."""
    low, high, frac = bilinear_taps(size, out)
    weights = np.zeros((out, size))
    np.add.at(weights, (np.arange(out), low), 1 - frac)
    np.add.at(weights, (np.arange(out), high), frac)
    return weights


@register
@dataclass(frozen=True)
class Upsample(Layer):
    """(N, C, H, W) -> (N, C, sH, sW) for an integer `scale` s (or (sh, sw)): `mode` nearest
    repeats each pixel; bilinear interpolates as PyTorch's interpolate(align_corners=False),
    y = Ah x Aw^T per map with fixed (sH, H) and (sW, W) weight matrices. Backward reads
    nothing: gx = the sum of each pixel's copies (nearest), Ah^T gy Aw (bilinear). Bilinear
    carves its weight matrices and one (N, C, sH, W) intermediate from the workspace."""

    type_name = "Upsample"
    scale: int | tuple = 2
    mode: str = "nearest"

    def __post_init__(self):
        object.__setattr__(self, "scale", _int_pair(self.scale, "scale", 1))
        if self.mode not in ("nearest", "bilinear"):
            raise ValueError(f"option 'mode' must be nearest or bilinear, got {self.mode!r}")

    def infer_shape(self, in_shapes):
        self.require_rank(in_shapes, 4)
        n, c, h, w = in_shapes[0]
        return (n, c, h * self.scale[0], w * self.scale[1])

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if self.mode == "nearest":
            return 0
        n, c, h, w = in_shapes[0]
        sh, sw = h * self.scale[0], w * self.scale[1]
        middle = n * c * (sh * w if phase != BACKWARD else h * sw)
        return scratch_bytes(sh * h * itemsize, sw * w * itemsize, middle * itemsize)

    def weight_matrices(self, ctx, shape, dtype):
        """The (sH, H) and (sW, W) bilinear weights, carved from the workspace."""
        h, w = shape[2:]
        rows = ctx.scratch((h * self.scale[0], h), dtype)
        cols = ctx.scratch((w * self.scale[1], w), dtype)
        ctx.upload(rows, _bilinear_weights(h, rows.shape[0]).astype(dtype))
        ctx.upload(cols, _bilinear_weights(w, cols.shape[0]).astype(dtype))
        return rows, cols

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, xp = xs[0], ctx.xp
        sh, sw = self.scale
        if self.mode == "nearest":
            for i in range(sh):
                for j in range(sw):
                    y[:, :, i::sh, j::sw] = x
            return
        rows, cols = self.weight_matrices(ctx, x.shape, x.dtype)
        middle = ctx.scratch((*x.shape[:2], rows.shape[0], x.shape[3]), x.dtype)
        xp.matmul(rows, x, out=middle)  # (sH, H) @ (N, C, H, W)
        xp.matmul(middle, cols.T, out=y)
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx, xp = gxs[0], ctx.xp
        if gx is None:
            return
        sh, sw = self.scale
        if self.mode == "nearest":
            gx[...] = gy[:, :, 0::sh, 0::sw]
            for i in range(sh):
                for j in range(sw):
                    if i or j:
                        gx += gy[:, :, i::sh, j::sw]
            return
        rows, cols = self.weight_matrices(ctx, gx.shape, gx.dtype)
        middle = ctx.scratch((*gx.shape[:2], gx.shape[2], cols.shape[0]), gx.dtype)
        xp.matmul(rows.T, gy, out=middle)  # (H, sH) @ (N, C, sH, sW)
        xp.matmul(middle, cols, out=gx)
        ctx.release_scratch()
