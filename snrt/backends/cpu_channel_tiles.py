"""Convolution over narrow maps by vectors of output channels: every lane an output.

cpu_tiles' vectors hold output pixels. Over maps narrower than a vector (the 14x14, 8x8 and
7x7 maps of ResNets' last stages) they run along t = h*Wq + w across rows and compute the
padding columns too: an 8x8 map's vectors are 80% outputs, a 7x7's 78%, and every tap's
pixel vectors are loads that straddle cache lines; rows that are not whole vectors (56 or 28
wide) end in a partial one. Here the vectors hold output channels: a tile is TILE_PIXELS
output pixels, each read from its own place in the padded planes (`bases`), by TILE_VECTORS
vectors of consecutive output channels. For each tap k = (c, i, j) it loads the block's
weight vectors (wpack[b, k, :], contiguous) and broadcasts each pixel's input value
x[bases[p] + offsets[k]]: 4 + 6 loads for 24 multiply-adds with AVX-512's 32 registers, no
lane computing padding. The price is the store: each sum vector is one pixel's outputs, a
value every H*W in NCHW, stored lane by lane once per chunk of taps.

Each block of output channels runs all the tiles of two samples in turn, a chunk of taps at a
time (`chunk_taps`: that block's weights of the chunk and the rows of the planes its tiles
read at a time, about CHUNK_BYTES), so that both are read from cache; between chunks the sums
are stored and read back. The input is padded and split into phase planes as cpu_tiles pads
it (two samples at a time, `padded_values`), the weight packed by cpu_tiles.pack_weight into
blocks of tile_channels; a layer serves when its output channels are a whole number of such
blocks (cpu_conv._channel_tiles). Each output value is the same chain of multiply-adds as in
cpu_tiles (bias, then the taps in order, one fused multiply-add each): the same bits as the
pixel tiles, on any number of threads.
"""

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic
import llvmlite.ir as ir

from snrt.backends.cpu_common import THREADED
from snrt.backends.cpu_dots import VECTOR_BYTES
from snrt.backends.cpu_tiles import addressing, lanes_of, pad_sample, phase_planes, vector_ops

TILE_VECTORS = 4  # vectors of output channels a tile holds
CHUNK_BYTES = 1 << 19  # input planes and weights a chunk of taps reads: half the L2 cache of a core here
TILE_PIXELS = (24 if VECTOR_BYTES == 64 else 12) // TILE_VECTORS  # 24 sum vectors of AVX-512's 32 registers, 12 of 16


def tile_channels(itemsize):
    """Output channels a tile (and a block of the packed weight) holds: TILE_VECTORS vectors."""
    return TILE_VECTORS * lanes_of(itemsize)


@intrinsic
def channel_tile(typingctx, x, bases, offsets, k0, k1, w, wstart, bias, bstart, y, ystart, targets, plane):
    """For the pixels p < TILE_PIXELS and the output channels o < tile_channels of a block:
    value = start + sum over k0 <= k < k1 of w[wstart + k*tile_channels + o] * x[bases[p] +
    offsets[k]], stored at y[ystart + targets[p] + o*plane] for each pixel whose target is not
    negative; start is bias[bstart + o] for the first taps (k0 = 0), else the value stored there
    (the sum so far). Contiguous arrays, float32 or float64 (lanes_of their itemsize); bases,
    offsets and targets int64."""
    dtype = x.dtype
    if dtype not in (types.float32, types.float64) or any(a.dtype != dtype or a.layout != "C" for a in (x, w, bias, y)) \
            or any(a.dtype != types.int64 or a.layout != "C" for a in (bases, offsets, targets)):
        return None
    tile_vectors, tile_pixels = TILE_VECTORS, TILE_PIXELS
    lanes = lanes_of(8 if dtype == types.float64 else 4)
    width = tile_vectors * lanes
    arguments = (x, bases, offsets, types.intp, types.intp, w, types.intp, bias, types.intp, y, types.intp, targets,
                 types.intp)

    def codegen(context, builder, signature, args):
        k0, k1, wstart, bstart, ystart, plane = (args[i] for i in (3, 4, 6, 8, 10, 12))
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 1, 2, 5, 7, 9, 11)]
        xs, bases_d, offsets_d, ws, biases, ys, targets_d = (a.data for a in arrays)
        index = wstart.type
        vector, fma, broadcast = vector_ops(builder, dtype, lanes)
        at, vector_at = addressing(builder, index, vector)

        starts = [builder.load(vector_at(biases, builder.add(bstart, ir.Constant(index, v * lanes))), align=4)
                  for v in range(tile_vectors)]
        sums = [[cgutils.alloca_once_value(builder, start) for start in starts]
                for _ in range(tile_pixels)]  # promoted to registers
        targets = [builder.load(at(targets_d, p)) for p in range(tile_pixels)]

        def outputs(p, v):
            """Where pixel p's channels of vector v are in y, lane by lane."""
            first = builder.add(ystart, targets[p])
            return [at(ys, builder.add(first, builder.mul(ir.Constant(index, v * lanes + lane), plane)))
                    for lane in range(lanes)]

        with builder.if_then(builder.icmp_signed(">", k0, ir.Constant(index, 0))):  # go on from the sums so far
            for p in range(tile_pixels):
                with builder.if_then(builder.icmp_signed(">=", targets[p], ir.Constant(index, 0))):
                    for v in range(tile_vectors):
                        value = ir.Constant(vector, ir.Undefined)
                        for lane, pointer in enumerate(outputs(p, v)):
                            value = builder.insert_element(value, builder.load(pointer), ir.Constant(ir.IntType(32), lane))
                        builder.store(value, sums[p][v])
        pixel_starts = [at(xs, builder.load(at(bases_d, p))) for p in range(tile_pixels)]
        with cgutils.for_range(builder, builder.sub(k1, k0)) as loop:
            k = builder.add(k0, loop.index)
            offset = builder.load(at(offsets_d, k))
            row = builder.add(wstart, builder.mul(k, ir.Constant(index, width)))
            weights = [builder.load(vector_at(ws, builder.add(row, ir.Constant(index, v * lanes))), align=4)
                       for v in range(tile_vectors)]
            for p in range(tile_pixels):
                value = broadcast(builder.load(at(pixel_starts[p], offset)))
                for v in range(tile_vectors):
                    builder.store(fma(weights[v], value, builder.load(sums[p][v])), sums[p][v])
        for p in range(tile_pixels):
            with builder.if_then(builder.icmp_signed(">=", targets[p], ir.Constant(index, 0))):
                for v in range(tile_vectors):
                    value = builder.load(sums[p][v])
                    for lane, pointer in enumerate(outputs(p, v)):
                        builder.store(builder.extract_element(value, ir.Constant(ir.IntType(32), lane)), pointer)
        return context.get_dummy_value()

    return types.void(*arguments), codegen


def chunk_taps(channels, kernel, stride, planes, itemsize):
    """Taps of a chunk (cpu_channel_tiles' convolve): the taps of as many input channels (at
    least one) as fit CHUNK_BYTES with their weights in one block and the rows of their
    planes that tiles read at a time (a tile's pixels may span two output rows, each reading
    kh // sh + 1 rows of every phase plane)."""
    (kh, kw), (sh, sw) = kernel, stride
    rows = sh * sw * (kh // sh + 2) * planes[1]
    per_channel = (rows + kh * kw * tile_channels(itemsize)) * itemsize
    return max(1, min(channels, CHUNK_BYTES // per_channel)) * kh * kw


def group_pixels(ho, wo):
    """Output pixels a group (two samples) lists at most, filled up to whole tiles."""
    return -(-2 * ho * wo // TILE_PIXELS) * TILE_PIXELS


@njit(**THREADED)
def convolve_channel_tiles(x, wpack, biases, offsets, ph, pw, sh, sw, chunk, y, r0, r1, xpad, bases, targets):
    """y rows r0 <= r < r1 (r = n*Ho + h) of the convolution of x (N, C, H, W) zero-padded by
    (ph, pw) at stride (sh, sw), by channel_tile's tiles, the weight packed by
    cpu_tiles.pack_weight in blocks of tile_channels output channels (the layer's output
    channels a whole number of them). Two samples at a time (a group) are padded into xpad
    (cpu_tiles.padded_values) and their output pixels listed (bases: where each reads in xpad,
    targets: where it is stored in y), filled up to whole tiles with the last pixel again,
    stored nowhere; then, `chunk` taps at a time (chunk_taps), each block of output channels
    runs every tile of the group, so that a block's weights are read from cache while they
    serve the whole group, and the rows of those taps' planes that the tiles read stay in
    cache from one block to the next. xpad, bases and targets (group_pixels int64): this
    thread's scratch."""
    outs, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    hq, wq = phase_planes(x.shape[2], x.shape[3], (ph, pw), (sh, sw))
    blocks, taps, width = wpack.shape[0], wpack.shape[1], wpack.shape[2]
    flat_w, flat_y, plane = wpack.reshape(-1), y.reshape(-1), ho * wo
    sample_values = sh * sw * x.shape[1] * hq * wq
    r = r0
    while r < r1:
        filled = 0
        for s in range(2):
            if r >= r1:
                break
            n, ha = r // ho, r % ho
            hb = min(ho, ha + r1 - r)
            pad_sample(x, n, ph, pw, sh, sw, hq, wq, xpad[s * sample_values:(s + 1) * sample_values])
            for h in range(ha, hb):
                for w in range(wo):
                    bases[filled] = s * sample_values + h * wq + w
                    targets[filled] = n * outs * plane + h * wo + w
                    filled += 1
            r += hb - ha
        while filled % TILE_PIXELS:  # a last, partial tile: its last pixel again
            bases[filled], targets[filled] = bases[filled - 1], -1
            filled += 1
        for k0 in range(0, taps, chunk):
            for b in range(blocks):
                for first in range(0, filled, TILE_PIXELS):
                    channel_tile(xpad, bases[first:], offsets, k0, min(taps, k0 + chunk), flat_w, b * taps * width,
                                 biases, b * width, flat_y, b * width * plane, targets[first:], plane)

