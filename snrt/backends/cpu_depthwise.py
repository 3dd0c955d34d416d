"""Depthwise convolution on the CPU: compiled direct kernels, no column matrix.

A convolution with as many groups as input channels (MobileNetV2's and EfficientNet's 3x3 and
5x5, ConvNeXt's 7x7) has one input channel per group: the layer's im2col and per-group GEMMs
turn each output pixel into a dot product of kh*kw numbers, thousands of tiny GEMMs. Two
direct kernels replace them, each where it measured faster (`ROWS_MIN_WIDTH`, per phase):

- by rows, for outputs at least ROWS_MIN_WIDTH wide: each input plane is copied into a
  zero-padded plane, and each output row is summed in a row buffer (in cache), four taps of a
  kernel row a pass; at stride 1 all the output rows at once, on the padded plane's grid, by
  cpu_tiles.fma_run: 4 vectors of outputs in registers through all kh*kw taps (a broadcast
  and 4 loads a tap, no pass over the buffer per tap; one thread, 8 samples at 56x56: 3x3 over
  144 channels 5.9 -> 3.9 ms, 7x7 over 96 8.1 -> 6.3 ms);
  at stride 1 with one output per input channel the data gradient is the convolution of gy,
  zero-padded, with the flipped taps, summed by fma_run as the forward is (elsewhere it
  scatters tap by tap into a padded plane); the weight gradient takes TAP_BLOCK taps' dot
  products at once over a sample's output rows (cpu_dots.block_dots, one horizontal sum per
  block; at a column stride above 1, a dot product per tap and row). One thread, 8 samples at
  56x56: 3x3 over 144 channels, backward 13.6 -> 7.1 ms (PyTorch 11.2), 7x7 over 96 40 -> 14
  (PyTorch 88). Offsets into the padded planes are unsigned, so the inner loops carry no
  negative-index wraparound and vectorize along the row.
- channels last, for narrower maps (deep in a network, where rows are short and channels
  many): one sample at a time, its input copied as (H, W, O) (input channel o // m repeated
  for each of its m outputs) and its output as (Ho, Wo, O), a channel's plane at a time; each
  output pixel takes the taps that fall inside the map (`pixel_taps`: at 4x4 a 5x5 kernel's
  padding holds half of them) as multiply-adds over a contiguous row of O channels, 4 vectors
  of them in registers through its taps (cpu_tiles.fma_channel_run). 5x5 over 672 channels
  at 4x4, batch 8, one thread: 0.26-0.31 ms with a zero-padded (Hp, Wp, O) input copied a pixel's
  run of channels at a time and every tap taken, 0.17 with the taps inside the map and the
  copies by plane, 0.15 with whole vectors unmasked; 1152 @2 0.16 -> 0.10 (PyTorch 0.11 both).
  The backward copies its input zero-padded as (Hp, Wp, O); its data gradient scatters into a
  padded (Hp, Wp, O) gradient, summed over each input channel's m outputs on the way back.

Weight gradients sum a sample's products (by rows at a column stride above 1, a row's) in the
input's dtype and those sums in float64. x (N, C, H, W), weight (O, 1, kh, kw) with O = C * m,
bias (O,), y (N, O, Ho, Wo); any stride, padding and dilation; every buffer in the planned
workspace. By rows, the channels are split among the kernel threads (cpu_parallel.run_split)
from SPLIT_VALUES input values, each with its own plane and row buffers; channels last, the
forward's samples from SPLIT_PRODUCTS multiply-adds (each thread its own input and output
copies), its backward on one thread (its weight gradient sums over the samples). Sums run in a
fixed order, each channel's on one thread, so the same inputs give the same bits in every run
and policy and on any number of threads.
"""

import numpy as np
from numba import njit, uint64

from snrt.backends.cpu_common import COMPILED, THREADED, LayerLike, fitting_threads
from snrt.backends.cpu_parallel import run_split
from snrt.backends.cpu_copy import copy_run, pad_plane
from snrt.backends.cpu_dots import block_dots
from snrt.backends.cpu_tiles import fma_channel_run, fma_run, run_slack
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, numel, scratch_bytes
from snrt.threads import kernel_threads

# output widths from which rows beat channels last, per phase (best of 100, batch 8: a forward
# from 10 wide: at 8, 5x5 240@8 0.47 against 0.27 ms by channels last on one thread, 0.33
# against 0.21 on two, 3x3 144@8 0.13 against 0.11 and 0.08; at 12, channels last is ahead on
# two threads (5x5 240@12 0.60 against 0.34) and behind on one (0.46 against 0.63), where it
# splits the samples and rows do not split so small an input; the backward, by rows not on the
# plane's grid, from 16)
ROWS_MIN_WIDTH = {FORWARD: 10, BACKWARD: 16}
SPLIT_VALUES = 1 << 20  # inputs of fewer values run on one thread (by rows)
SPLIT_PRODUCTS = 1 << 18  # channels last: forwards of fewer multiply-adds run on one thread
# channels last's forward computes the output channels this many at a time, every output pixel
# of a group before the next group: fma_channel_run's 4 vectors of float32 channels. 5x5 over
# 672 channels at 4x4, batch 8, the multiply-adds alone on one thread: 97 us a pixel's channels
# at a time, 70 by groups of 64 (71 of 128, 85 of 256); 480 at 7x7 260 -> 156, 1152 at 2x2
# 40 -> 32
GROUP_CHANNELS = 64
TAP_BLOCK = 9  # the weight gradient's dot products at once, by rows (tap_dots)
tap_dots = block_dots(1, TAP_BLOCK)


# ---- by rows ------------------------------------------------------------------------------
@njit(inline="always")
def _add_taps(row, plane, top, dw, taps, wo):
    """row[q] += sum over j of taps[j] * plane[top + j*dw + q] for q < wo: four taps a pass
    over the row, three if three are left, then one at a time."""
    kw, j = taps.size, 0
    while j + 4 <= kw:
        t0, t1, t2, t3 = taps[j], taps[j + 1], taps[j + 2], taps[j + 3]
        p0, p1 = plane[top + uint64(j * dw):], plane[top + uint64((j + 1) * dw):]
        p2, p3 = plane[top + uint64((j + 2) * dw):], plane[top + uint64((j + 3) * dw):]
        for q in range(wo):
            row[q] += t0 * p0[q] + t1 * p1[q] + t2 * p2[q] + t3 * p3[q]
        j += 4
    if kw - j == 3:  # a 3x3 kernel's row
        t0, t1, t2 = taps[j], taps[j + 1], taps[j + 2]
        p0, p1 = plane[top + uint64(j * dw):], plane[top + uint64((j + 1) * dw):]
        p2 = plane[top + uint64((j + 2) * dw):]
        for q in range(wo):
            row[q] += t0 * p0[q] + t1 * p1[q] + t2 * p2[q]
        j += 3
    for j in range(j, kw):
        tap, run = taps[j], plane[top + uint64(j * dw):]
        for q in range(wo):
            row[q] += tap * run[q]


@njit(**THREADED)
def rows_forward(x, weight, bias, sh, sw, ph, pw, dh, dw, y, c0, c1, plane, row):
    """y[n, o] = bias[o] + sum over taps (i, j) of weight[o, i, j] * x[n, o // m] at the tap,
    for the outputs o of input channels c0 <= c < c1; weight (O, kh, kw), bias (O,) or empty;
    plane (Hp * Wp + (kw-1)*dw + run_slack,) and row (Ho * Wp + run_slack at stride 1, else
    Wo): workspace. At stride 1 the output is summed on the padded plane's grid by fma_run, Ho
    rows of Wp (the last Wp - Wo of each row unused, as are the values past Ho * Wp)."""
    n, outs, ho, wo = y.shape
    channels, w = x.shape[1], x.shape[3]
    m = outs // channels
    kh, kw = weight.shape[1], weight.shape[2]
    width = w + 2 * pw
    plane[:] = 0.0
    for c in range(c0, c1):
        for s in range(n):
            pad_plane(x, s, c, ph, pw, plane)
            for o in range(c * m, (c + 1) * m):
                b = bias[o] if bias.size else plane.dtype.type(0)
                if sh == 1 and sw == 1:
                    fma_run(plane, kh, kw, dh * width, dw, weight[o].reshape(-1), b, row, ho * width)
                    target = y[s, o].reshape(-1)
                    for r in range(ho):
                        copy_run(target, r * wo, row, r * width, wo)
                    continue
                for r in range(ho):
                    row[:wo] = b
                    for i in range(kh):
                        top = uint64((r * sh + i * dh) * width)
                        if sw == 1:  # contiguous runs, the loops vectorize
                            _add_taps(row, plane, top, dw, weight[o, i], wo)
                        else:
                            for j in range(kw):
                                tap, start = weight[o, i, j], top + uint64(j * dw)
                                for q in range(uint64(wo)):
                                    row[q] += tap * plane[start + q * uint64(sw)]
                    y[s, o, r] = row[:wo]


@njit(**THREADED)
def rows_grad_input(gy, weight, sh, sw, ph, pw, dh, dw, gx, c0, c1, plane):
    """gx[n, c] for c0 <= c < c1 = sum over c's outputs o and taps of weight[o, i, j] * gy[n, o],
    scattered back to the input positions the tap read (in the padded `plane`, whose interior
    is gx)."""
    n, channels, h, w = gx.shape
    outs, ho, wo = gy.shape[1], gy.shape[2], gy.shape[3]
    m = outs // channels
    kh, kw = weight.shape[1], weight.shape[2]
    width = w + 2 * pw
    for c in range(c0, c1):
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


@njit(**THREADED)
def rows_grad_input_gathered(gy, flipped, kh, kw, qh, qw, dh, dw, gx, c0, c1, plane, row):
    """gx[n, c] for c0 <= c < c1 at stride 1 with one output per input channel: the convolution
    of gy[n, c] zero-padded by (qh, qw) = (dh*(kh-1) - ph, dw*(kw-1) - pw) with c's taps
    flipped (flipped (C, kh*kw): weight[c, 0, kh-1-i, kw-1-j] at i*kw + j), summed by fma_run
    on the padded plane's grid as the forward sums its outputs, instead of scattered tap by tap.
    plane ((Ho + 2*qh) * Wq + (kw-1)*dw + run_slack,) and row (H * Wq + run_slack,), Wq = Wo +
    2*qw: workspace."""
    n, _, h, w = gx.shape
    width = gy.shape[3] + 2 * qw
    plane[:] = 0.0
    for c in range(c0, c1):
        for s in range(n):
            pad_plane(gy, s, c, qh, qw, plane)
            fma_run(plane, kh, kw, dh * width, dw, flipped[c], plane.dtype.type(0), row, h * width)
            target = gx[s, c].reshape(-1)
            for r in range(h):
                copy_run(target, r * w, row, r * width, w)


@njit(**THREADED)
def rows_grad_weight(gy, x, sh, sw, ph, pw, dh, dw, gweight, gbias, o0, o1, plane, sums, shifts):
    """gweight[o, 0, i, j] for o0 <= o < o1 = sum over n and output pixels of gy[n, o] *
    x[n, o // m] at the tap; gbias[o] = sum of gy[:, o] (when not empty). At a column stride of
    1, a sample's taps are TAP_BLOCK dot products at a time over all its output rows
    (tap_dots: gy's plane against the padded plane at each tap's shift, one horizontal sum per
    block), else a dot product per tap and output row. sums (kh * kw + 1,) float64 and shifts
    (1 + the taps rounded up to TAP_BLOCK,) int64: workspace (shifts[0] = 0, gy's offset; then
    each tap's shift in the padded plane, the last repeated)."""
    n, outs, ho, wo = gy.shape
    m = outs // x.shape[1]
    kh, kw = gweight.shape[2], gweight.shape[3]
    taps = kh * kw
    width = x.shape[3] + 2 * pw
    shifts[0] = 0
    for t in range(shifts.size - 1):
        k = min(t, taps - 1)
        shifts[1 + t] = (k // kw) * dh * width + (k % kw) * dw
    plane[:] = 0.0
    for o in range(o0, o1):
        sums[:] = 0.0
        for s in range(n):
            pad_plane(x, s, o // m, ph, pw, plane)
            if gbias.size:
                for r in range(ho):
                    row_sum = gy[s, o, r, 0] * 0.0
                    for q in range(uint64(wo)):
                        row_sum += gy[s, o, r, q]
                    sums[taps] += row_sum
            if sw == 1:
                source = gy[s, o].reshape(-1)
                for t0 in range(0, taps, TAP_BLOCK):
                    values = tap_dots(source, shifts[:1], plane, shifts[1 + t0:1 + t0 + TAP_BLOCK], wo, ho, wo,
                                      sh * width)[0]
                    for k in range(min(TAP_BLOCK, taps - t0)):
                        sums[t0 + k] += values[k]
                continue
            for r in range(ho):
                for i in range(kh):
                    top = uint64((r * sh + i * dh) * width)
                    for j in range(kw):
                        start = top + uint64(j * dw)
                        row_sum = gy[s, o, r, 0] * 0.0
                        for q in range(uint64(wo)):
                            row_sum += gy[s, o, r, q] * plane[start + q * uint64(sw)]
                        sums[i * kw + j] += row_sum
        for i in range(kh):
            for j in range(kw):
                gweight[o, 0, i, j] = sums[i * kw + j]
        if gbias.size:
            gbias[o] = sums[taps]


# ---- channels last ------------------------------------------------------------------------



@njit(cache=True)
def _channels_last(x, s, m, ph, pw, padded):
    """padded[r + ph, q + pw, o] = x[s, o // m, r, q]; the border of `padded` (Hp, Wp, O) is
    set to zero."""
    h, w = x.shape[2], x.shape[3]
    padded[:ph] = 0.0
    padded[ph + h:] = 0.0
    padded[:, :pw] = 0.0
    padded[:, pw + w:] = 0.0
    for r in range(h):  # pixel by pixel, each written as one run of channels
        for q in range(w):
            row = padded[r + ph, q + pw]
            for c in range(x.shape[1]):  # no division per value: output o = c*m + k reads channel c
                for k in range(m):
                    row[c * m + k] = x[s, c, r, q]


@njit(cache=True)
def _pixels_last(x, s, m, out):
    """out[r, q, o] = x[s, o // m, r, q]: an (H, W, O) sample, a channel's plane at a time (its
    pixels the inner loop: 8 samples of 672 channels at 4x4 take 26 us, 57 a pixel's run of
    channels at a time)."""
    channels, pixels = x.shape[1], x.shape[2] * x.shape[3]
    planes, rows = x[s].reshape(channels, pixels), out.reshape(pixels, out.shape[2])
    for c in range(channels):
        plane = planes[c]
        for k in range(m):
            o = c * m + k
            for p in range(pixels):
                rows[p, o] = plane[p]


@njit(cache=True)
def _channels_first(rows, y, s):
    """y[s, o, r, q] = rows[r, q, o], an output channel's plane at a time."""
    ho, wo, outs = rows.shape
    planes, pixels = y[s].reshape(outs, ho * wo), rows.reshape(ho * wo, outs)
    for o in range(outs):
        plane = planes[o]
        for p in range(ho * wo):
            plane[p] = pixels[p, o]


@njit(**COMPILED)
def pixel_taps(h, w, ho, wo, kh, kw, sh, sw, ph, pw, dh, dw, outs, shifts, tap_rows, counts):
    """For each output pixel p = r*Wo + q of the (Ho, Wo) output, the taps (i, j) whose input
    pixel lies inside the (H, W) map (the padding's would add zeros): counts[p] of them, in tap
    order, tap_rows[p, k] = i*kw + j and shifts[p, k] = (row*W + column)*O, the input pixel's
    place in an (H, W, O) sample. shifts and tap_rows (Ho*Wo, kh*kw), counts (Ho*Wo,)."""
    for r in range(ho):
        for q in range(wo):
            p, k = r * wo + q, 0
            for i in range(kh):
                row = r * sh - ph + i * dh
                if row < 0 or row >= h:
                    continue
                for j in range(kw):
                    column = q * sw - pw + j * dw
                    if 0 <= column < w:
                        shifts[p, k] = (row * w + column) * outs
                        tap_rows[p, k] = i * kw + j
                        k += 1
            counts[p] = k


@njit(**THREADED)
def channels_last_forward(x, taps, bias, shifts, tap_rows, counts, y, s0, s1, pixels, rows):
    """y[n, o] = bias[o] + sum over taps (i, j) of taps[i, j, o] * x[n, o // m] at the tap, for
    the samples s0 <= n < s1: by groups of GROUP_CHANNELS output channels, each output pixel's
    group by fma_channel_run over the taps inside the map (pixel_taps: shifts, tap_rows and
    counts; a group's slice of the sample and of the taps stays in the first-level cache while
    the group's pixels are computed). taps (kh, kw, O): the weight, channels last; bias (O,) or
    empty; pixels (H, W, O) and rows (Ho, Wo, O): this thread's workspace."""
    outs = y.shape[1]
    m = outs // x.shape[1]
    listed = shifts.shape[1]
    source, out, weights = pixels.reshape(-1), rows.reshape(-1), taps.reshape(-1)
    offsets, tap_row = shifts.reshape(-1), tap_rows.reshape(-1)
    for s in range(s0, s1):
        _pixels_last(x, s, m, pixels)
        for g0 in range(0, outs, GROUP_CHANNELS):
            count = min(GROUP_CHANNELS, outs - g0)
            biases = bias[g0:g0 + count] if bias.size else bias
            for p in range(counts.size):
                first = p * listed
                last = first + counts[p]
                fma_channel_run(source, g0, offsets[first:last], tap_row[first:last], weights[g0:], outs, biases,
                                biases.size, out, p * outs + g0, count)
        _channels_first(rows, y, s)


@njit(**COMPILED)
def channels_last_backward(gy, x, taps, sh, sw, ph, pw, dh, dw, padded, rows, partial, sums, gx, gweight, gbias):
    """The gradients of channels_last_forward (gx and gbias may be empty: not asked for):
    gweight[o, 0, i, j] = sum over samples and output pixels of gy * x at the tap; gbias[o] =
    sum of gy[:, o]; gx[n, c] = the taps' products with gy scattered back to the input pixels
    they read, summed over c's m outputs. Workspace: padded (Hp, Wp, O), rows (Ho, Wo, O),
    partial (kh * kw + 1, O) in x's dtype per sample, sums (kh * kw + 1, O) float64 (the last row:
    the bias's)."""
    n, outs, ho, wo = gy.shape
    channels, h, w = x.shape[1], x.shape[2], x.shape[3]
    m = outs // channels
    kh, kw = taps.shape[0], taps.shape[1]
    sums[:] = 0.0
    for s in range(n):
        _pixels_last(gy, s, 1, rows)
        _channels_last(x, s, m, ph, pw, padded)
        partial[:] = 0.0
        for r in range(ho):
            for q in range(wo):
                grad = rows[r, q]
                for o in range(outs):
                    partial[kh * kw, o] += grad[o]
                for i in range(kh):
                    for j in range(kw):
                        into, source = partial[i * kw + j], padded[r * sh + i * dh, q * sw + j * dw]
                        for o in range(outs):
                            into[o] += grad[o] * source[o]
        for k in range(kh * kw + 1):
            for o in range(outs):
                sums[k, o] += partial[k, o]
        if gx.size:
            padded[:] = 0.0
            for r in range(ho):
                for q in range(wo):
                    grad = rows[r, q]
                    for i in range(kh):
                        for j in range(kw):
                            tap, into = taps[i, j], padded[r * sh + i * dh, q * sw + j * dw]
                            for o in range(outs):
                                into[o] += tap[o] * grad[o]
            for c in range(channels):
                for r in range(h):
                    for q in range(w):
                        total = padded[r + ph, q + pw, c * m]
                        for k in range(1, m):
                            total += padded[r + ph, q + pw, c * m + k]
                        gx[s, c, r, q] = total
    for o in range(gweight.shape[0]):
        for i in range(kh):
            for j in range(kw):
                gweight[o, 0, i, j] = sums[i * kw + j, o]
    for o in range(gbias.shape[0]):
        gbias[o] = sums[kh * kw, o]


class CompiledDepthwiseConv2d(LayerLike):
    """Conv2d with groups equal to its input channels, by rows or channels last (see the module
    docstring), in a workspace of its own (`workspace_bytes`)."""

    @staticmethod
    def serves(layer, in_shapes):
        return layer.groups > 1 and layer.groups == in_shapes[0][1]

    def _workspace_shapes(self, in_shapes, phase, threads):
        """[(shape, dtype: None for the input's)] the kernel carves from its workspace, in order
        (by rows, and channels last's forward: each of `threads` threads' own)."""
        _, _, h, w = in_shapes[0]
        _, outs, ho, wo = self.layer.infer_shape(in_shapes)
        (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
        padded = (h + 2 * ph, w + 2 * pw)
        if wo >= ROWS_MIN_WIDTH[phase]:  # a flat plane, zeros past its end for the last row's taps
            plane = padded[0] * padded[1] + (kw - 1) * self.layer.dilation[1]
            slack = run_slack(FLOAT32_BYTES)  # fma_run's last group of vectors (float64: half of it)
            if phase == BACKWARD:
                shifts = 1 + -(-kh * kw // TAP_BLOCK) * TAP_BLOCK
                sums = [((threads, kh * kw + 1), np.float64), ((threads, shifts), np.int64)]
                gathered = self._gy_padding(in_shapes)
                if gathered is None:
                    return [((threads, plane), None), *sums]
                width = wo + 2 * gathered[1]
                plane = max(plane, (ho + 2 * gathered[0]) * width + (kw - 1) * self.layer.dilation[1]) + slack
                return [((threads, plane), None), *sums, ((threads, h * width + slack), None), ((outs, kh * kw), None)]
            return [((threads, plane + slack), None),
                    ((threads, ho * padded[1] + slack if self.layer.stride == (1, 1) else wo), None)]
        if phase == FORWARD:  # the samples split among the threads
            return [((kh, kw, outs), None), ((ho * wo, kh * kw), np.int64), ((ho * wo, kh * kw), np.int64),
                    ((ho * wo,), np.int64), ((threads, h, w, outs), None), ((threads, ho, wo, outs), None)]
        return [((kh, kw, outs), None), ((*padded, outs), None), ((ho, wo, outs), None),
                ((kh * kw + 1, outs), None), ((kh * kw + 1, outs), np.float64)]

    def _gy_padding(self, in_shapes):
        """(qh, qw), the padding of gy whose convolution with the flipped taps is the data
        gradient (rows_grad_input_gathered), at stride 1 with one output per input channel and
        padding within the taps' reach; None where the gradient is scattered (rows_grad_input)."""
        (kh, kw), (ph, pw), (dh, dw) = self.layer.kernel, self.layer.padding, self.layer.dilation
        qh, qw = dh * (kh - 1) - ph, dw * (kw - 1) - pw
        if self.layer.stride != (1, 1) or self.layer.out_channels != in_shapes[0][1] or qh < 0 or qw < 0:
            return None
        return qh, qw

    def _threads(self, in_shapes, phase):
        """The kernel threads, or one: by rows below SPLIT_VALUES input values; channels last
        below SPLIT_PRODUCTS multiply-adds, for one sample, or backward."""
        out_shape = self.layer.infer_shape(in_shapes)
        if out_shape[3] >= ROWS_MIN_WIDTH[phase]:
            return kernel_threads() if numel(in_shapes[0]) >= SPLIT_VALUES else 1
        products = numel(out_shape) * numel(self.layer.kernel)
        split = phase == FORWARD and products >= SPLIT_PRODUCTS and in_shapes[0][0] > 1
        return kernel_threads() if split else 1

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES, threads=None):
        """The workspace for `threads` threads; by default `_threads`'."""
        if threads is None:
            threads = self._threads(in_shapes, phase)
        shapes = self._workspace_shapes(in_shapes, phase, threads)
        return scratch_bytes(*(numel(shape) * (np.dtype(dtype).itemsize if dtype else itemsize)
                               for shape, dtype in shapes))

    def _workspace(self, ctx, x, phase):
        """The workspace arrays for as many threads as the planned workspace holds."""
        threads = fitting_threads(ctx.workspace.nbytes, lambda count: self.workspace_bytes(
            [x.shape], phase, x.dtype.itemsize, count))
        return [ctx.scratch(shape, dtype or x.dtype) for shape, dtype in self._workspace_shapes([x.shape], phase,
                                                                                                threads)]

    def _geometry(self):
        (sh, sw), (ph, pw), (dh, dw) = self.layer.stride, self.layer.padding, self.layer.dilation
        return sh, sw, ph, pw, dh, dw

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, weight = xs[0], params["weight"]
        bias = params["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        work = self._workspace(ctx, x, FORWARD)
        if len(work) == 2:  # by rows, the input channels split among the threads
            planes, rows = work
            run_split(rows_forward, 0, x.shape[1], len(planes), (x, weight[:, 0], bias, *self._geometry(), y),
                      (planes, rows))
        else:  # channels last, the samples split among the threads
            taps, shifts, tap_rows, counts, pixels, rows = work
            taps[...] = weight[:, 0].transpose(1, 2, 0)
            pixel_taps(*x.shape[2:], *y.shape[2:], *self.layer.kernel, *self._geometry(), y.shape[1], shifts, tap_rows,
                       counts)
            run_split(channels_last_forward, 0, x.shape[0], len(pixels), (x, taps, bias, shifts, tap_rows, counts, y),
                      (pixels, rows))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, weight = saved.xs[0], params["weight"]
        gbias = gparams["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        work = self._workspace(ctx, x, BACKWARD)
        if gy.shape[3] >= ROWS_MIN_WIDTH[BACKWARD]:  # by rows, the (input or output) channels split among the threads
            planes, sums, shifts, *gathering = work
            run_split(rows_grad_weight, 0, gy.shape[1], len(planes), (gy, x, *self._geometry(), gparams["weight"], gbias),
                      (planes, sums, shifts))
            if gxs[0] is not None and gathering:
                rows, flipped = gathering
                flipped[...] = weight[:, 0, ::-1, ::-1].reshape(len(flipped), -1)
                (kh, kw), (dh, dw) = self.layer.kernel, self.layer.dilation
                run_split(rows_grad_input_gathered, 0, x.shape[1], len(planes),
                          (gy, flipped, kh, kw, *self._gy_padding([x.shape]), dh, dw, gxs[0]), (planes, rows))
            elif gxs[0] is not None:
                run_split(rows_grad_input, 0, x.shape[1], len(planes), (gy, weight[:, 0], *self._geometry(), gxs[0]),
                          (planes,))
        else:
            taps, padded, rows, partial, sums = work
            taps[...] = weight[:, 0].transpose(1, 2, 0)
            gx = gxs[0] if gxs[0] is not None else x[:0]  # empty: not asked for
            channels_last_backward(gy, x, taps, *self._geometry(), padded, rows, partial, sums, gx,
                                   gparams["weight"], gbias)
        ctx.release_scratch()
