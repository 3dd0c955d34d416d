"""Dense convolution on the CPU without the column matrix: compiled dot products over rows
stacked channels last.

The layer's im2col copies every input value kh*kw times into a column matrix before its
GEMM; for 3x3 kernels on small maps (CIFAR's ResNets) that copy costs as much as the GEMM.
Here each band of output rows packs its input once, channels last and zero-padded, with
the kh input rows each output row reads stacked side by side:

    stacked[r*Wp + q, i*C + c] = xpad[n, c, h + i, q]     (output row r = (n, h), 0 <= q < Wp)

so that output pixel (h, w)'s whole window, over (j, i, c), is the one contiguous run
stacked[r*Wp + w : r*Wp + w + kw, :] of K = kw*kh*C numbers, and its value one dot product
with the weight repacked as wt[o, (j, i, c)] = W[o, c, i, j]. The kernel computes 4 pixels
by 4 output channels at a time: 16 dot products in one loop over K (cpu_dots.dots4x4: 16
vector accumulators, 8 loads for 16 multiply-adds, summed across their lanes together). The
packing lays each input row out channels last once (a band keeps the kh - 1 rows the next
band of the sample reads again) and moves each value kh times, in cache, where im2col
writes kh*kw copies to memory.

- forward: y = conv(x, W) + b, output rows split evenly among the kernel threads; at stride
  1 by the broadcast multiply-add tiles of cpu_tiles (vectors of output pixels, faster than
  the dot products here wherever a map is at least a vector wide), at a larger stride by the
  stacked rows above, each thread packing and computing its own bands of `BAND_ROWS` rows
  in buffers of its own;
- data gradient: for stride 1, gx is the convolution of gy zero-padded by (kh-1-ph,
  kw-1-pw) with the flipped, transposed weight W'[c, o, i, j] = W[o, c, kh-1-i, kw-1-j],
  so the tiles compute it too;
- weight gradient: x is copied into zero-padded planes, channel by channel with the samples
  one after the other, xp[c, t] for t = n*Hp*Wp + h*Wp + w, x[n, c, h - ph, w - pw] at (h, w),
  and gy likewise into gp[o, t] at the top left of the same Hp x Wp planes, zeros around it.
  One gap of zeros after each row (and after a sample's last row) pads both sides, so
  Hp = H + max(ph, kh-1-ph) and Wp = W + max(pw, kw-1-pw): 9 x 9 planes for 8 x 8 maps and
  a 3x3 kernel, not 10 x 10. Then

      gW[o, c, i, j] = sum over t of gp[o, t] * xp[c, t + i*Wp + j]

  since output pixel (h, w)'s window element (i, j) is xp at its t shifted by i*Wp + j, and gp
  is 0 wherever t is no output pixel: one long dot product of two contiguous rows per weight,
  across all the samples of a chunk (`GRAD_WEIGHT_ELEMENTS` padded values of x and gy). The
  kernel computes 4 output channels by 4 taps (c, i, j) at a time, 16 dot products in one
  loop (8 loads for 16 multiply-adds, one horizontal sum per chunk); the blocks are split among
  the threads, the chunks summed in order. A tap past an output row's end meets gp's zeros, so
  a non-finite input value can turn a weight gradient that would be infinite into NaN (both
  are non-finite, which is what check mode looks for). No BLAS call: OpenBLAS's threads, which
  spin a while after each call, do not compete with the kernel threads.

Serves dilation 1, one group, a kernel larger than 1x1 (or a 1x1 at stride 1 over maps of a
multiple of 16 pixels, which the tiles read in place) and padding at most kernel-1 (so the
data gradient's padding is not negative); everything else is the layer's im2col. At a stride
over 1 the forward reads every sh-th band row and every sw-th stacked row (output pixel w's
window starts at row sw*w), and the backward is the layer's (its data gradient is no
convolution of gy).
Kernel threads (cpu_common.run_split): each output value is one thread's dot product in an
order fixed by the compiled code, so results do not depend on the number of threads: the same
bits in every run and policy.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, fitting_threads, run_split
from snrt.backends.cpu_dots import dots4x4
from snrt.backends.cpu_tiles import (BLOCK_OUTS, PIXEL_VECTORS, convolve_tiles, lanes_of, pack_weight, padded_values,
                                    pointwise_tiles)
from snrt.backends.cpu_choice import VARIABLE, cache_path, choose, setting
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, numel, scratch_bytes
from snrt.threads import kernel_threads

BAND_ROWS = 4  # output rows packed at a time by a thread (in cache while their dot products run)
GRAD_WEIGHT_ELEMENTS = 1 << 20  # padded x and gy values per weight-gradient chunk: about 4 MB of fp32


@njit(**THREADED)
def stack_rows(x, n, ha, hb, ph, pw, kh, sh, carried, band, out):
    """out[(h - ha)*Wp + q, i*C + c] = xpad[n, c, sh*h + i, q] for output rows h in [ha, hb)
    of sample n (xpad: x zero-padded by ph rows and pw columns, Wp = W + 2*pw; sh the stride
    between rows). x (N, C, H, W); band (at least sh*(hb - ha - 1) + kh, Wp, C) scratch, where
    xpad's rows sh*ha ... sh*(hb - 1) + kh - 1 are laid out channels last; out (at least
    (hb - ha)*Wp, kh*C). carried: 0, or the number of output rows the call before packed for
    sample n, ending at ha, in the same band: its last kh - sh rows are this call's first,
    moved up instead of laid out again."""
    _, channels, height, width = x.shape
    kept = max(0, kh - sh) if carried else 0
    for b in range(kept):  # rows move up (carried >= 1: no row is overwritten before it is read)
        band[b] = band[sh * carried + b]
    for b in range(kept, sh * (hb - ha - 1) + kh):  # input rows sh*ha + b - ph into band[b]
        hi = sh * ha + b - ph
        row = band[b]
        if hi < 0 or hi >= height:
            row[:] = 0
            continue
        row[:pw] = 0
        row[pw + width:] = 0
        for c in range(channels):
            src = x[n, c, hi]
            for q in range(width):
                row[q + pw, c] = src[q]
    for h in range(ha, hb):
        base = (h - ha) * band.shape[1]
        for i in range(kh):
            row = band[sh * (h - ha) + i]
            for q in range(band.shape[1]):
                dst = out[base + q]
                for c in range(channels):
                    dst[i * channels + c] = row[q, c]


@njit(**THREADED)
def dot_rows(stacked, wt, bias, n, ha, hb, wp, sw, y):
    """y[n, o, h, w] = bias[o] + stacked[(h - ha)*Wp + sw*w :][:K] . wt[o] for h in [ha, hb),
    with stacked flat rows of kh*C (see stack_rows), wt (O, K) and sw the stride along rows.
    Blocks of 4 pixels by 4 output channels; a block past the last pixel or channel repeats it
    (same value, written twice). Empty bias: none."""
    outs, k = wt.shape
    wo = y.shape[3]
    width = stacked.shape[1]
    flat = stacked.reshape(-1)
    for h in range(ha, hb):
        base = (h - ha) * wp
        for w0 in range(0, wo, 4):
            c0, c1, c2, c3 = min(w0, wo - 1), min(w0 + 1, wo - 1), min(w0 + 2, wo - 1), min(w0 + 3, wo - 1)
            r0 = flat[(base + sw * c0) * width:][:k]
            r1 = flat[(base + sw * c1) * width:][:k]
            r2 = flat[(base + sw * c2) * width:][:k]
            r3 = flat[(base + sw * c3) * width:][:k]
            for o0 in range(0, outs, 4):
                q0, q1, q2, q3 = o0, min(o0 + 1, outs - 1), min(o0 + 2, outs - 1), min(o0 + 3, outs - 1)
                k0, k1, k2, k3 = wt[q0], wt[q1], wt[q2], wt[q3]
                (a00, a01, a02, a03), (a10, a11, a12, a13), (a20, a21, a22, a23), (a30, a31, a32, a33) = \
                    dots4x4(r0, r1, r2, r3, k0, k1, k2, k3, k)
                if bias.size:
                    e0, e1, e2, e3 = bias[q0], bias[q1], bias[q2], bias[q3]
                    a00, a10, a20, a30 = a00 + e0, a10 + e0, a20 + e0, a30 + e0
                    a01, a11, a21, a31 = a01 + e1, a11 + e1, a21 + e1, a31 + e1
                    a02, a12, a22, a32 = a02 + e2, a12 + e2, a22 + e2, a32 + e2
                    a03, a13, a23, a33 = a03 + e3, a13 + e3, a23 + e3, a33 + e3
                yq0, yq1, yq2, yq3 = y[n, q0, h], y[n, q1, h], y[n, q2, h], y[n, q3, h]
                yq0[c0], yq1[c0], yq2[c0], yq3[c0] = a00, a01, a02, a03
                yq0[c1], yq1[c1], yq2[c1], yq3[c1] = a10, a11, a12, a13
                yq0[c2], yq1[c2], yq2[c2], yq3[c2] = a20, a21, a22, a23
                yq0[c3], yq1[c3], yq2[c3], yq3[c3] = a30, a31, a32, a33


@njit(**THREADED)
def convolve_rows(x, wt, bias, ph, pw, kh, kw, sh, sw, r0, r1, band, stacked, y):
    """y rows r0 <= r < r1 (r = n*Ho + h) of the convolution of x (N, C, H, W), zero-padded by
    (ph, pw), with wt (O, kw*kh*C) (see dot_rows) and strides (sh, sw), band by band of at most
    stacked.shape[0] // Wp output rows."""
    ho = y.shape[2]
    wp = band.shape[1]
    rows = (stacked.shape[0] - kw + 1) // wp
    r, carried = r0, 0
    while r < r1:
        n, ha = r // ho, r % ho
        hb = min(ho, ha + rows, ha + r1 - r)
        used = stacked[:(hb - ha) * wp + kw - 1]
        stack_rows(x, n, ha, hb, ph, pw, kh, sh, carried if ha > 0 else 0, band, used)
        used[(hb - ha) * wp:] = 0
        dot_rows(used, wt, bias, n, ha, hb, wp, sw, y)
        carried = hb - ha
        r += hb - ha


@njit(**THREADED)
def pad_planes(x, n0, n1, ph, pw, hp, wp, planes, c0, c1):
    """planes[c, (n - n0)*hp*wp + (ph + h)*wp + pw + w] = x[n, c, h, w] for the samples n0 <= n <
    n1 and channels c0 <= c < c1 of x (N, C, H, W); zeros elsewhere in those rows of planes."""
    _, _, h, w = x.shape
    for c in range(c0, c1):
        planes[c] = 0
        for n in range(n0, n1):
            for r in range(h):
                start = (n - n0) * hp * wp + (ph + r) * wp + pw
                planes[c, start:start + w] = x[n, c, r]


@njit(**THREADED)
def pad_both(x, gy, n0, n1, ph, pw, hp, wp, xp, gp, p0, p1):
    """pad_planes of x (padded by (ph, pw)) into xp and of gy (at the planes' top left) into gp
    for the planes p0 <= p < p1 of the C + O: x's channels first, then gy's (one hand-off to
    the threads for both)."""
    c = x.shape[1]
    pad_planes(x, n0, n1, ph, pw, hp, wp, xp, min(p0, c), min(p1, c))
    pad_planes(gy, n0, n1, 0, 0, hp, wp, gp, max(p0, c) - c, max(p1, c) - c)


@njit(**THREADED)
def weight_grad_planes(gp, xp, length, wp, add, gw, b0, b1):
    """gw[o, c, i, j] = (add: gw + ) the dot product of gp[o, :length] and xp[c, i*wp + j:][:length]
    for the blocks b0 <= b < b1 of 4 output channels by 4 taps (c, i, j) (a block past the last
    channel or tap computes it again, written once). gp (O, >= length), xp (C, >=
    length + (kh-1)*wp + kw-1), gw (O, C, kh, kw)."""
    outs, channels, kh, kw = gw.shape
    taps = channels * kh * kw
    tap_blocks = (taps + 3) // 4
    for b in range(b0, b1):
        o0, k0 = 4 * (b // tap_blocks), 4 * (b % tap_blocks)
        o = (o0, min(o0 + 1, outs - 1), min(o0 + 2, outs - 1), min(o0 + 3, outs - 1))
        k = (k0, min(k0 + 1, taps - 1), min(k0 + 2, taps - 1), min(k0 + 3, taps - 1))
        g0, g1, g2, g3 = gp[o[0]], gp[o[1]], gp[o[2]], gp[o[3]]
        x0 = xp[k[0] // (kh * kw), (k[0] % (kh * kw)) // kw * wp + k[0] % kw:]
        x1 = xp[k[1] // (kh * kw), (k[1] % (kh * kw)) // kw * wp + k[1] % kw:]
        x2 = xp[k[2] // (kh * kw), (k[2] % (kh * kw)) // kw * wp + k[2] % kw:]
        x3 = xp[k[3] // (kh * kw), (k[3] % (kh * kw)) // kw * wp + k[3] % kw:]
        sums = dots4x4(g0, g1, g2, g3, x0, x1, x2, x3, length)
        for d in range(min(4, outs - o0)):  # not the repeats: with `add` they would add twice
            for e in range(min(4, taps - k0)):
                c, tap = k[e] // (kh * kw), k[e] % (kh * kw)
                i, j = tap // kw, tap % kw
                gw[o[d], c, i, j] = sums[d][e] + (gw[o[d], c, i, j] if add else 0)


INDEX = np.int64  # the dtype of the tile kernel's index arrays


def _size(arrays, itemsize):
    """Workspace bytes of scratch arrays [(shape, dtype)], dtype None for the data's (floats of
    `itemsize` bytes)."""
    return scratch_bytes(*(numel(shape) * (np.dtype(dtype).itemsize if dtype else itemsize) for shape, dtype in arrays))


class DirectConv2d(LayerLike):
    """Conv2d by the stacked-rows kernels above where they serve (see the module docstring),
    in a workspace of its own (`workspace_bytes`)."""

    name = "direct"

    @staticmethod
    def serves(layer, in_shapes):
        """One group, dilation 1 and padding at most kernel-1, a kernel larger than 1x1 or a 1x1
        at stride 1 over maps of a multiple of 16 pixels (cpu_tiles.pointwise_tiles); the
        forward at any stride, the backward at stride 1 (`serves_backward`; the layer's own
        otherwise)."""
        (kh, kw), (ph, pw) = layer.kernel, layer.padding
        pointwise = layer.stride == (1, 1) and numel(in_shapes[0][2:]) % lanes_of(FLOAT32_BYTES) == 0
        return (layer.groups == 1 and layer.dilation == (1, 1) and (kh * kw > 1 or pointwise) and ph <= kh - 1
                and pw <= kw - 1)

    @staticmethod
    def serves_backward(layer):
        """Whether the backward is this kernel's (stride 1: the data gradient is a convolution)."""
        return layer.stride == (1, 1)

    # ---- workspace ---------------------------------------------------------------------
    def _rows_arrays(self, channels, outs, width, stride, threads):
        """The stacked-rows kernel's (a stride over 1): the repacked weight (O, kw*kh*C) and per
        thread a band (stride*(BAND_ROWS - 1) + kh, Wp, channels) for packing an input of
        `channels` channels, Wp wide, read with `stride` between output rows (see stack_rows),
        and stacked rows (BAND_ROWS*Wp + kw - 1, kh*channels)."""
        kh, kw = self.layer.kernel
        return [((outs, kw * kh * channels), None), ((threads, stride * (BAND_ROWS - 1) + kh, width, channels), None),
                ((threads, BAND_ROWS * width + kw - 1, kh * channels), None)]

    def _tile_arrays(self, channels, outs, hp, wp, threads, itemsize):
        """The tile kernel's (stride 1, cpu_tiles): the packed weight, biases and tap offsets,
        and per thread two samples' padded planes (Hp x Wp), a tile's lane targets and the
        spans of the two samples."""
        kh, kw = self.layer.kernel
        taps, blocks = channels * kh * kw, -(-outs // BLOCK_OUTS)
        packed = [((blocks, taps, BLOCK_OUTS), None), ((blocks * BLOCK_OUTS,), None), ((taps,), INDEX)]
        targets = ((threads, PIXEL_VECTORS * lanes_of(itemsize)), INDEX)
        if kh * kw == 1:  # pointwise_tiles: x read in place
            return [*packed, targets]
        return [*packed, ((threads, padded_values(channels, hp, wp, kw, itemsize)), None), targets,
                ((threads, 2, 4), INDEX)]

    def _plane(self, in_shapes):
        """(Hp, Wp): a sample's plane in the weight gradient's layout of x (and of gy): H x W
        values and a gap of zeros after each row and after the last row, which serves as the
        padding on both sides (the taps past one row's end read the gap before the next row's
        start, the taps below the last row the gap rows above the next sample's first), so
        each gap is as wide as the wider of the two paddings, max(p, k-1-p), not both."""
        _, _, h, w = in_shapes[0]
        (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
        return h + max(ph, kh - 1 - ph), w + max(pw, kw - 1 - pw)

    def _grad_weight_samples(self, in_shapes):
        """Samples per weight-gradient chunk: at most about GRAD_WEIGHT_ELEMENTS padded x and gy
        values, the batch cut into chunks as even as that allows (32 samples as 16 and 16, not
        30 and a chunk of 2 that costs its hand-offs and horizontal sums for little work)."""
        n, c = in_shapes[0][:2]
        hp, wp = self._plane(in_shapes)
        most = max(1, min(n, GRAD_WEIGHT_ELEMENTS // ((c + self.layer.out_channels) * hp * wp)))
        return -(-n // -(-n // most))

    def _forward_arrays(self, in_shapes, threads, itemsize):
        _, c, h, w = in_shapes[0]
        o, (ph, pw) = self.layer.out_channels, self.layer.padding
        if self.layer.stride == (1, 1):
            return self._tile_arrays(c, o, h + 2 * ph, w + 2 * pw, threads, itemsize)
        return self._rows_arrays(c, o, w + 2 * pw, self.layer.stride[0], threads)

    def _grad_input_arrays(self, in_shapes, threads, itemsize):
        """The data gradient's: gy (O channels, Ho x Wo) padded by (kh-1-ph, kw-1-pw) is
        (H + kh - 1) x (W + kw - 1)."""
        _, c, h, w = in_shapes[0]
        o, (kh, kw) = self.layer.out_channels, self.layer.kernel
        return self._tile_arrays(o, c, h + kh - 1, w + kw - 1, threads, itemsize)

    def _grad_weight_arrays(self, in_shapes):
        """A chunk's padded planes of x, (C, L + (kh-1)*Wp + kw-1) (the taps read past the last
        plane), and of gy, (O, L), L = samples * Hp * Wp."""
        c = in_shapes[0][1]
        (kh, kw), (hp, wp) = self.layer.kernel, self._plane(in_shapes)
        length = self._grad_weight_samples(in_shapes) * hp * wp
        return [((c, length + (kh - 1) * wp + kw - 1), None), ((self.layer.out_channels, length), None)]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """Forward: the tile kernel's arrays (stride 1), else the stacked-rows kernel's. Backward:
        the larger of the weight gradient's (a chunk's padded planes of x and gy) and the data
        gradient's (the tile kernel's for gy and the flipped weight); they run one after the
        other; the layer's at a stride over 1."""
        threads = kernel_threads()
        if phase != BACKWARD:
            return _size(self._forward_arrays(in_shapes, threads, itemsize), itemsize)
        if not self.serves_backward(self.layer):
            return self.layer.workspace_bytes(in_shapes, phase, itemsize)
        return max(_size(self._grad_weight_arrays(in_shapes), itemsize),
                   _size(self._grad_input_arrays(in_shapes, threads, itemsize), itemsize))

    # ---- kernels -----------------------------------------------------------------------
    def _convolve(self, ctx, x, weight_t, bias, padding, stride, y, arrays_for):
        """y = the convolution of x padded by `padding` with weight_t (O, C, kh, kw, any strides)
        at `stride`, plus bias, on the kernel threads that fit the planned workspace;
        arrays_for(threads, itemsize): its workspace arrays (_forward_arrays or
        _grad_input_arrays of the layer's input)."""
        itemsize = x.dtype.itemsize
        threads = fitting_threads(ctx.workspace.nbytes, lambda count: _size(arrays_for(count, itemsize), itemsize))
        scratch = [ctx.scratch(shape, dtype or x.dtype) for shape, dtype in arrays_for(threads, itemsize)]
        outs, channels, kh, kw = weight_t.shape
        rows = y.shape[0] * y.shape[2]
        if stride == (1, 1):
            pack_weight(weight_t, x.shape[2] + 2 * padding[0], x.shape[3] + 2 * padding[1], *scratch[:3], bias)
            if kh * kw == 1:
                if numel(y.shape[2:]) % lanes_of(itemsize):
                    raise ValueError(f"a 1x1 convolution's direct kernel needs maps of a multiple of "
                                     f"{lanes_of(itemsize)} pixels, not {y.shape[2]}x{y.shape[3]} (see serves)")
                vectors = numel(y.shape) // (outs * lanes_of(itemsize))
                run_split(pointwise_tiles, 0, vectors, list(zip(scratch[3], [y] * threads)), (x, *scratch[:3]))
                return
            xpads, targets, spans = scratch[3:]
            run_split(convolve_tiles, 0, rows, list(zip(xpads, targets, spans, [y] * threads)),
                      (x, *scratch[:3], *padding))
            return
        wt, bands, stacked = scratch
        wt.reshape(outs, kw, kh, channels)[...] = weight_t.transpose(0, 3, 2, 1)  # wt[o, (j, i, c)]
        run_split(convolve_rows, 0, rows, list(zip(bands, stacked, [y] * threads)),
                  (x, wt, bias, *padding, kh, kw, *stride))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, weight = xs[0], params["weight"]
        bias = params["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        self._convolve(ctx, x, weight, bias, self.layer.padding, self.layer.stride, y,
                       lambda threads, itemsize: self._forward_arrays([x.shape], threads, itemsize))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if not self.serves_backward(self.layer):
            self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
            return
        x, weight = saved.xs[0], params["weight"]
        if self.layer.bias:
            n, o = gy.shape[:2]
            np.sum(gy.reshape(n, o, -1), axis=(0, 2), out=gparams["bias"])
        self._grad_weight(ctx, gy, x, gparams["weight"])
        ctx.release_scratch()
        if gxs[0] is not None:
            (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
            flipped = weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # (C, O, kh, kw)
            self._convolve(ctx, gy, flipped, weight[:0, 0, 0, 0], (kh - 1 - ph, kw - 1 - pw), (1, 1), gxs[0],
                           lambda threads, itemsize: self._grad_input_arrays([x.shape], threads, itemsize))
            ctx.release_scratch()

    def _grad_weight(self, ctx, gy, x, gweight):
        """gweight (O, C, kh, kw) by weight_grad_planes, chunk by chunk of samples, each chunk's
        planes padded by the kernel threads (a share of x's and gy's channels each), its blocks of
        weights split among them, the chunks added in order."""
        n = x.shape[0]
        (ph, pw), (hp, wp) = self.layer.padding, self._plane([x.shape])
        xp, gp = (ctx.scratch(shape, x.dtype) for shape, _ in self._grad_weight_arrays([x.shape]))
        threads = [()] * kernel_threads()
        outs, channels, kh, kw = gweight.shape
        blocks = -(-outs // 4) * -(-channels * kh * kw // 4)
        chunk = self._grad_weight_samples([x.shape])
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            run_split(pad_both, 0, channels + outs, threads, (x, gy, n0, n1, ph, pw, hp, wp, xp, gp))
            run_split(weight_grad_planes, 0, blocks, threads, (gp, xp, (n1 - n0) * hp * wp, wp, n0 > 0, gweight))


class ChosenConv2d(LayerLike):
    """Conv2d, each phase (forward, backward) by the layer's im2col, or by DirectConv2d where
    it serves and measured at least 10% faster at the shape on this machine
    (snrt/backends/cpu_choice.py)."""

    serves = staticmethod(DirectConv2d.serves)

    def __init__(self, layer):
        super().__init__(layer)
        self.candidates = {"im2col": layer, "direct": DirectConv2d(layer)}

    def chosen(self, in_shapes, phase):
        """The kernel that runs `phase` at `in_shapes` (the layer's backward at a stride over 1)."""
        if phase == BACKWARD and not DirectConv2d.serves_backward(self.layer):
            return self.layer
        return self.candidates[choose(self.layer, in_shapes, phase, self.candidates)]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.chosen(in_shapes, phase).workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.chosen([xs[0].shape], FORWARD).forward(ctx, xs, params, state, y, aux, recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        self.chosen([saved.xs[0].shape], BACKWARD).backward(ctx, gy, saved, params, aux, gxs, gparams)


def describe_choices(executor):
    """'direct kernel for F of the N dense convolutions' forwards, B of the M stride-1 ones'
    backwards (choices: FILE)': what the choices among `executor`'s kernels came to ('' when
    it has none to make)."""
    chosen = [(kernel, executor.graph.in_shapes(name, executor.plan.batch))
              for name, kernel in executor.kernels.items() if isinstance(kernel, ChosenConv2d)]
    if not chosen:
        return ""
    direct = [sum(isinstance(kernel.chosen(shapes, phase), DirectConv2d) for kernel, shapes in chosen)
              for phase in (FORWARD, BACKWARD)]
    stride_one = sum(DirectConv2d.serves_backward(kernel.layer) for kernel, _ in chosen)
    forced = setting()
    where = f"choices: {cache_path()}" if forced == "measure" else f"{VARIABLE}={forced}"
    return (f"direct kernel for {direct[0]} of the {len(chosen)} dense convolutions' forwards, "
            f"{direct[1]} of the {stride_one} stride-1 ones' backwards ({where})")
