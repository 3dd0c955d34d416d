"""Dense convolution on the CPU without the column matrix.

The layer's im2col copies every input value kh*kw times into a column matrix before its
GEMM; for 3x3 kernels on small maps (CIFAR's ResNets) that copy costs as much as the GEMM.
Here:

- forward: y = conv(x, W) + b by the broadcast multiply-add tiles of cpu_tiles (vectors of
  output pixels, at any stride through the input's phase planes), or, where those vectors
  would be under CHANNEL_TILES_BELOW outputs (narrow maps, rows of partial vectors) and the
  output channels fill whole tiles, by cpu_channel_tiles' (vectors of output channels, no
  lane spent on padding; `_channel_tiles`), output rows split evenly among the kernel
  threads;
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
  kernel computes a block of output channels by taps (c, i, j) at a time (cpu_dots.BLOCK: 6 by
  4, 24 dot products in one loop, 10 loads for 24 multiply-adds, one horizontal sum per chunk;
  each run's last values one masked step, gw written by its flat index), 4 channels by 6 taps
  where that repeats fewer rows (`block_shape`: 16 and 32 channels); the blocks are split
  among the threads, the chunks summed in order. A tap past an output row's end meets gp's zeros, so
  a non-finite input value can turn a weight gradient that would be infinite into NaN (both
  are non-finite, which is what check mode looks for). No BLAS call: OpenBLAS's threads, which
  spin a while after each call, do not compete with the kernel threads. A 1x1 kernel needs no
  planes: gW[o, c] is the dot product of gy's channel o and x's channel c, each a run of H*W
  values per sample, read where they are (cpu_dots.dots over the runs, N*C*H*W apart), in spans of
  pixels of at most about POINTWISE_SPAN_ELEMENTS values of x and gy (no copies, so spans longer
  than the padded chunks: at 2^20 values ResNet-50's 1x1s at 28x28 and 56x56 took 5.9-6.5 ms a
  weight gradient at batch 8 on 2 cores, at 2^22 4.0-4.1), the spans added in order.
  Over output maps of fewer than GEMM_PIXELS pixels, where the short runs leave the dot
  products their horizontal sums to pay for and the planes' gaps are a fifth or more of them,
  any kernel's gW is cpu_weight_gemm's implicit GEMM instead (x in its padded phase planes
  with the channels last, vectors of input channels, gy's values broadcast; measured at batch
  8 and 32 against the dot products: 3x3 512->512 @7 5.4 against 7.8 ms, 64->64 @8 0.48
  against 0.65, 3x3/2 32->64 @16 0.33 against 0.51; at 16x16 and 14x14 the dot products
  were 10% faster).

Serves dilation 1, one group, a kernel larger than 1x1 (or a 1x1 whose output maps have at
least 16 pixels, which the tiles read in place) and padding at most kernel-1 (so the
data gradient's padding is not negative); everything else is the layer's im2col. At a stride
over 1 the weight gradient reads the phase planes of x (cpu_tiles.phase_planes: tap (i, j)
at (i // s, j // s) of phase (i % s, j % s)), gy at their top left, and the data gradient is
no one convolution of gy but one per phase of gx: the pixels p + ph = s*P' + a take the taps
i = a + s*u only, a stride-1 convolution of gy with that sub-kernel flipped
(`_strided_grad_input`), by the same tiles. A 1x1 at a stride over 1 (ResNet's downsampling
shortcuts) copies x's pixels at the stride into the workspace (`subsample`) and runs its
forward and weight gradient as a 1x1 at stride 1 over them (the kernel chooser then picks it
over im2col for ResNet-50's at batch 8 on the reference machine).
Kernel threads (cpu_parallel.run_split): each output value is one thread's sum in an order fixed
by the compiled code, so results do not depend on the number of threads: the same bits in
every run and policy.
"""

import dataclasses

import numpy as np
from numba import njit

from snrt.backends.cpu_common import COMPILED, THREADED, LayerLike, fitting_threads, threads_for
from snrt.backends.cpu_channel_tiles import chunk_taps, convolve_channel_tiles, group_pixels, tile_channels
from snrt.backends.cpu_parallel import run_split
from snrt.backends.cpu_dots import BLOCK, dots
from snrt.backends.cpu_tiles import (BLOCK_OUTS, INDEX, PIXEL_VECTORS, by_rows, convolve_tiles, fill_phase, lanes_of,
                                    pack_weight, padded_values, phase_planes, pointwise_tiles, pointwise_vectors,
                                    tap_offsets)
from snrt.backends.cpu_weight_gemm import (channel_pairs, gemm_arrays, pack_outputs, pixel_offsets, gemm_tiles,
                                           transpose_planes)
from snrt.backends.cpu_choice import VARIABLE, cache_path, choose, chosen_seconds, setting
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, numel, scratch_bytes
from snrt.threads import kernel_threads

GEMM_PIXELS = 128  # output maps below which the weight gradient is an implicit GEMM (cpu_weight_gemm)
SCATTER_SPLIT = 1 << 17  # gx values from which scatter_phase's maps are split among the kernel threads
GRAD_WEIGHT_ELEMENTS = 1 << 20  # padded x and gy values per weight-gradient chunk: about 4 MB of fp32
POINTWISE_SPAN_ELEMENTS = 1 << 22  # x and gy values per span of a 1x1's weight gradient (read in place)
CHANNEL_TILES_BELOW = 0.9  # share of output lanes under which cpu_channel_tiles computes a convolution
REPEATS_MARGIN = 1.05  # blocks along the taps where they repeat this much fewer rows (block_shape)


@njit(**THREADED)
def pad_planes(x, n0, n1, ph, pw, sh, sw, hp, wp, planes, p0, p1):
    """The samples n0 <= n < n1 of x (N, C, H, W) zero-padded by (ph, pw), split into the sh*sw
    phase planes of each channel, for the planes p0 <= p < p1, p = (a*sw + b)*C + c: planes[p,
    (n - n0)*hp*wp + r*wp + q] = x[n, c, sh*r + a - ph, sw*q + b - pw] where that is inside x,
    zeros elsewhere in those rows of planes. At stride 1, one plane a channel: x at (ph, pw)."""
    _, channels, h, w = x.shape
    flat = x.reshape(-1)
    for p in range(p0, p1):
        plane = planes[p]
        plane[:] = 0
        a, b, c = p // channels // sw, p // channels % sw, p % channels
        for n in range(n0, n1):
            fill_phase(plane, (n - n0) * hp * wp, wp, hp, flat, (n * channels + c) * h * w, h, w, ph, pw, sh, sw, a, b)


@njit(**THREADED)
def pad_both(x, gy, n0, n1, ph, pw, sh, sw, hp, wp, xp, gp, p0, p1):
    """pad_planes of x (padded by (ph, pw), its sh*sw phases) into xp and of gy (at the planes'
    top left) into gp for the planes p0 <= p < p1 of x's then gy's (one hand-off to the threads
    for both)."""
    planes = sh * sw * x.shape[1]
    pad_planes(x, n0, n1, ph, pw, sh, sw, hp, wp, xp, min(p0, planes), min(p1, planes))
    pad_planes(gy, n0, n1, 0, 0, 1, 1, hp, wp, gp, max(p0, planes) - planes, max(p1, planes) - planes)


@njit(**COMPILED)
def block_shape(outs, taps):
    """(output channels, taps) a weight-gradient block computes: cpu_dots.BLOCK's rows along
    the output channels, or along the taps where that leaves fewer repeated rows (the rows past
    the last channel or tap that fill a block) by more than REPEATS_MARGIN (16 channels in
    blocks of 6 repeat 2 rows in 18, in blocks of 4 none)."""
    rows, columns = BLOCK
    by_outs = -(-outs // rows) * rows * -(-taps // columns) * columns
    by_taps = -(-outs // columns) * columns * -(-taps // rows) * rows
    return (columns, rows) if by_taps * REPEATS_MARGIN < by_outs else (rows, columns)


@njit(**THREADED)
def weight_grad_rows(g, g_row, g_run, x, starts, x_run, length, runs, add, gw, b0, b1):
    """gw[o, c, i, j] = (add: gw + ) the sum over the runs s < `runs` of the dot products of
    g[o*g_row + s*g_run:][:length] and x[starts[k] + s*x_run:][:length], k = (c, i, j), for
    the blocks b0 <= b < b1 of block_shape's output channels by taps (a block past the last
    channel or tap computes it again, written once). g and x flat; gw (O, C, kh, kw). The
    padded planes: rows of one run each; a 1x1 kernel: x and gy as they are, a run per
    sample."""
    outs, channels, kh, kw = gw.shape
    taps = channels * kh * kw
    o_size, k_size = block_shape(outs, taps)
    by_taps = o_size != BLOCK[0]  # the block's dot products come out as (tap, channel)
    tap_blocks = (taps + k_size - 1) // k_size
    flat = gw.reshape(outs, taps)  # tap k = (c, i, j) is gw's flat index within o's weights
    o_rows, k_rows = np.empty(o_size, np.intp), np.empty(k_size, np.intp)  # where the block's rows start
    for b in range(b0, b1):
        o0, k0 = o_size * (b // tap_blocks), k_size * (b % tap_blocks)
        for d in range(o_size):
            o_rows[d] = min(o0 + d, outs - 1) * g_row
        for e in range(k_size):
            k_rows[e] = starts[min(k0 + e, taps - 1)]
        if by_taps:
            sums = dots(x, k_rows, g, o_rows, length, runs, x_run, g_run)
        else:
            sums = dots(g, o_rows, x, k_rows, length, runs, g_run, x_run)
        for d in range(min(o_size, outs - o0)):  # not the repeats: with `add` they would add twice
            for e in range(min(k_size, taps - k0)):
                value = sums[e][d] if by_taps else sums[d][e]
                flat[o0 + d, k0 + e] = value + (flat[o0 + d, k0 + e] if add else 0)


@njit(**THREADED)
def subsample(x, sh, sw, z, m0, m1):
    """z[m] = x[m, ::sh, ::sw] for the maps m0 <= m < m1 of x (M, H, W) and z (M, Ho, Wo)."""
    for m in range(m0, m1):
        for r in range(z.shape[1]):
            for q in range(z.shape[2]):
                z[m, r, q] = x[m, r * sh, q * sw]


@njit(**THREADED)
def scatter_phase(z, a, b, sh, sw, ph, pw, gx, m0, m1):
    """gx[m, p, q] = z[m, P', Q'] for the pixels of phase (a, b), p + ph = sh*P' + a and q + pw =
    sw*Q' + b, of the maps m0 <= m < m1 (z, gx (maps, ., .)); 0 where (P', Q') is past z."""
    _, h, w = gx.shape
    rows, columns = z.shape[1], z.shape[2]
    p0, q0 = (a - ph) % sh, (b - pw) % sw  # the phase's first pixel, at (r0, s0) of z
    r0, s0 = (p0 + ph - a) // sh, (q0 + pw - b) // sw
    for m in range(m0, m1):
        for r, p in enumerate(range(p0, h, sh), r0):  # no division per pixel
            for s, q in enumerate(range(q0, w, sw), s0):
                gx[m, p, q] = z[m, r, s] if r < rows and s < columns else 0



def _pointwise(kernel, planes, itemsize):
    """Whether a convolution with `kernel` over maps of `planes` (padded: a 1x1 has none) runs
    by pointwise_tiles: a 1x1 over maps of at least the lanes' pixels (else by convolve_tiles)."""
    return kernel == (1, 1) and numel(planes) >= lanes_of(itemsize)


def _channel_tiles(kernel, planes, out_map, outs, itemsize):
    """Whether cpu_channel_tiles computes a convolution with `kernel` over padded planes `planes`
    (Hq, Wq) into `outs` maps of `out_map` (Ho, Wo) pixels: where its blocks hold the channels
    whole and cpu_tiles' vectors would spend more than 1 - CHANNEL_TILES_BELOW of their lanes
    on no output (padding columns, a row's last partial vector; for a pointwise_tiles 1x1, the
    map's last partial vector). Measured on 2 threads, ms, pixel tiles -> channel tiles,
    forward and data gradient: 3x3 512->512 @7 b8 (78% of the lanes) 5.5-6.6 -> 4.6-5.5 and
    6.7-8.0 -> 5.5-6.1; 3x3 256 @14 b8 (88%) 4.5 -> 4.2-4.3; 3x3 64 @56 b8 (88%) 4.65 ->
    4.3-4.5 and 4.8-5.0 -> 4.3-4.6; 1x1 512->2048 @7 b8 (77%) 2.29-2.37 -> 1.95-2.05 and
    3.0-3.1 -> 2.7-3.2, 1x1 2048->512 @7 b8 2.29-2.34 -> 2.13-2.23 and 3.0-3.2 -> 2.7-3.0; a 1x1
    @14 (94%) and one @4 (100%) were slower by them."""
    lanes = lanes_of(itemsize)
    if outs % tile_channels(itemsize):
        return False
    (ho, wo), wq = out_map, planes[1]
    if _pointwise(kernel, planes, itemsize):
        lanes_computed = -(-ho * wo // lanes) * lanes  # the map as one run of pixels
    elif by_rows(wo, wq, lanes):
        lanes_computed = ho * -(-wo // lanes) * lanes  # row by row
    else:
        lanes_computed = -(-ho * wq // lanes) * lanes  # along the rows with their padding
    return ho * wo < CHANNEL_TILES_BELOW * lanes_computed


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
        """One group, dilation 1 and padding at most kernel-1, a kernel larger than 1x1 at any
        stride, or a 1x1 whose output maps have at least 16 pixels (cpu_tiles.pointwise_tiles;
        at a stride over 1, over x's pixels at the stride copied out, `_subsampled`)."""
        (kh, kw), (ph, pw) = layer.kernel, layer.padding
        pointwise = numel(layer.infer_shape(in_shapes)[2:]) >= lanes_of(FLOAT32_BYTES)
        return (layer.groups == 1 and layer.dilation == (1, 1) and (kh * kw > 1 or pointwise) and ph <= kh - 1
                and pw <= kw - 1)

    def __init__(self, layer):
        super().__init__(layer)
        # a 1x1 at a stride over 1 runs its forward and weight gradient as this 1x1 at stride 1
        # over x's pixels at the stride (its data gradient is the strided one, _strided_grad_input)
        strided_pointwise = layer.kernel == (1, 1) and layer.stride != (1, 1)
        self.unit_stride = DirectConv2d(dataclasses.replace(layer, stride=1)) if strided_pointwise else None
        self._layouts = {}  # _layout's answers

    def _subsampled(self, in_shapes):
        """(N, C, Ho, Wo): x[:, :, ::sh, ::sw], what a 1x1 at a stride over 1 convolves."""
        n, c = in_shapes[0][:2]
        return (n, c, *self.layer.infer_shape(in_shapes)[2:])

    def _with_subsampled(self, in_shapes, itemsize, bytes_of):
        """Workspace bytes of x's subsampled copy followed by bytes_of(its shape)."""
        shape = self._subsampled(in_shapes)
        return scratch_bytes(numel(shape) * itemsize, bytes_of([shape]))

    # ---- workspace ---------------------------------------------------------------------
    def _tile_arrays(self, channels, outs, planes, phases, out_map, threads, itemsize, kernel=None):
        """The tile kernel's (cpu_tiles, or cpu_channel_tiles into output maps `out_map` = (Ho,
        Wo) where _channel_tiles says): the packed weight, biases and tap offsets, and per
        thread two samples' padded planes (`phases` x channels planes of `planes` = (Hq, Wq))
        with a pixel tile's lane targets and the spans of the two samples, or the two samples'
        pixels' bases and targets; for `kernel` (kh, kw), the layer's by default."""
        kh, kw = kernel or self.layer.kernel
        by_channels = _channel_tiles((kh, kw), planes, out_map, outs, itemsize)
        width = tile_channels(itemsize) if by_channels else BLOCK_OUTS
        taps, blocks = channels * kh * kw, -(-outs // width)
        packed = [((blocks, taps, width), None), ((blocks * width,), None), ((taps,), INDEX)]
        targets = ((threads, PIXEL_VECTORS * lanes_of(itemsize)), INDEX)
        xpad = ((threads, padded_values(channels, *planes, phases, kw, itemsize)), None)
        if by_channels:
            listed = ((threads, group_pixels(*out_map)), INDEX)
            return [*packed, xpad, listed, listed]
        if _pointwise((kh, kw), planes, itemsize):  # pointwise_tiles: x read in place
            return [*packed, targets]
        return [*packed, xpad, targets, ((threads, 2, 4), INDEX)]

    def _plane(self, in_shapes):
        """(Hp, Wp): a sample's plane in the weight gradient's layout of x (and of gy). At stride
        1, H x W values and a gap of zeros after each row and after the last row, which serves
        as the padding on both sides (the taps past one row's end read the gap before the next
        row's start, the taps below the last row the gap rows above the next sample's first),
        so each gap is as wide as the wider of the two paddings, max(p, k-1-p), not both. At a
        stride over 1, the phase planes of x padded (cpu_tiles.phase_planes), gy at their top
        left."""
        _, _, h, w = in_shapes[0]
        (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
        if self.layer.stride != (1, 1):
            return phase_planes(h, w, self.layer.padding, self.layer.stride)
        return h + max(ph, kh - 1 - ph), w + max(pw, kw - 1 - pw)

    def _grad_weight_samples(self, in_shapes):
        """Samples per weight-gradient chunk: at most about GRAD_WEIGHT_ELEMENTS padded x and gy
        values, the batch cut into chunks as even as that allows (32 samples as 16 and 16, not
        30 and a chunk of 2 that costs its hand-offs and horizontal sums for little work)."""
        n, c = in_shapes[0][:2]
        (hp, wp), (sh, sw) = self._plane(in_shapes), self.layer.stride
        most = max(1, min(n, GRAD_WEIGHT_ELEMENTS // ((sh * sw * c + self.layer.out_channels) * hp * wp)))
        return -(-n // -(-n // most))

    def _forward_arrays(self, in_shapes, threads, itemsize):
        _, c, h, w = in_shapes[0]
        (sh, sw), padding = self.layer.stride, self.layer.padding
        return self._tile_arrays(c, self.layer.out_channels, phase_planes(h, w, padding, (sh, sw)), sh * sw,
                                 self.layer.infer_shape(in_shapes)[2:], threads, itemsize)

    def _grad_input_arrays(self, in_shapes, threads, itemsize):
        """The data gradient's at stride 1: gy (O channels, Ho x Wo) padded by (kh-1-ph,
        kw-1-pw) is (H + kh - 1) x (W + kw - 1)."""
        _, c, h, w = in_shapes[0]
        o, (kh, kw) = self.layer.out_channels, self.layer.kernel
        return self._tile_arrays(o, c, (h + kh - 1, w + kw - 1), 1, (h, w), threads, itemsize)

    def _phase_taps(self, phase):
        """(U, V): the taps (a + sh*u, b + sw*v) of the kernel in gx's phase (a, b) at a stride."""
        (kh, kw), (sh, sw) = self.layer.kernel, self.layer.stride
        return max(0, -(-(kh - phase[0]) // sh)), max(0, -(-(kw - phase[1]) // sw))

    def _phase_arrays(self, in_shapes, phase, threads, itemsize):
        """The strided data gradient's for gx's `phase`: its plane Z (N, C, Ho+U-1, Wo+V-1), then
        the tile kernel's for gy padded by (U-1, V-1) and the (U, V) sub-kernel."""
        n, c = in_shapes[0][:2]
        _, o, ho, wo = self.layer.infer_shape(in_shapes)
        u, v = self._phase_taps(phase)
        return [((n, c, ho + u - 1, wo + v - 1), None),
                *self._tile_arrays(o, c, (ho + 2 * (u - 1), wo + 2 * (v - 1)), 1, (ho + u - 1, wo + v - 1), threads,
                                   itemsize, (u, v))]

    def _phases(self):
        """gx's phases (a, b) at the layer's stride that some taps reach."""
        sh, sw = self.layer.stride
        return [(a, b) for a in range(sh) for b in range(sw) if min(self._phase_taps((a, b))) > 0]

    def _gemm_grad_weight(self, in_shapes, itemsize=FLOAT32_BYTES):
        """Whether the weight gradient is cpu_weight_gemm's implicit GEMM: output maps of fewer
        than GEMM_PIXELS pixels (where the dot products' padded planes and horizontal sums cost
        the most) and at least a vector of input channels."""
        c = in_shapes[0][1]
        _, _, ho, wo = self.layer.infer_shape(in_shapes)
        return ho * wo < GEMM_PIXELS and c >= lanes_of(itemsize)

    def _gemm_arrays(self, in_shapes, threads, itemsize):
        """The weight gradient's as an implicit GEMM (cpu_weight_gemm.gemm_arrays)."""
        layer = self.layer
        return gemm_arrays(in_shapes[0], layer.infer_shape(in_shapes), layer.kernel, layer.padding, layer.stride, threads,
                           itemsize)

    def _grad_weight_arrays(self, in_shapes):
        """Where each tap (c, i, j) starts in x's planes, (C*kh*kw,); then a chunk's padded planes
        of x, (sh*sw*C, L + the farthest tap's shift) (the taps read past the last plane), and of
        gy, (O, L), L = samples * Hp * Wp; no planes for a 1x1 kernel (x and gy read where they
        are)."""
        c = in_shapes[0][1]
        (kh, kw), (hp, wp), (sh, sw) = self.layer.kernel, self._plane(in_shapes), self.layer.stride
        starts = ((c * kh * kw,), INDEX)
        if kh * kw == 1:
            return [starts]
        length = self._grad_weight_samples(in_shapes) * hp * wp
        return [starts, ((sh * sw * c, length + (kh - 1) // sh * wp + (kw - 1) // sw), None),
                ((self.layer.out_channels, length), None)]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """Forward: the tile kernel's arrays. Backward: the larger of the weight gradient's (a
        chunk's padded planes of x and gy, or a 1x1's GEMM arrays) and the data gradient's (the
        tile kernel's for gy and the flipped weight; at a stride over 1 the largest phase's);
        they run one after the other."""
        threads = kernel_threads()
        unit = self.unit_stride
        if phase != BACKWARD:
            if unit:
                return self._with_subsampled(in_shapes, itemsize, lambda shapes: unit.workspace_bytes(shapes, phase,
                                                                                                      itemsize))
            return _size(self._forward_arrays(in_shapes, threads, itemsize), itemsize)
        if self.layer.stride == (1, 1):
            grad_input = _size(self._grad_input_arrays(in_shapes, threads, itemsize), itemsize)
        else:
            grad_input = max(_size(self._phase_arrays(in_shapes, p, threads, itemsize), itemsize)
                             for p in self._phases())
        if unit:
            weight_grad = self._with_subsampled(in_shapes, itemsize,
                                                lambda shapes: unit._grad_weight_bytes(shapes, threads, itemsize))
        else:
            weight_grad = self._grad_weight_bytes(in_shapes, threads, itemsize)
        return max(weight_grad, grad_input)

    def _grad_weight_bytes(self, in_shapes, threads, itemsize):
        """The weight gradient's workspace: a 1x1's GEMM arrays, or the padded planes."""
        return (_size(self._gemm_arrays(in_shapes, threads, itemsize), itemsize)
                if self._gemm_grad_weight(in_shapes, itemsize) else _size(self._grad_weight_arrays(in_shapes), itemsize))

    def _layout(self, key, workspace_bytes, arrays_for, itemsize):
        """(threads, arrays_for(threads, itemsize)): the most kernel threads whose workspace
        arrays fit a planned workspace of `workspace_bytes` (fitting_threads), and those arrays;
        remembered under `key`, what arrays_for depends on besides the threads (every iteration
        asks again with the same)."""
        known = (key, workspace_bytes, itemsize, kernel_threads())
        layout = self._layouts.get(known)
        if layout is None:
            threads = fitting_threads(workspace_bytes, lambda count: _size(arrays_for(count, itemsize), itemsize))
            layout = self._layouts[known] = (threads, arrays_for(threads, itemsize))
        return layout

    # ---- kernels -----------------------------------------------------------------------
    def _convolve(self, ctx, x, weight_t, bias, padding, stride, y, key, arrays_for, taken=0):
        """y = the convolution of x padded by `padding` with weight_t (O, C, kh, kw, any strides)
        at `stride`, plus bias, on the kernel threads that fit the planned workspace;
        arrays_for(threads, itemsize): its workspace arrays (_forward_arrays, _grad_input_arrays
        or _phase_arrays of the layer's input; `key` says which, for _layout), the first `taken`
        of them already the caller's."""
        itemsize = x.dtype.itemsize
        threads, arrays = self._layout(key, ctx.workspace.nbytes, arrays_for, itemsize)
        scratch = [ctx.scratch(shape, dtype or x.dtype) for shape, dtype in arrays[taken:]]
        outs, _, kh, kw = weight_t.shape
        rows = y.shape[0] * y.shape[2]
        planes = phase_planes(*x.shape[2:], padding, stride)
        pack_weight(weight_t, *planes, *stride, *scratch[:3], bias)
        if _channel_tiles((kh, kw), planes, y.shape[2:], outs, itemsize):
            chunk = chunk_taps(x.shape[1], (kh, kw), stride, planes, itemsize)
            run_split(convolve_channel_tiles, 0, rows, threads, (x, *scratch[:3], *padding, *stride, chunk, y),
                      scratch[3:])
            return
        if _pointwise((kh, kw), y.shape[2:], itemsize):
            vectors = y.shape[0] * pointwise_vectors(numel(y.shape[2:]), lanes_of(itemsize))
            run_split(pointwise_tiles, 0, vectors, threads, (x, *scratch[:3], y), scratch[3:])
            return
        run_split(convolve_tiles, 0, rows, threads, (x, *scratch[:3], *padding, *stride, y), scratch[3:])

    def _subsample(self, ctx, x):
        """x[:, :, ::sh, ::sw] copied into the workspace, and the context of what is left of it."""
        z = ctx.scratch(self._subsampled([x.shape]), x.dtype)
        planes = z.shape[0] * z.shape[1]
        run_split(subsample, 0, planes, threads_for(z.size, SCATTER_SPLIT),
                  (x.reshape(planes, *x.shape[2:]), *self.layer.stride, z.reshape(planes, *z.shape[2:])))
        return z, ctx.rest()

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if self.unit_stride:
            z, rest = self._subsample(ctx, xs[0])
            self.unit_stride.forward(rest, [z], params, state, y, aux, recompute)
            ctx.release_scratch()
            return
        x, weight = xs[0], params["weight"]
        bias = params["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        self._convolve(ctx, x, weight, bias, self.layer.padding, self.layer.stride, y, ("forward", x.shape),
                       lambda threads, itemsize: self._forward_arrays([x.shape], threads, itemsize))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, weight = saved.xs[0], params["weight"]
        if self.layer.bias:
            n, o = gy.shape[:2]
            np.sum(gy.reshape(n, o, -1), axis=(0, 2), out=gparams["bias"])
        self._grad_weight(ctx, gy, x, gparams["weight"])
        ctx.release_scratch()
        if gxs[0] is not None and self.layer.stride != (1, 1):
            self._strided_grad_input(ctx, gy, weight, gxs[0])
        elif gxs[0] is not None:
            (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
            flipped = weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # (C, O, kh, kw)
            self._convolve(ctx, gy, flipped, weight[:0, 0, 0, 0], (kh - 1 - ph, kw - 1 - pw), (1, 1), gxs[0],
                           ("grad_input", x.shape),
                           lambda threads, itemsize: self._grad_input_arrays([x.shape], threads, itemsize))
            ctx.release_scratch()

    def _strided_grad_input(self, ctx, gy, weight, gx):
        """gx at a stride (sh, sw), phase by phase: the pixels p = sh*P' + a - ph (columns
        likewise) take the taps i = a + sh*u, whose sum over (o, u, v) of W[o, c, a + sh*u,
        b + sw*v] gy[o, P' - u, Q' - v] is a stride-1 convolution of gy padded by (U-1, V-1) with
        that sub-kernel flipped, into the phase's plane Z; then Z's values go to their pixels
        (scatter_phase, zeros where no tap reaches)."""
        (ph, pw), (sh, sw) = self.layer.padding, self.layer.stride
        shape, planes = [gx.shape], gx.shape[0] * gx.shape[1]
        if len(self._phases()) < sh * sw:  # phases no tap reaches stay 0
            gx[...] = 0
        for a, b in self._phases():
            u, v = self._phase_taps((a, b))
            z = ctx.scratch(self._phase_arrays(shape, (a, b), 1, gx.dtype.itemsize)[0][0], gx.dtype)
            flipped = weight[:, :, a::sh, b::sw][:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # (C, O, U, V)
            self._convolve(ctx, gy, flipped, weight[:0, 0, 0, 0], (u - 1, v - 1), (1, 1), z, ("phase", a, b, gx.shape),
                           lambda threads, itemsize: self._phase_arrays(shape, (a, b), threads, itemsize), taken=1)
            run_split(scatter_phase, 0, planes, threads_for(gx.size, SCATTER_SPLIT),
                      (z.reshape(planes, *z.shape[2:]), a, b, sh, sw, ph, pw, gx.reshape(planes, *gx.shape[2:])))
            ctx.release_scratch()

    def _grad_weight_gemm(self, ctx, gy, x, gweight):
        """gweight by cpu_weight_gemm: x into its padded phase planes with the channels last and
        gy into blocks of output channels (both split among the kernel threads), then the
        GEMM's units split among them."""
        n, channels, h, w = x.shape
        itemsize, (sh, sw), (ph, pw) = x.dtype.itemsize, self.layer.stride, self.layer.padding
        threads, arrays = self._layout(("grad_weight_gemm", x.shape), ctx.workspace.nbytes,
                                       lambda count, itemsize: self._gemm_arrays([x.shape], count, itemsize), itemsize)
        xt, gpack, offsets, zeros, targets = (ctx.scratch(shape, dtype or x.dtype) for shape, dtype in arrays)
        hq, wq = phase_planes(h, w, self.layer.padding, self.layer.stride)
        zeros[:] = 0
        run_split(transpose_planes, 0, sh * sw * n * hq, threads, (x, ph, pw, sh, sw, hq, wq, xt))
        run_split(pack_outputs, 0, gpack.shape[0], threads, (gy, gpack))
        pixel_offsets(n, *gy.shape[2:], hq, wq, channels, offsets)
        units = gweight.shape[2] * gweight.shape[3] * channel_pairs(channels, itemsize) * gpack.shape[0]
        run_split(gemm_tiles, 0, units, threads, (xt, gpack, offsets, zeros, n, channels, hq, wq, sh, sw, gweight),
                  (targets,))

    def _grad_weight(self, ctx, gy, x, gweight):
        """gweight (O, C, kh, kw) by weight_grad_rows, its blocks of weights split among the
        kernel threads (a 1x1 over small maps: _grad_weight_gemm): of a 1x1 kernel from x and gy
        as they are; else chunk by chunk of samples, each chunk's planes padded by the threads
        (a share of x's and gy's planes each), the chunks added in order."""
        if self.unit_stride:
            z, rest = self._subsample(ctx, x)
            self.unit_stride._grad_weight(rest, gy, z, gweight)
            return
        if self._gemm_grad_weight([x.shape], x.dtype.itemsize):
            self._grad_weight_gemm(ctx, gy, x, gweight)
            return
        n, channels, h, w = x.shape
        outs, _, kh, kw = gweight.shape
        (ph, pw), (hp, wp), (sh, sw) = self.layer.padding, self._plane([x.shape]), self.layer.stride
        threads = kernel_threads()
        o_size, k_size = block_shape(outs, channels * kh * kw)
        blocks = -(-outs // o_size) * -(-channels * kh * kw // k_size)
        arrays = [ctx.scratch(shape, dtype or x.dtype) for shape, dtype in self._grad_weight_arrays([x.shape])]
        starts = arrays[0]
        if kh * kw == 1:
            pixels = h * w
            tap_offsets(channels, 1, 1, 1, 1, pixels, 0, starts)
            span = -(-pixels // -(-(n * (channels + outs) * pixels) // POINTWISE_SPAN_ELEMENTS))
            for p0 in range(0, pixels, span):
                run_split(weight_grad_rows, 0, blocks, threads, (gy.reshape(-1)[p0:], pixels, outs * pixels,
                                                                 x.reshape(-1)[p0:], starts, channels * pixels,
                                                                 min(span, pixels - p0), n, p0 > 0, gweight))
            return
        xp, gp = arrays[1:]
        tap_offsets(channels, kh, kw, sh, sw, xp.shape[1], wp, starts)
        chunk = self._grad_weight_samples([x.shape])
        for n0 in range(0, n, chunk):
            n1 = min(n, n0 + chunk)
            run_split(pad_both, 0, xp.shape[0] + outs, threads, (x, gy, n0, n1, ph, pw, sh, sw, hp, wp, xp, gp))
            run_split(weight_grad_rows, 0, blocks, threads, (gp.reshape(-1), gp.shape[1], 0, xp.reshape(-1), starts,
                                                             0, (n1 - n0) * hp * wp, 1, n0 > 0, gweight))


class ChosenConv2d(LayerLike):
    """Conv2d where DirectConv2d serves, each phase (forward, backward) by it, or by the layer's
    im2col where that measured at least 10% faster at the shape on this machine
    (snrt/backends/cpu_choice.py). The direct kernel is the default: a near tie is within a
    shared machine's noise, and the direct kernel leaves no BLAS threads spinning after it."""

    serves = staticmethod(DirectConv2d.serves)

    def __init__(self, layer):
        super().__init__(layer)
        self.candidates = {"direct": DirectConv2d(layer), "im2col": layer}

    def chosen(self, in_shapes, phase):
        """The kernel that runs `phase` at `in_shapes`."""
        return self.candidates[choose(self.layer, in_shapes, phase, self.candidates)]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.chosen(in_shapes, phase).workspace_bytes(in_shapes, phase, itemsize)

    def measured_seconds(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """The chosen kernel's measured seconds at `in_shapes` (cpu_choice.chosen_seconds), fp32
        only (None otherwise: 2-byte tensors add their staging, which was not measured). A
        backward was measured with its data gradient, which a network's first layer skips."""
        if itemsize != FLOAT32_BYTES:
            return None
        return chosen_seconds(self.layer, in_shapes, phase, self.candidates)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.chosen([xs[0].shape], FORWARD).forward(ctx, xs, params, state, y, aux, recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        self.chosen([saved.xs[0].shape], BACKWARD).backward(ctx, gy, saved, params, aux, gxs, gparams)


def describe_choices(executor):
    """'direct kernel for F of the N dense convolutions' forwards, B of their backwards
    (choices: FILE)': what the choices among `executor`'s kernels came to ('' when it has none
    to make)."""
    chosen = [(kernel, executor.graph.in_shapes(name, executor.plan.batch))
              for name, kernel in executor.kernels.items() if isinstance(kernel, ChosenConv2d)]
    if not chosen:
        return ""
    direct = [sum(isinstance(kernel.chosen(shapes, phase), DirectConv2d) for kernel, shapes in chosen)
              for phase in (FORWARD, BACKWARD)]
    forced = setting()
    where = f"choices: {cache_path()}" if forced == "measure" else f"{VARIABLE}={forced}"
    return (f"direct kernel for {direct[0]} of the {len(chosen)} dense convolutions' forwards, "
            f"{direct[1]} of their backwards ({where})")
