"""Depthwise convolution on the CPU: a compiled direct kernel, no column matrix.

A convolution with as many groups as input channels (MobileNetV2's and EfficientNet's 3x3 and
5x5, ConvNeXt's 7x7) has one input channel per group: the layer's im2col and per-group GEMMs
turn each output pixel into a dot product of kh*kw numbers, thousands of tiny GEMMs. Here
each input plane is copied once into a zero-padded plane, and each output row is summed tap
by tap in a row buffer that stays in cache: for every (i, j) of the kernel, weight[o, i, j]
times the padded row the tap reads. The data gradient scatters the same way into a padded
plane; the weight gradient is a dot product per tap, each row's in float32 and the rows' in
float64. Offsets into the padded planes are unsigned, so the inner loops carry no
negative-index wraparound and vectorize.

x (N, C, H, W), weight (O, 1, kh, kw) with O = C * m (m outputs per input channel), bias (O,),
y (N, O, Ho, Wo); any stride, padding and dilation. Serial like the other CPU kernels (with
numba's OpenMP threads, MobileNetV2 trained at half the speed: they and OpenBLAS's threads take
the two cores from each other). Sums run in a fixed order, so the same inputs give the same
bits in every run and policy.
"""

import numpy as np
from numba import njit, uint64

from snrt.backends.cpu_common import FASTMATH, LayerLike


@njit(cache=True)
def _padded(x, s, c, ph, pw, plane):
    """Copy x[s, c] (H, W) into the interior of `plane`, flat (H + 2ph) x (W + 2pw), whose
    border is zero."""
    h, w = x.shape[2], x.shape[3]
    width = w + 2 * pw
    for r in range(h):
        for q in range(w):
            plane[(r + ph) * width + q + pw] = x[s, c, r, q]


@njit(cache=True, fastmath=FASTMATH)
def depthwise_forward(x, weight, bias, sh, sw, ph, pw, dh, dw, y):
    """y[n, o] = bias[o] + sum over taps (i, j) of weight[o, i, j] * x[n, o // m] at the tap;
    weight (O, kh, kw), bias (O,) or empty. Each input plane is copied once into a zero-padded
    plane; each output row is summed tap by tap in a row of its own (in cache). Offsets are
    unsigned, so the inner loops carry no negative-index wraparound and vectorize."""
    n, outs, ho, wo = y.shape
    channels, h, w = x.shape[1], x.shape[2], x.shape[3]
    m = outs // channels
    kh, kw = weight.shape[1], weight.shape[2]
    width = w + 2 * pw
    for c in range(channels):
        plane = np.zeros((h + 2 * ph) * width, x.dtype)
        row = np.empty(wo, x.dtype)
        for s in range(n):
            _padded(x, s, c, ph, pw, plane)
            for o in range(c * m, (c + 1) * m):
                for r in range(ho):
                    row[:] = bias[o] if bias.size else 0.0
                    for i in range(kh):
                        top = uint64((r * sh + i * dh) * width)
                        for j in range(kw):
                            tap, start = weight[o, i, j], top + uint64(j * dw)
                            for q in range(uint64(wo)):
                                row[q] += tap * plane[start + q * uint64(sw)]
                    for q in range(wo):
                        y[s, o, r, q] = row[q]


@njit(cache=True, fastmath=FASTMATH)
def depthwise_grad_input(gy, weight, sh, sw, ph, pw, dh, dw, gx):
    """gx[n, c] = sum over c's outputs o and taps of weight[o, i, j] * gy[n, o], scattered back
    to the input positions the tap read (into a zero-padded plane, whose interior is gx)."""
    n, channels, h, w = gx.shape
    outs, ho, wo = gy.shape[1], gy.shape[2], gy.shape[3]
    m = outs // channels
    kh, kw = weight.shape[1], weight.shape[2]
    width = w + 2 * pw
    for c in range(channels):
        plane = np.empty((h + 2 * ph) * width, gx.dtype)
        for s in range(n):
            plane[:] = 0.0
            for o in range(c * m, (c + 1) * m):
                for r in range(ho):
                    for i in range(kh):
                        top = uint64((r * sh + i * dh) * width)
                        for j in range(kw):
                            tap, start = weight[o, i, j], top + uint64(j * dw)
                            for q in range(uint64(wo)):
                                plane[start + q * uint64(sw)] += tap * gy[s, o, r, q]
            for r in range(h):
                for q in range(w):
                    gx[s, c, r, q] = plane[(r + ph) * width + q + pw]


@njit(cache=True, fastmath=FASTMATH)
def depthwise_grad_weight(gy, x, sh, sw, ph, pw, dh, dw, gweight, gbias):
    """gweight[o, i, j] = sum over n and output positions of gy[n, o] * x[n, o // m] at the
    tap (each row's sum in float32, the rows' in float64); gbias[o] = sum of gy[:, o] (when
    gbias is not empty)."""
    n, outs, ho, wo = gy.shape
    channels, h, w = x.shape[1], x.shape[2], x.shape[3]
    m = outs // channels
    kh, kw = gweight.shape[1], gweight.shape[2]
    width = w + 2 * pw
    for o in range(outs):
        c = o // m
        plane = np.zeros((h + 2 * ph) * width, x.dtype)
        sums = np.zeros((kh, kw), np.float64)
        bias_sum = 0.0
        for s in range(n):
            _padded(x, s, c, ph, pw, plane)
            for r in range(ho):
                if gbias.size:
                    row_sum = np.float32(0.0)
                    for q in range(uint64(wo)):
                        row_sum += gy[s, o, r, q]
                    bias_sum += row_sum
                for i in range(kh):
                    top = uint64((r * sh + i * dh) * width)
                    for j in range(kw):
                        start = top + uint64(j * dw)
                        row_sum = np.float32(0.0)
                        for q in range(uint64(wo)):
                            row_sum += gy[s, o, r, q] * plane[start + q * uint64(sw)]
                        sums[i, j] += row_sum
        for i in range(kh):
            for j in range(kw):
                gweight[o, i, j] = sums[i, j]
        if gbias.size:
            gbias[o] = bias_sum


class CompiledDepthwiseConv2d(LayerLike):
    """Conv2d with groups equal to its input channels, by the kernels above."""

    @staticmethod
    def serves(layer, in_shapes):
        return layer.groups > 1 and layer.groups == in_shapes[0][1]

    def _geometry(self):
        (sh, sw), (ph, pw), (dh, dw) = self.layer.stride, self.layer.padding, self.layer.dilation
        return sh, sw, ph, pw, dh, dw

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        weight = params["weight"]
        bias = params["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        depthwise_forward(xs[0], weight[:, 0], bias, *self._geometry(), y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        weight = params["weight"]
        if gxs[0] is not None:
            depthwise_grad_input(gy, weight[:, 0], *self._geometry(), gxs[0])
        gbias = gparams["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        depthwise_grad_weight(gy, saved.xs[0], *self._geometry(), gparams["weight"][:, 0], gbias)
