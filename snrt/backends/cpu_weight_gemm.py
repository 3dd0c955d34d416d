"""A convolution's weight gradient as an implicit GEMM over vectors of input channels, for the
small maps where cpu_conv's dot products over padded planes lose lanes and time.

    gW[o, c, i, j] = sum over the output pixels t = (n, h, w) of gy[n, o, h, w] * xpad[n, c, sh*h + i, sw*w + j]

cpu_conv's dot products run along t over planes padded with gaps (an 8x8 map's 9x9 planes: a
fifth of the products are with zeros), one horizontal sum per dot product; on 7x7 maps with
512 channels they ran at about half the rate of the forward's tiles. Here x is copied once
into its padded phase planes (cpu_tiles.phase_planes) with the channels last, xt[phase, n, r,
q, c] (`transpose_planes`), and gy into blocks of BLOCK_OUTS output channels over the output
pixels only, gpack[b, t, o] (`pack_outputs`); then for each tap (i, j), pair of vectors of input
channels and block of output channels, cpu_tiles.fma_tile keeps the block's 2*BLOCK_OUTS
vectors of sums in registers along t: one vector load of xt per channel vector and one
broadcast of gy per output channel for each t, no zeros multiplied, nothing summed across
lanes. fma_tile's taps are the pixels t here (offsets[t] = where t's window starts in xt),
its pixel vectors the channel vectors at tap (i, j)'s shift, its weights gy.

Each weight is one chain of multiply-adds along t in order, from 0, in one thread: the same
bits on any number of threads. The whole batch is one GEMM (no chunks to add, so the workspace
holds x and gy once more, `gemm_arrays`); cpu_conv takes this path for small maps.
"""

from numba import njit

from snrt.backends.cpu_common import THREADED
from snrt.backends.cpu_tiles import (BLOCK_OUTS, INDEX, PIXEL_VECTORS, inside_range, fma_tile, lanes_of, phase_planes,
                                    transpose_block)


def channel_pairs(channels, itemsize):
    """Pairs of channel vectors (fma_tile's two pixel vectors) that cover `channels`."""
    return -(-channels // (PIXEL_VECTORS * lanes_of(itemsize)))


def gemm_arrays(x_shape, y_shape, kernel, padding, stride, threads, itemsize):
    """The workspace arrays [(shape, dtype or None for the data's)]: xt (sh*sw*N*Hq*Wq*C plus
    the lanes a last channel vector reads past it), gpack (blocks, N*Ho*Wo, BLOCK_OUTS),
    offsets (N*Ho*Wo,), zero sums to start from (BLOCK_OUTS,) and per thread a tile's lane
    targets."""
    n, c, h, w = x_shape
    _, o, ho, wo = y_shape
    (hq, wq), (sh, sw) = phase_planes(h, w, padding, stride), stride
    pixels, blocks = n * ho * wo, -(-o // BLOCK_OUTS)
    return [((sh * sw * n * hq * wq * c + PIXEL_VECTORS * lanes_of(itemsize),), None),
            ((blocks, pixels, BLOCK_OUTS), None), ((pixels,), INDEX), ((BLOCK_OUTS,), None),
            ((threads, PIXEL_VECTORS * lanes_of(itemsize)), INDEX)]


@njit(**THREADED)
def transpose_planes(x, ph, pw, sh, sw, hq, wq, xt, row0, row1):
    """Rows row0 <= row < row1 of xt, row = ((a*sw + b)*N + n)*Hq + r (phase (a, b), sample n, row
    r of its phase plane): xt[(row*Wq + q)*C + c] = x[n, c, sh*r + a - ph, sw*q + b - pw], zero
    where that is padding. At column stride 1, BLOCK_OUTS channels by BLOCK_OUTS columns at a
    time by cpu_tiles.transpose_block, the rest value by value."""
    samples, channels, height, width = x.shape
    flat_x = x.reshape(-1)
    whole_c = channels - channels % BLOCK_OUTS
    for row in range(row0, row1):
        r, n, phase = row % hq, row // hq % samples, row // hq // samples
        a, b = phase // sw, phase % sw
        base = row * wq * channels
        xt[base:base + wq * channels] = 0
        h = sh * r + a - ph
        if h < 0 or h >= height:
            continue
        first, last = inside_range(pw, b, sw, width, wq)
        done = first
        if sw == 1:
            done = first + (last - first) // BLOCK_OUTS * BLOCK_OUTS
            for c in range(0, whole_c, BLOCK_OUTS):
                source = ((n * channels + c) * height + h) * width + first + b - pw
                for q in range(first, done, BLOCK_OUTS):
                    transpose_block(flat_x, source + q - first, height * width, xt, base + q * channels + c, channels)
        for c in range(channels):
            for q in range(done if c < whole_c else first, last):
                xt[base + q * channels + c] = x[n, c, h, sw * q + b - pw]


@njit(**THREADED)
def pack_outputs(gy, gpack, b0, b1):
    """gpack[b, t, o] = gy[n, b*BLOCK_OUTS + o, h, w] for t = (n, h, w), zeros past the last
    channel, for the blocks b0 <= b < b1."""
    samples, outs, ho, wo = gy.shape
    pixels = ho * wo
    flat = gy.reshape(-1)
    for b in range(b0, b1):
        for n in range(samples):
            block = gpack[b, n * pixels:(n + 1) * pixels]
            for o in range(BLOCK_OUTS):
                channel = b * BLOCK_OUTS + o
                if channel >= outs:
                    block[:, o] = 0
                    continue
                start = (n * outs + channel) * pixels
                for p in range(pixels):
                    block[p, o] = flat[start + p]


@njit(**THREADED)
def pixel_offsets(samples, ho, wo, hq, wq, channels, offsets):
    """offsets[t] = where output pixel t = (n, h, w)'s window starts in xt: (n*Hq*Wq + h*Wq +
    w) * C, in the first phase's planes."""
    t = 0
    for n in range(samples):
        for h in range(ho):
            for w in range(wo):
                offsets[t] = ((n * hq + h) * wq + w) * channels
                t += 1


@njit(**THREADED)
def gemm_tiles(xt, gpack, offsets, zeros, samples, channels, hq, wq, sh, sw, gw, u0, u1, targets):
    """The units u0 <= u < u1, u = (tap k = (i, j), channel pair, block of output channels),
    blocks fastest: gw[o, c, i, j] for the block's output channels by the pair's 2*lanes
    input channels, the sum over the pixels t of gpack's column by xt at t's window shifted to
    tap (i, j) (phase (i % sh, j % sw), (i // sh, j // sw) into it). targets: this thread's."""
    outs, _, kh, kw = gw.shape
    lanes = lanes_of(xt.itemsize)
    blocks, pixels = gpack.shape[0], gpack.shape[1]
    pairs = -(-channels // (PIXEL_VECTORS * lanes))
    flat_w, flat_g = gw.reshape(-1), gpack.reshape(-1)
    plane, phase_values = channels * kh * kw, samples * hq * wq * channels
    for u in range(u0, u1):
        b, pair, k = u % blocks, u // blocks % pairs, u // blocks // pairs
        i, j = k // kw, k % kw
        c0 = pair * PIXEL_VECTORS * lanes
        start = ((i % sh) * sw + j % sw) * phase_values + (i // sh * wq + j // sw) * channels + c0
        for lane in range(PIXEL_VECTORS * lanes):
            c = c0 + lane
            targets[lane] = c * kh * kw if c < channels else -1
        fma_tile(xt, start, start + lanes, offsets, flat_g, b * pixels * BLOCK_OUTS, zeros, flat_w,
                 b * BLOCK_OUTS * plane + k, targets, 0, 0, plane, min(BLOCK_OUTS, outs - b * BLOCK_OUTS))
