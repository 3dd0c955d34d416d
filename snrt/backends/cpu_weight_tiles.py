"""A convolution's weight gradient by vectors of output channels, both operands channels last.

    gW[o, c, i, j] = sum over the output pixels t = (n, h, w) of gy[n, o, h, w] * xpad[n, c, sh*h + i, sw*w + j]

x is copied once into its padded phase planes with the channels last, xt[phase, n, r, q, c]
(cpu_weight_gemm.transpose_planes), and gy with its channels last, gt[t, o] (`outputs_last`,
rows padded with zeros to whole tiles). In xt, the window of output pixel t at kernel row i
holds the taps (j, c) of one phase column b = j % sw side by side: q + j // sw, then c, so
`weight_tile` takes `pixels` consecutive of them (one pointer, each at its own displacement)
by `vectors` vectors of output channels, and along t keeps vectors * pixels sums in
registers: per pixel `vectors` loads of gt (contiguous) and `pixels` broadcasts of xt for
vectors * pixels multiply-adds, no lane spent on padding, nothing summed across lanes (a
3x3 32->32 @16 b32 weight gradient: 0.74 ms on one core, against 0.83 by cpu_conv's dot
products, 0.60 of it the tiles at 250 GFLOP/s).

The samples go by chunks of about GRAD_WEIGHT_ELEMENTS values of xt and gt (cpu_conv), each
copied and then added to the sums, so the workspace stays small for large maps. A thread runs
its units a block of output channels at a time, the pixels by chunks
(`chunk_pixels`: their xt and the block's gt about CHUNK_BYTES), every unit of the block
through one chunk before the next, so that a chunk is read from cache by all of them; a
unit's sums are stored after each chunk and read back before the next, as vectors of a
workspace laid out as gW transposed (a tap's output channels side by side), which
`weights_from_sums` transposes into gW at the end. Each weight is one chain of multiply-adds
along t in order, from 0, in one thread: the same bits on any number of threads (a longer
chain than the dot products' lanes and tree: about 3e-6 relative error in fp32 over 8,192
pixels, 5e-7 theirs).
"""

from functools import lru_cache

import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from snrt.backends.cpu_common import THREADED
from snrt.backends.cpu_dots import VECTOR_BYTES
from snrt.backends.cpu_tiles import BLOCK_OUTS, addressing, lanes_of, transpose_block, vector_ops

ACCUMULATORS = 24 if VECTOR_BYTES == 64 else 12  # sum vectors a tile keeps in registers (of 32, or AVX's 16)
MOST_VECTORS = 4  # vectors of output channels a tile holds at most
CHUNK_BYTES = 1 << 19  # xt and gt values a chunk of output pixels reads, about: half a core's L2 cache here


def tile_shape(outs, itemsize):
    """(vectors, pixels) of the tiles for `outs` output channels: as many vectors as the
    channels fill (up to MOST_VECTORS; a last block of channels may be partial), ACCUMULATORS
    // vectors taps."""
    vectors = min(MOST_VECTORS, -(-outs // lanes_of(itemsize)))
    return vectors, ACCUMULATORS // vectors


def chunk_pixels(channels, block, out_map, phases, planes, itemsize):
    """Output pixels a chunk holds (at least 1): about CHUNK_BYTES of xt (a sample's `phases`
    padded planes `planes` of `channels`, over its output pixels `out_map`) and of a block's
    columns of gt (`block` values a pixel)."""
    values = channels * phases * planes[0] * planes[1] / (out_map[0] * out_map[1]) + block
    return max(1, int(CHUNK_BYTES / (itemsize * values)))


@intrinsic
def weight_tile(typingctx, xt, xstart, offsets, k0, k1, gt, gstart, gwidth, sums, targets, resume, vectors, pixels):
    """For the taps p < `pixels` and the output channels o < vectors * lanes of a block: value
    = start + sum over k0 <= k < k1 of gt[k*gwidth + gstart + o] * xt[xstart + offsets[k] +
    p], stored at sums[targets[p]*gwidth + gstart + o] for each tap whose target is not
    negative; start is the value stored there if `resume` is not 0, else 0.
    `vectors` and `pixels`: compile-time integers. Contiguous arrays, float32 or float64;
    offsets and targets int64."""
    dtype = xt.dtype
    if dtype not in (types.float32, types.float64) or any(a.dtype != dtype or a.layout != "C" for a in (xt, gt, sums)) \
            or any(a.dtype != types.int64 or a.layout != "C" for a in (offsets, targets)) \
            or not all(isinstance(n, types.IntegerLiteral) for n in (vectors, pixels)):
        return None
    tile_vectors, tile_pixels = vectors.literal_value, pixels.literal_value
    lanes = lanes_of(8 if dtype == types.float64 else 4)
    arguments = (xt, types.intp, offsets, types.intp, types.intp, gt, types.intp, types.intp, sums, targets, types.intp,
                 vectors, pixels)

    def codegen(context, builder, signature, args):
        xstart, k0, k1, gstart, gwidth, resume = (args[i] for i in (1, 3, 4, 6, 7, 10))
        xs, offsets_d, gs, sums_d, targets_d = (context.make_array(signature.args[i])(context, builder, args[i]).data
                                                for i in (0, 2, 5, 8, 9))
        index = xstart.type
        vector, fma, broadcast = vector_ops(builder, dtype, lanes)
        at, vector_at = addressing(builder, index, vector)

        zero = ir.Constant(vector, [0.0] * lanes)
        sums = [[cgutils.alloca_once_value(builder, zero) for _ in range(tile_vectors)] for _ in range(tile_pixels)]
        targets = [builder.load(at(targets_d, p)) for p in range(tile_pixels)]
        stored = [[builder.add(builder.mul(targets[p], gwidth), builder.add(gstart, ir.Constant(index, v * lanes)))
                   for v in range(tile_vectors)] for p in range(tile_pixels)]
        exists = [builder.icmp_signed(">=", targets[p], ir.Constant(index, 0)) for p in range(tile_pixels)]
        with builder.if_then(builder.icmp_signed("!=", resume, ir.Constant(index, 0))):  # go on from the sums so far
            for p in range(tile_pixels):
                with builder.if_then(exists[p]):
                    for v in range(tile_vectors):
                        builder.store(builder.load(vector_at(sums_d, stored[p][v]), align=4), sums[p][v])
        window = at(xs, xstart)
        with cgutils.for_range(builder, builder.sub(k1, k0)) as loop:
            k = builder.add(k0, loop.index)
            taps = at(window, builder.load(at(offsets_d, k)))
            row = builder.add(gstart, builder.mul(k, gwidth))
            grads = [builder.load(vector_at(gs, builder.add(row, ir.Constant(index, v * lanes))), align=4)
                     for v in range(tile_vectors)]
            for p in range(tile_pixels):
                value = broadcast(builder.load(at(taps, p)))
                for v in range(tile_vectors):
                    builder.store(fma(grads[v], value, builder.load(sums[p][v])), sums[p][v])
        for p in range(tile_pixels):
            with builder.if_then(exists[p]):
                for v in range(tile_vectors):
                    builder.store(builder.load(sums[p][v]), vector_at(sums_d, stored[p][v]), align=4)
        return context.get_dummy_value()

    return types.void(*arguments), codegen


@njit(**THREADED)
def outputs_last(gy, gt, n0, n1):
    """gt[(n*Ho*Wo + t)*G + o] = gy[n, o, t] for the samples n0 <= n < n1 (t a pixel of the
    map, G = gt's row width: zeros past O): BLOCK_OUTS channels by BLOCK_OUTS pixels at a time
    by cpu_tiles.transpose_block, the rest value by value."""
    samples, outs, ho, wo = gy.shape
    pixels, width = ho * wo, gt.size // (samples * ho * wo)
    flat = gy.reshape(-1)
    whole_o, whole_t = outs - outs % BLOCK_OUTS, pixels - pixels % BLOCK_OUTS
    for n in range(n0, n1):
        base = n * pixels * width
        for o in range(0, whole_o, BLOCK_OUTS):
            for t in range(0, whole_t, BLOCK_OUTS):
                transpose_block(flat, (n * outs + o) * pixels + t, pixels, gt, base + t * width + o, width)
        for o in range(width):
            for t in range(whole_t if o < whole_o else 0, pixels):
                gt[base + t * width + o] = flat[(n * outs + o) * pixels + t] if o < outs else 0


def weight_rows(channels, kernel, stride, hq, wq, samples):
    """The rows of taps the tiles run along, (R, 4) int64: (where row r's first tap reads in xt
    relative to an output pixel's window, its taps, kernel row i, phase column b): for each
    kernel row i and phase column b, the taps j = b, b + sw, ... of phase (i % sh, b) at (i //
    sh, j // sw), each with its C channels, side by side in xt."""
    (kh, kw), (sh, sw) = kernel, stride
    phase_values = samples * hq * wq * channels
    rows = []
    for i in range(kh):
        for b in range(min(sw, kw)):
            count = -(-(kw - b) // sw)
            rows.append(((((i % sh) * sw + b) * phase_values + (i // sh) * wq * channels), count * channels, i, b))
    return np.array(rows, np.int64)


@lru_cache(maxsize=None)
def weight_tiles(vectors, pixels):
    """The compiled units(xt, gt, gwidth, offsets, rows, channels, kh, kw, sw, chunk, fresh,
    sums, u0, u1, targets) of tiles of `vectors` x `pixels` (weight_tile): the units u0 <= u < u1, u
    = (block b of vectors * lanes output channels, row r of weight_rows, group g of `pixels`
    taps along it), a block's units chunk by chunk of `chunk` output pixels (offsets: each
    output pixel's window in xt, cpu_weight_gemm.pixel_offsets), into sums[k*gwidth + o] for
    the taps k = (c, i, j) of a kh x kw kernel, from 0 if `fresh`, else adding to what the
    sums hold (a later chunk of samples). A group past its row's taps does nothing.
    targets (`pixels` int64): this thread's scratch."""

    @njit(**THREADED)
    def units(xt, gt, gwidth, offsets, rows, channels, kh, kw, sw, chunk, fresh, sums, u0, u1, targets):
        count = offsets.size
        block = vectors * lanes_of(xt.itemsize)
        groups = -(-rows[:, 1].max() // pixels)
        per_block = len(rows) * groups
        u = u0
        while u < u1:  # the units of one block at a time, chunk by chunk
            b = u // per_block
            end = min(u1, (b + 1) * per_block)
            for k0 in range(0, count, chunk):
                for unit in range(u, end):
                    g, r = unit % groups, unit % per_block // groups
                    first, taps, i, column = rows[r, 0], rows[r, 1], rows[r, 2], rows[r, 3]
                    e0 = g * pixels
                    if e0 >= taps:
                        continue
                    for p in range(pixels):
                        e = e0 + p
                        c, j = e % channels, column + e // channels * sw
                        targets[p] = (c * kh + i) * kw + j if e < taps else -1
                    weight_tile(xt, first + e0, offsets, k0, min(count, k0 + chunk), gt, b * block, gwidth, sums,
                                targets, 1 if k0 > 0 or not fresh else 0, vectors, pixels)
            u = end

    return units


def unit_count(rows, gwidth, vectors, pixels, itemsize):
    """The units of weight_tiles for the rows (weight_rows) and blocks of output channels
    `gwidth` wide."""
    return len(rows) * -(-int(rows[:, 1].max()) // pixels) * (gwidth // (vectors * lanes_of(itemsize)))


@njit(**THREADED)
def weights_from_sums(sums, gwidth, gw, o0, o1):
    """gw[o, k] = sums[k*gwidth + o] (gw (O, C, kh, kw) flat past O) for the channels o0 <= o
    < o1: BLOCK_OUTS by BLOCK_OUTS by cpu_tiles.transpose_block, the rest value by value."""
    taps = gw.size // gw.shape[0]
    flat = gw.reshape(-1)
    whole_k = taps - taps % BLOCK_OUTS
    o = o0
    while o < o1:
        if o + BLOCK_OUTS <= o1:
            for k in range(0, whole_k, BLOCK_OUTS):
                transpose_block(sums, k * gwidth + o, gwidth, flat, o * taps + k, taps)
            for d in range(BLOCK_OUTS):
                for k in range(whole_k, taps):
                    flat[(o + d) * taps + k] = sums[k * gwidth + o + d]
            o += BLOCK_OUTS
        else:
            for k in range(taps):
                flat[o * taps + k] = sums[k * gwidth + o]
            o += 1
