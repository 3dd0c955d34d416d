"""Convolution on the CPU by broadcast multiply-adds: vectors of output pixels, no column
matrix, in NCHW as the plan stores it.

A sample's input is copied once into zero-padded planes, xpad[c, h, w] flat (Hp x Wp each).
At stride 1, output pixel (h, w) at tap k = (c, i, j) reads xpad[c*Hp*Wp + (h + i)*Wp + w +
j] = xpad[t + offsets[k]], t = h*Wp + w: so a vector of pixels t ... t + lanes - 1
(`lanes_of`) reads one contiguous vector per tap, and

    y[o, pixels] = bias[o] + sum over k of W[o, k] * xpad[t + offsets[k] : + lanes]

is one multiply-add per tap and output channel, the weight broadcast across the lanes.
`fma_tile` (LLVM IR, as cpu_dots) keeps a tile of BLOCK_OUTS output channels by 2 pixel
vectors in registers (16 accumulators with AVX-512, 8 with AVX) through the K = C*kh*kw
taps: 2 loads and BLOCK_OUTS broadcasts for 2*BLOCK_OUTS multiply-adds, nothing summed
across lanes. The weights are packed per block of output channels, wpack[b, k, o].

Which pixels a vector holds: maps at least `lanes` wide go row by row (a row's last vector
partly filled); narrower maps (8x8, 7x7, 4x4), and those whose rows would leave many lanes
empty (17 wide: 32 lanes a row; `by_rows`), along t across rows, computing the Wq - Wo
columns of padding too and storing only the pixels of the map, so that an 8-wide map fills
80% of the lanes instead of half. Each vector's lanes name the output value they store
(`targets`, -1 for none); a vector whose lanes are one full run of a row is stored whole.
Two samples are padded at a time and their vectors taken two by two as one list, so that a
sample's odd last vector shares a tile with the next sample's first.

At stride (sh, sw) the padded input is split into its sh*sw phase planes (`phase_planes`),
padded row sh*h' + a and column sw*w' + b of phase (a, b) at (h', w'): output pixel (h, w) at
tap (i, j) reads phase (i % sh, j % sw) at (h + i // sh, w + j // sw), so t = h*Wq + w and
the vectors are contiguous again; stride 1 is one phase, the padded input itself.

A 1x1 convolution needs no padding: `pointwise_tiles` reads x where it is (taps c*H*W), its
vectors along each sample's H*W pixels (at least the lanes; a last partial vector is moved
back to end at the sample's last pixel, its repeated lanes not stored), a tile's two vectors
of one sample or of two.

Each output value is one chain of multiply-adds in tap order, in one thread: the same bits
on any number of threads. Serves cpu_conv's forward and its data gradient (at stride 1 a
stride-1 convolution of gy with the flipped weight).
"""

import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, register_jitable

from snrt.backends.cpu_common import THREADED, threads_for
from snrt.backends.cpu_copy import copy_strided, vector_memory
from snrt.backends.cpu_dots import VECTOR_BYTES
from snrt.backends.cpu_parallel import run_split

BLOCK_OUTS = 8 if VECTOR_BYTES == 64 else 4  # output channels a tile holds: 2*BLOCK_OUTS accumulators
PIXEL_VECTORS = 2  # pixel vectors a tile holds (fma_tile's p0 and p1)
INDEX = np.int64  # the dtype of the tile kernels' index arrays (offsets, targets)
PACK_SPLIT = 1 << 16  # packed weight values from which the packing is split among the kernel threads
ROWS_MARGIN = 1.25  # lanes row-by-row vectors may compute, per lane along the padded rows (by_rows)


@register_jitable
def lanes_of(itemsize):
    """Pixels a vector holds, of values of `itemsize` bytes (16 float32 with AVX-512)."""
    return VECTOR_BYTES // itemsize


def vector_ops(builder, dtype, lanes):
    """(vector type, fused multiply-add of three vectors, broadcast of a scalar to every lane)
    for `lanes` values of numba's float `dtype`, in the module `builder` writes."""
    single = dtype == types.float32
    vector = ir.VectorType(ir.FloatType() if single else ir.DoubleType(), lanes)
    undefined = ir.Constant(vector, ir.Undefined)
    lane0 = ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes)
    fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                         f"llvm.fma.v{lanes}{'f32' if single else 'f64'}")

    def broadcast(value):
        return builder.shuffle_vector(builder.insert_element(undefined, value, ir.Constant(ir.IntType(32), 0)),
                                      undefined, lane0)

    def multiply_add(a, b, c):
        return builder.call(fma, [a, b, c])

    return vector, multiply_add, broadcast


def addressing(builder, index, vector):
    """(at, vector_at) for the kernels' IR: at(pointer, i), the address of element i (an IR
    value or a Python int, of type `index`) of `pointer`; vector_at(pointer, i), that address
    as a pointer to `vector`."""

    def at(pointer, i):
        return builder.gep(pointer, [i if isinstance(i, ir.Value) else ir.Constant(index, i)])

    def vector_at(pointer, i):
        return builder.bitcast(at(pointer, i), vector.as_pointer())

    return at, vector_at


@intrinsic
def fma_tile(typingctx, x, p0, p1, offsets, w, wstart, bias, y, ystart, targets, whole0, whole1, plane, outs):
    """For the pixel vectors v = 0, 1 (starting at x[p_v]) and the output channels o < outs of
    a block: value = bias[o] + sum over k of w[wstart + k*BLOCK_OUTS + o] * x[p_v + offsets[k]
    + lane], stored at y[ystart + targets[v*lanes + lane] + o*plane] for each lane whose target
    is not negative (whole_v: every lane's target follows the first, one vector store).
    Contiguous arrays, float32 or float64 (lanes_of their itemsize), offsets and targets int64."""
    dtype = x.dtype
    if dtype not in (types.float32, types.float64) or any(a.dtype != dtype or a.layout != "C" for a in (x, w, bias, y)) \
            or any(a.dtype != types.int64 or a.layout != "C" for a in (offsets, targets)):
        return None
    arguments = (x, types.intp, types.intp, offsets, w, types.intp, bias, y, types.intp, targets, types.intp,
                 types.intp, types.intp, types.intp)
    lanes = lanes_of(8 if dtype == types.float64 else 4)

    def codegen(context, builder, signature, args):
        p0_v, p1_v, wstart, ystart, whole0_v, whole1_v, plane_v, outs_v = (args[i] for i in (1, 2, 5, 8, 10, 11, 12, 13))
        arrays = [context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 3, 4, 6, 7, 9)]
        xs, offsets_d, ws, biases, ys, targets_d = (a.data for a in arrays)
        count = builder.extract_value(arrays[1].shape, 0)
        index = p0_v.type
        vector, fma, broadcast = vector_ops(builder, dtype, lanes)
        at, _ = addressing(builder, index, vector)
        sums = [[cgutils.alloca_once_value(builder, broadcast(builder.load(at(biases, o))))
                 for _ in range(PIXEL_VECTORS)] for o in range(BLOCK_OUTS)]  # promoted to registers
        starts = [at(xs, p) for p in (p0_v, p1_v)]
        with cgutils.for_range(builder, count) as loop:
            offset = builder.load(at(offsets_d, loop.index))
            pixels = [builder.load(builder.bitcast(at(start, offset), vector.as_pointer()), align=4)
                      for start in starts]
            weights = at(ws, builder.add(wstart, builder.mul(loop.index, ir.Constant(index, BLOCK_OUTS))))
            for o in range(BLOCK_OUTS):
                weight = broadcast(builder.load(at(weights, o)))
                for v in range(PIXEL_VECTORS):
                    builder.store(fma(weight, pixels[v], builder.load(sums[o][v])), sums[o][v])
        for o in range(BLOCK_OUTS):
            with builder.if_then(builder.icmp_signed("<", ir.Constant(index, o), outs_v)):
                shift = builder.add(ystart, builder.mul(ir.Constant(index, o), plane_v))
                for v, whole in enumerate((whole0_v, whole1_v)):
                    value = builder.load(sums[o][v])
                    first = builder.load(at(targets_d, v * lanes))
                    with builder.if_else(builder.icmp_signed("!=", whole, ir.Constant(index, 0))) as (one, each):
                        with one:
                            target = at(ys, builder.add(first, shift))
                            builder.store(value, builder.bitcast(target, vector.as_pointer()), align=4)
                        with each:
                            for lane in range(lanes):
                                target = builder.load(at(targets_d, v * lanes + lane))
                                with builder.if_then(builder.icmp_signed(">=", target, ir.Constant(index, 0))):
                                    builder.store(builder.extract_element(value, ir.Constant(ir.IntType(32), lane)),
                                                  at(ys, builder.add(target, shift)))
        return context.get_dummy_value()

    return types.void(*arguments), codegen


RUN_VECTORS = 4  # the vectors of outputs fma_run keeps in registers


@intrinsic
def fma_run(typingctx, plane, kh, kw, row_step, column_step, taps, bias, out, count):
    """out[t] = bias + sum over the taps (i, j) of taps[i*kw + j] * plane[t + i*row_step +
    j*column_step], for t < count rounded up to a whole number of RUN_VECTORS vectors (out and
    plane must reach that far): a depthwise convolution of one channel on its padded plane's
    grid. RUN_VECTORS accumulators in registers through the kh*kw taps, each tap a broadcast
    and RUN_VECTORS loads, one chain of multiply-adds per output in tap order. Contiguous 1-d
    arrays, float32 or float64."""
    dtype = plane.dtype
    if dtype not in (types.float32, types.float64) or any(a.dtype != dtype or a.ndim != 1 or a.layout != "C"
                                                          for a in (plane, taps, out)):
        return None
    lanes = lanes_of(8 if dtype == types.float64 else 4)

    def codegen(context, builder, signature, args):
        plane_v, kh_v, kw_v, row_v, column_v, taps_v, bias_v, out_v, count_v = args
        xs, ws, ys = (context.make_array(signature.args[i])(context, builder, v).data
                      for i, v in ((0, plane_v), (5, taps_v), (7, out_v)))
        vector, fma, broadcast = vector_ops(builder, dtype, lanes)
        index = count_v.type
        step = ir.Constant(index, RUN_VECTORS * lanes)
        _, at = addressing(builder, index, vector)

        start_bias = broadcast(context.cast(builder, bias_v, signature.args[6], dtype))
        groups = builder.sdiv(builder.add(count_v, ir.Constant(index, RUN_VECTORS * lanes - 1)), step)
        with cgutils.for_range(builder, groups) as group:
            base = builder.mul(group.index, step)
            sums = [cgutils.alloca_once_value(builder, start_bias) for _ in range(RUN_VECTORS)]
            with cgutils.for_range(builder, kh_v) as row:
                with cgutils.for_range(builder, kw_v) as column:
                    offset = builder.add(base, builder.add(builder.mul(row.index, row_v),
                                                           builder.mul(column.index, column_v)))
                    weight = broadcast(builder.load(builder.gep(ws, [builder.add(builder.mul(row.index, kw_v),
                                                                                 column.index)])))
                    for v in range(RUN_VECTORS):
                        pixels = builder.load(at(xs, builder.add(offset, ir.Constant(index, v * lanes))), align=4)
                        builder.store(fma(weight, pixels, builder.load(sums[v])), sums[v])
            for v in range(RUN_VECTORS):
                builder.store(builder.load(sums[v]), at(ys, builder.add(base, ir.Constant(index, v * lanes))), align=4)
        return context.get_dummy_value()

    return types.void(plane, types.intp, types.intp, types.intp, types.intp, taps, bias, out, types.intp), codegen


@intrinsic
def fma_channel_run(typingctx, source, base, offsets, tap_rows, taps, taps_stride, bias, with_bias, out, out_start,
                    count):
    """out[out_start + o] = (with_bias: bias[o], else 0) + sum over k of taps[tap_rows[k]*taps_stride
    + o] * source[base + offsets[k] + o] for the channels o < count: a depthwise convolution's
    output pixel (or a run of its channels) over channels-last data (source an (H, W, O) input,
    offsets the shifts of the taps it takes in it, tap_rows those taps' rows of taps, a (kh*kw,
    O) weight from the run's first channel on, O = taps_stride), RUN_VECTORS vectors of channels
    kept in registers through all the taps, one chain of multiply-adds per output in the listed
    order. A group of vectors past `count` is masked (whole groups are not): nothing past the
    run's channels is read or written. Contiguous 1-d arrays, float32 or float64; offsets and tap_rows int64."""
    dtype = source.dtype
    if dtype not in (types.float32, types.float64) or any(a.dtype != dtype or a.ndim != 1 or a.layout != "C"
                                                          for a in (source, taps, bias, out)) \
            or any(a.dtype != types.int64 or a.layout != "C" for a in (offsets, tap_rows)):
        return None
    lanes = lanes_of(8 if dtype == types.float64 else 4)

    def codegen(context, builder, signature, args):
        base_v, stride_v, with_bias_v, out_start_v, count_v = (args[i] for i in (1, 5, 7, 9, 10))
        xs, offsets_d, rows_d, ws, biases, ys = (context.make_array(signature.args[i])(context, builder, args[i]).data
                                                 for i in (0, 2, 3, 4, 6, 8))
        taps_count = builder.extract_value(context.make_array(signature.args[2])(context, builder, args[2]).shape, 0)
        vector, fma, _ = vector_ops(builder, dtype, lanes)
        _, masked_load, masked_store, lane_mask = vector_memory(builder, dtype, lanes)
        index = count_v.type
        step = ir.Constant(index, RUN_VECTORS * lanes)
        _, at = addressing(builder, index, vector)

        zero = ir.Constant(vector, [0.0] * lanes)
        has_bias = builder.icmp_signed("!=", with_bias_v, ir.Constant(with_bias_v.type, 0))

        def run(channels, load, store):
            """The sums of the vectors of `channels` through the listed taps, stored: load(pointer,
            v) and store(value, pointer, v) move vector v (masked or whole); the bias's lanes
            are read masked (an empty bias: none)."""
            bias_masks = [lane_mask(builder.select(has_bias, builder.sub(count_v, c), ir.Constant(index, 0)))
                          for c in channels]
            sums = [cgutils.alloca_once_value(builder, builder.select(has_bias, masked_load(at(biases, c), mask), zero))
                    for c, mask in zip(channels, bias_masks)]
            with cgutils.for_range(builder, taps_count) as tap:
                shift = builder.add(base_v, builder.load(builder.gep(offsets_d, [tap.index])))
                row = builder.mul(builder.load(builder.gep(rows_d, [tap.index])), stride_v)
                for v, c in enumerate(channels):
                    weight = load(at(ws, builder.add(row, c)), v)
                    value = load(at(xs, builder.add(shift, c)), v)
                    builder.store(fma(weight, value, builder.load(sums[v])), sums[v])
            for v, c in enumerate(channels):
                store(builder.load(sums[v]), at(ys, builder.add(out_start_v, c)), v)

        groups = builder.sdiv(builder.add(count_v, ir.Constant(index, RUN_VECTORS * lanes - 1)), step)
        with cgutils.for_range(builder, groups) as group:
            first = builder.mul(group.index, step)
            channels = [builder.add(first, ir.Constant(index, v * lanes)) for v in range(RUN_VECTORS)]
            whole = builder.icmp_signed("<=", builder.add(first, step), count_v)
            with builder.if_else(whole) as (full, part):
                with full:  # plain loads and stores: masked ones cost more (cpu_depthwise's 0.17 -> 0.15 ms)
                    run(channels, lambda pointer, v: builder.load(pointer, align=1),
                        lambda value, pointer, v: builder.store(value, pointer, align=1))
                with part:  # the vectors past `count` masked
                    masks = [lane_mask(builder.sub(count_v, c)) for c in channels]
                    run(channels, lambda pointer, v: masked_load(pointer, masks[v]),
                        lambda value, pointer, v: masked_store(value, pointer, masks[v]))
        return context.get_dummy_value()

    return types.void(source, types.intp, offsets, tap_rows, taps, types.intp, bias, types.intp, out, types.intp,
                      types.intp), codegen


def run_slack(itemsize):
    """Values fma_run may compute (out) and read (plane) past `count`: up to a whole group."""
    return RUN_VECTORS * lanes_of(itemsize)


@register_jitable
def phase_planes(height, width, padding, stride):
    """(Hq, Wq): the planes a sample's input is padded into at `stride`, one per phase (a, b) of
    (row, column) mod stride: padded row sh*h' + a and column sw*w' + b at (h', w')."""
    (ph, pw), (sh, sw) = padding, stride
    return -(-(height + 2 * ph) // sh), -(-(width + 2 * pw) // sw)


def padded_values(channels, hq, wq, phases, kw, itemsize):
    """Values of a group's padded planes: two samples' (phases x channels planes of Hq x Wq),
    then lanes + kw more, as far as the last vector's lanes read past them (lanes whose values
    are not stored)."""
    return 2 * phases * channels * hq * wq + lanes_of(itemsize) + kw


def pack_weight(weight, hq, wq, sh, sw, wpack, biases, offsets, bias):
    """Fill wpack (blocks, K, width) with weight (O, C, kh, kw), any strides, as wpack[b, (c, i,
    j), o] = weight[b*width + o, c, i, j] (zeros past O; width a multiple of BLOCK_OUTS:
    BLOCK_OUTS for fma_tile, a tile's channels for cpu_channel_tiles), the blocks split among
    the kernel threads (pack_rows where the weight is C-contiguous, as a layer's is,
    pack_flipped where it is the data gradient's flipped, transposed view of one, else
    pack_blocks); biases (blocks*width,) with `bias` (empty: none, zeros) and offsets (K,) with
    where each tap reads in the phase planes (Hq, Wq) at stride (sh, sw) (tap_offsets)."""
    outs, channels, kh, kw = weight.shape
    threads = threads_for(wpack.size, PACK_SPLIT)
    unflipped = weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # a data gradient's view, undone
    if weight.flags.c_contiguous:
        run_split(pack_rows, 0, wpack.shape[0], threads, (weight.reshape(outs, -1), wpack))
    elif unflipped.flags.c_contiguous:
        run_split(pack_flipped, 0, wpack.shape[0], threads, (unflipped.reshape(channels, outs, kh * kw), wpack))
    else:
        packed = wpack.reshape(wpack.shape[0], channels, kh, kw, wpack.shape[2])
        run_split(pack_blocks, 0, wpack.shape[0], threads, (weight, packed))
    biases[:] = 0
    biases[:bias.size] = bias
    tap_offsets(channels, kh, kw, sh, sw, hq * wq, wq, offsets)


@intrinsic
def transpose_block(typingctx, source, source_start, row_stride, target, target_start, target_stride):
    """target[target_start + t*target_stride + r] = source[source_start + r*row_stride + t] for
    r, t < BLOCK_OUTS: a square block of BLOCK_OUTS rows transposed in registers, BLOCK_OUTS
    vector loads, log2(BLOCK_OUTS) stages of shuffles between pairs of rows BLOCK_OUTS/2, ...,
    1 apart, and BLOCK_OUTS vector stores. 1-d contiguous arrays of one dtype, float32 or
    float64."""
    dtype = source.dtype
    if dtype not in (types.float32, types.float64) or target.dtype != dtype \
            or any(a.ndim != 1 or a.layout != "C" for a in (source, target)):
        return None
    size = BLOCK_OUTS

    def codegen(context, builder, signature, args):
        source_v, source_start_v, stride_v, target_v, target_start_v, target_stride_v = args
        sources, targets = (context.make_array(signature.args[i])(context, builder, v).data
                            for i, v in ((0, source_v), (3, target_v)))
        vector, _, _ = vector_ops(builder, dtype, size)
        index, align = source_start_v.type, 4 if dtype == types.float32 else 8
        _, at = addressing(builder, index, vector)

        rows = [builder.load(at(sources, builder.add(source_start_v, builder.mul(stride_v, ir.Constant(index, r)))),
                             align=align) for r in range(size)]
        distance = size // 2
        lanes = ir.VectorType(ir.IntType(32), size)
        while distance:  # rows i and i + distance swap their blocks of `distance` values across the diagonal
            low = ir.Constant(lanes, [j if not j & distance else size + j - distance for j in range(size)])
            high = ir.Constant(lanes, [j + distance if not j & distance else size + j for j in range(size)])
            for i in (i for i in range(size) if not i & distance):
                a, b = rows[i], rows[i + distance]
                rows[i], rows[i + distance] = builder.shuffle_vector(a, b, low), builder.shuffle_vector(a, b, high)
            distance //= 2
        for t in range(size):
            builder.store(rows[t], at(targets, builder.add(target_start_v, builder.mul(target_stride_v,
                                                                                       ir.Constant(index, t)))),
                          align=align)
        return context.get_dummy_value()

    return types.void(source, types.intp, types.intp, target, types.intp, types.intp), codegen


@njit(**THREADED)
def pack_rows(rows, wpack, b0, b1):
    """wpack[b, k, o] = rows[b*width + o, k] (0 past the rows) for the blocks b0 <= b < b1 of
    rows (O, K), C-contiguous, wpack (blocks, K, width): BLOCK_OUTS rows by BLOCK_OUTS taps at a
    time by transpose_block, the last K % BLOCK_OUTS taps and rows past the last whole
    BLOCK_OUTS value by value."""
    outs, taps = rows.shape
    width = wpack.shape[2]
    flat_rows, flat_pack = rows.reshape(-1), wpack.reshape(-1)
    whole = taps - taps % BLOCK_OUTS
    for b in range(b0, b1):
        for part in range(0, width, BLOCK_OUTS):
            first, start = b * width + part, 0
            if first + BLOCK_OUTS <= outs:
                for k in range(0, whole, BLOCK_OUTS):
                    transpose_block(flat_rows, first * taps + k, taps, flat_pack, (b * taps + k) * width + part, width)
                start = whole
            for k in range(start, taps):
                for o in range(BLOCK_OUTS):
                    wpack[b, k, part + o] = rows[first + o, k] if first + o < outs else 0


@njit(**THREADED)
def pack_flipped(layer, wpack, b0, b1):
    """wpack[b, (o, i, j), c] = layer[o, b*width + c, T-1 - (i*kw + j)] (0 past the channels)
    for the blocks b0 <= b < b1: the packing of the data gradient's weight W'[c, o, i, j] =
    W[o, c, kh-1-i, kw-1-j] from the layer's C-contiguous W as `layer` (O, C, T = kh*kw).
    BLOCK_OUTS channels by BLOCK_OUTS taps at a time by transpose_block, its rows written in
    reverse order of the taps (a negative target stride); the last T % BLOCK_OUTS taps (a 1x1's
    only one: a contiguous run of channels) and channels past the last whole BLOCK_OUTS value
    by value."""
    outs, channels, taps = layer.shape
    width = wpack.shape[2]
    flat_layer, flat_pack = layer.reshape(-1), wpack.reshape(-1)
    whole = taps - taps % BLOCK_OUTS
    for b in range(b0, b1):
        first = b * width
        end = min(width, channels - first)  # the block's channels (past them: zeros)
        parts = max(0, end) // BLOCK_OUTS * BLOCK_OUTS  # those in whole BLOCK_OUTS
        for o in range(outs):
            row = b * outs * taps + o * taps + taps - 1  # wpack's row of tap 0, at (o, T-1)
            for part in range(0, parts, BLOCK_OUTS):
                for t in range(0, whole, BLOCK_OUTS):
                    transpose_block(flat_layer, (o * channels + first + part) * taps + t, taps, flat_pack,
                                    (row - t) * width + part, -width)
            for t in range(taps):
                target, source = (row - t) * width, (o * channels + first) * taps + t
                for c in range(parts if t < whole else 0, end):
                    flat_pack[target + c] = flat_layer[source + c * taps]
                for c in range(max(end, 0), width):
                    flat_pack[target + c] = 0


@njit(**THREADED)
def pack_blocks(weight, packed, b0, b1):
    """packed[b, c, i, j, o] = weight[b*width + o, c, i, j] (0 past O) for the blocks b0 <= b <
    b1 of packed (blocks, C, kh, kw, width): each block reads its rows of the weight side by
    side, value after value, at whatever strides the weight has (a flipped, transposed or
    strided view, which NumPy's copy walked slowly)."""
    outs, channels, kh, kw = weight.shape
    width = packed.shape[4]
    for b in range(b0, b1):
        for c in range(channels):
            for i in range(kh):
                for j in range(kw):
                    for o in range(width):
                        row = b * width + o
                        packed[b, c, i, j, o] = weight[row, c, i, j] if row < outs else 0


@njit(**THREADED)
def tap_offsets(channels, kh, kw, sh, sw, plane_values, row_values, offsets):
    """offsets[(c, i, j)]: output pixel (h, w) reads padded x[c, sh*h + i, sw*w + j], which is
    at (h + i // sh, w + j // sw) of the plane of phase (i % sh, j % sw) and channel c (plane
    (a*sw + b)*C + c), planes `plane_values` and rows `row_values` apart; at stride 1 that is
    c*plane_values + i*row_values + j."""
    for k in range(offsets.size):
        c, tap = k // (kh * kw), k % (kh * kw)
        i, j = tap // kw, tap % kw
        plane = ((i % sh) * sw + j % sw) * channels + c
        offsets[k] = plane * plane_values + i // sh * row_values + j // sw


@njit(**THREADED, inline="always")
def inside_range(pad, phase, stride, size, count):
    """(first, last): the positions first <= q < last of a phase's `count` that fall inside x
    along one axis, stride*q + phase - pad in [0, size) (at stride 1 without a division)."""
    if stride == 1:
        return max(0, pad - phase), min(count, size + pad - phase)
    return max(0, -(-(pad - phase) // stride)), min(count, (size - 1 + pad - phase) // stride + 1)


@njit(**THREADED, inline="always")
def fill_phase(dst, start, wq, rows, src, src_start, height, width, ph, pw, sh, sw, a, b):
    """dst[start + r*Wq + q] = padded x[sh*r + a, sw*q + b] for the `rows` rows r of phase (a,
    b)'s plane of one map (phase_planes), where that is inside the map: x = src[src_start:] as
    height x width values, padded by (ph, pw). The padding is left as it was (zeros)."""
    first, last = inside_range(pw, b, sw, width, wq)
    top, bottom = inside_range(ph, a, sh, height, rows)
    if bottom > top and last > first:
        copy_strided(dst, start + top * wq + first, wq, src, src_start + (sh * top + a - ph) * width + sw * first + b - pw,
                     sh * width, bottom - top, last - first, sw)


@njit(**THREADED)
def pad_sample(x, n, ph, pw, sh, sw, hq, wq, xpad):
    """Sample n of x zero-padded by (ph, pw) into its phase planes (phase_planes): plane
    ((a*sw + b)*C + c) holds padded x[c, sh*h' + a, sw*w' + b] at h'*Wq + w' (at stride 1
    one plane a channel, Wq = W + 2*pw wide)."""
    channels, height, width = x.shape[1], x.shape[2], x.shape[3]
    flat = x.reshape(-1)
    xpad[:sh * sw * channels * hq * wq] = 0
    for a in range(sh):
        for b in range(sw):
            for c in range(channels):
                fill_phase(xpad, ((a * sw + b) * channels + c) * hq * wq, wq, hq, flat,
                           (n * channels + c) * height * width, height, width, ph, pw, sh, sw, a, b)


@register_jitable
def by_rows(wo, wq, lanes):
    """Whether the vectors of a map Wo outputs wide (padded planes Wq wide) go row by row: where
    it is at least `lanes` wide and its rows' whole and partial vectors compute at most
    ROWS_MARGIN times the lanes of runs along t across the rows (which compute the Wq - Wo
    padding columns and store lane by lane where a vector spans two rows). A 17-wide map (the
    phases of a stride-2 data gradient of 32-wide maps) goes along t: 18 lanes a row, not 32."""
    return wo >= lanes and -(-wo // lanes) * lanes <= ROWS_MARGIN * wq


@njit(**THREADED)
def _vector(v, spans, wq, wo, sample_values, plane_values, lanes, targets, slot):
    """The x position of vector v of a group's spans (per sample slot: n, first row, end row,
    vectors), filling targets[slot*lanes:][:lanes] with the y index of each lane's value (-1:
    none); and 1 if that is one whole run of a row. Maps at least `lanes` wide go row by row,
    narrower ones along t = h*Wq + w across rows (only h in the span, w < Wo stored)."""
    s = 0 if v < spans[0, 3] else 1
    v -= s * spans[0, 3]
    n, ha, hb = spans[s, 0], spans[s, 1], spans[s, 2]
    base = n * plane_values
    if by_rows(wo, wq, lanes):
        per_row = (wo + lanes - 1) // lanes
        h, w0 = ha + v // per_row, v % per_row * lanes
        filled = min(lanes, wo - w0)
        for lane in range(lanes):
            targets[slot * lanes + lane] = base + h * wo + w0 + lane if lane < filled else -1
        return s * sample_values + h * wq + w0, 1 if filled == lanes else 0
    first = ha * wq + v * lanes
    for lane in range(lanes):
        h, w = (first + lane) // wq, (first + lane) % wq
        targets[slot * lanes + lane] = base + h * wo + w if h < hb and w < wo else -1
    h, w = first // wq, first % wq
    return s * sample_values + first, 1 if h < hb and w + lanes <= wo else 0  # whole: inside one row


@njit(**THREADED)
def convolve_tiles(x, wpack, biases, offsets, ph, pw, sh, sw, y, r0, r1, xpad, targets, spans):
    """y rows r0 <= r < r1 (r = n*Ho + h) of the convolution of x (N, C, H, W) zero-padded by
    (ph, pw) at stride (sh, sw), the weight packed by pack_weight for its phase planes (at
    stride 1 one plane a channel, the padded input itself). Two samples at a time (a group): both
    padded into xpad (2 * padded_values), their vectors one list, taken two by two, so that a
    sample's odd last vector pairs with the next's first. targets (PIXEL_VECTORS*lanes int64)
    and spans ((2, 4) int64) are scratch; all three this thread's own."""
    outs, ho, wo = y.shape[1], y.shape[2], y.shape[3]
    hq, wq = phase_planes(x.shape[2], x.shape[3], (ph, pw), (sh, sw))
    blocks, taps = wpack.shape[0], wpack.shape[1]
    flat_w, flat_y, plane = wpack.reshape(-1), y.reshape(-1), ho * wo
    sample_values = sh * sw * x.shape[1] * hq * wq
    lanes = lanes_of(x.itemsize)
    per_row = (wo + lanes - 1) // lanes
    r = r0
    while r < r1:
        count = 0
        for s in range(2):
            n, ha = r // ho, r % ho
            hb = min(ho, ha + r1 - r) if r < r1 else ha
            vectors = (hb - ha) * per_row if by_rows(wo, wq, lanes) else ((hb - ha) * wq + lanes - 1) // lanes
            spans[s, 0], spans[s, 1], spans[s, 2], spans[s, 3] = n, ha, hb, vectors
            if hb > ha:
                pad_sample(x, n, ph, pw, sh, sw, hq, wq, xpad[s * sample_values:(s + 1) * sample_values])
            count += vectors
            r += hb - ha
        for t in range(0, count, PIXEL_VECTORS):
            p0, whole0 = _vector(t, spans, wq, wo, sample_values, outs * plane, lanes, targets, 0)
            p1, whole1 = _vector(min(t + 1, count - 1), spans, wq, wo, sample_values, outs * plane, lanes, targets, 1)
            if t + 1 == count:  # one vector left: the second slot repeats it and stores nothing
                targets[lanes:] = -1
                whole1 = 0
            for b in range(blocks):
                fma_tile(xpad, p0, p1, offsets, flat_w, b * taps * BLOCK_OUTS, biases[b * BLOCK_OUTS:], flat_y,
                         b * BLOCK_OUTS * plane, targets, whole0, whole1, plane, min(BLOCK_OUTS, outs - b * BLOCK_OUTS))


@register_jitable
def pointwise_vectors(pixels, lanes):
    """Vectors a sample's H*W = `pixels` (at least `lanes`) takes in pointwise_tiles."""
    return -(-pixels // lanes)


@njit(**THREADED)
def _pointwise_vector(v, pixels, lanes, outs, channels, targets, slot):
    """(where vector v starts in x flat, whether its lanes are one whole run of y) for
    pointwise_tiles, filling targets[slot*lanes:][:lanes]: vector j of sample n covers pixels
    from j*lanes, the last one a whole vector ending at the sample's last pixel, whose lanes
    that the vector before covered store nothing (so no load reads past a channel's pixels)."""
    per_sample = pointwise_vectors(pixels, lanes)
    n, j = v // per_sample, v % per_sample
    start = min(j * lanes, pixels - lanes)
    skip = j * lanes - start
    base = n * outs * pixels + start
    for lane in range(lanes):
        targets[slot * lanes + lane] = base + lane if lane >= skip else -1
    return n * channels * pixels + start, 1 if skip == 0 else 0


@njit(**THREADED)
def pointwise_tiles(x, wpack, biases, offsets, y, v0, v1, targets):
    """The vectors v0 <= v < v1 of a 1x1 stride-1 convolution of x (N, C, H, W) into y (N, O, H,
    W), H*W at least the lanes: sample v // pointwise_vectors(H*W), its pixels from (v % that) *
    lanes (_pointwise_vector). Without padding x is read where it is (no copy: offsets[c] =
    c*H*W), and a tile's two vectors may be of two samples. targets (PIXEL_VECTORS*lanes) this
    thread's."""
    outs, channels = y.shape[1], x.shape[1]
    pixels = y.shape[2] * y.shape[3]
    lanes = lanes_of(x.itemsize)
    blocks, taps = wpack.shape[0], wpack.shape[1]
    flat_x, flat_w, flat_y = x.reshape(-1), wpack.reshape(-1), y.reshape(-1)
    for v in range(v0, v1, PIXEL_VECTORS):
        second = v + 1 if v + 1 < v1 else v  # one vector left: the second slot repeats it, storing nothing
        p0, whole0 = _pointwise_vector(v, pixels, lanes, outs, channels, targets, 0)
        p1, whole1 = _pointwise_vector(second, pixels, lanes, outs, channels, targets, 1)
        if second == v:
            targets[lanes:] = -1
            whole1 = 0
        for b in range(blocks):
            fma_tile(flat_x, p0, p1, offsets, flat_w, b * taps * BLOCK_OUTS, biases[b * BLOCK_OUTS:], flat_y,
                     b * BLOCK_OUTS * pixels, targets, whole0, whole1, pixels, min(BLOCK_OUTS, outs - b * BLOCK_OUTS))
