"""Short runs of values copied by whole vectors, for the padding copies of the convolutions.

Padding a map copies it row by row, and the rows of CIFAR's maps are 8, 16 or 32 values. A
compiled loop copies such a row a value at a time: LLVM vectorizes it 64 values a step, so a
shorter row never reaches the vector loop. `copy_run` moves a row as full vectors and one
masked vector for the rest, in LLVM's IR (as cpu_dots): padding 16 samples of 16 channels at
32x32 (8,192 rows, the planes zeroed first) took 127 us on one thread, 40 us this way.
`pad_plane` pads one channel of one sample with it. At a stride of 2 a row's columns go to two
phase planes (cpu_tiles.phase_planes), every other value to each: `copy_every_other` shuffles
the even lanes of two vectors into one, where a loop of single values took 0.44 ms to split 32
samples of 16 channels at 32x32 on one thread.
"""

import llvmlite.ir as ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from snrt.backends import compiled_cache  # noqa: F401  (numba's cache emptied where a compiled source changed)
from snrt.backends.cpu_dots import VECTOR_BYTES


def vector_memory(builder, dtype, lanes):
    """(vector type, masked load, masked store, lane_mask) for `lanes` values of numba's float
    `dtype`: masked_load(pointer, mask) and masked_store(values, pointer, mask) touch only the
    lanes of `mask` (no value past a run is read or written), lane_mask(count) is the lanes
    below `count` (an index value)."""
    single = dtype == types.float32
    name = f"v{lanes}{'f32' if single else 'f64'}"
    vector = ir.VectorType(ir.FloatType() if single else ir.DoubleType(), lanes)
    mask_type, align = ir.VectorType(ir.IntType(1), lanes), ir.IntType(32)
    pointer = vector.as_pointer()
    load = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [pointer, align, mask_type, vector]),
                                          f"llvm.masked.load.{name}.p0{name}")
    store = cgutils.get_or_insert_function(builder.module,
                                           ir.FunctionType(ir.VoidType(), [vector, pointer, align, mask_type]),
                                           f"llvm.masked.store.{name}.p0{name}")

    def masked_load(at, mask):
        return builder.call(load, [at, ir.Constant(align, 1), mask, ir.Constant(vector, ir.Undefined)])

    def masked_store(values, at, mask):
        builder.call(store, [values, at, ir.Constant(align, 1), mask])

    def lane_mask(count):
        wide = ir.VectorType(count.type, lanes)
        counts = builder.shuffle_vector(builder.insert_element(ir.Constant(wide, ir.Undefined), count,
                                                               ir.Constant(ir.IntType(32), 0)),
                                        ir.Constant(wide, ir.Undefined),
                                        ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
        return builder.icmp_signed("<", ir.Constant(wide, list(range(lanes))), counts)

    return vector, masked_load, masked_store, lane_mask


def _runs_of(dst, src):
    """The lanes of a vector of dst's values, or None when the copies do not serve the arrays
    (1-d contiguous, one dtype, float32 or float64)."""
    if dst.dtype not in (types.float32, types.float64) or src.dtype != dst.dtype or \
            any(a.ndim != 1 or a.layout != "C" for a in (dst, src)):
        return None
    return VECTOR_BYTES // (4 if dst.dtype == types.float32 else 8)


def _copy_at_stride(stride):
    """The intrinsic (dst, dst_start, src, src_start, count) that copies dst[dst_start + q] =
    src[src_start + stride*q] for q < count, 1-d contiguous arrays of one dtype, float32 or
    float64, not overlapping: `stride` vectors of src a step, every stride-th lane of them
    shuffled into one (stride 1: the vector itself); the last count % lanes values by masked
    loads and a masked store (nothing past src[src_start + stride*(count-1)] read, nothing
    past the run written)."""

    def copy(typingctx, dst, dst_start, src, src_start, count):
        lanes = _runs_of(dst, src)
        if lanes is None:
            return None

        def codegen(context, builder, signature, args):
            to, start_to, source, start_from, length = args
            to = context.make_array(signature.args[0])(context, builder, to).data
            source = context.make_array(signature.args[2])(context, builder, source).data
            vector, masked_load, masked_store, lane_mask = vector_memory(builder, signature.args[0].dtype, lanes)
            index = length.type
            taken = ir.Constant(ir.VectorType(ir.IntType(32), lanes), list(range(0, stride * lanes, stride)))

            def at(base, start, offset):
                return builder.bitcast(builder.gep(base, [builder.add(start, offset)]), vector.as_pointer())

            def constant(value):
                return ir.Constant(index, value)

            def gathered(vectors):
                return vectors[0] if stride == 1 else builder.shuffle_vector(*vectors, taken)

            whole = builder.sdiv(length, constant(lanes))
            with cgutils.for_range(builder, whole) as loop:
                read = builder.mul(loop.index, constant(stride * lanes))
                vectors = [builder.load(at(source, start_from, builder.add(read, constant(v * lanes))), align=1)
                           for v in range(stride)]
                builder.store(gathered(vectors), at(to, start_to, builder.mul(loop.index, constant(lanes))), align=1)
            done = builder.mul(whole, constant(lanes))
            rest = builder.sub(length, done)
            with builder.if_then(builder.icmp_signed(">", rest, constant(0))):
                read = builder.mul(done, constant(stride))
                reads = builder.add(builder.mul(builder.sub(rest, constant(1)), constant(stride)), constant(1))
                vectors = [masked_load(at(source, start_from, builder.add(read, constant(v * lanes))),
                                       lane_mask(builder.sub(reads, constant(v * lanes)))) for v in range(stride)]
                masked_store(gathered(vectors), at(to, start_to, done), lane_mask(rest))
            return context.get_dummy_value()

        return types.void(dst, types.intp, src, types.intp, types.intp), codegen

    copy.__name__ = f"copy_at_stride_{stride}"
    return intrinsic(copy)


copy_run = _copy_at_stride(1)  # dst[dst_start:][:count] = src[src_start:][:count]
copy_every_other = _copy_at_stride(2)  # dst[dst_start + q] = src[src_start + 2*q]: one phase of a row at stride 2


@njit(cache=True, nogil=True)
def copy_strided(dst, dst_start, dst_step, src, src_start, src_step, rows, count, stride):
    """dst[dst_start + r*dst_step + q] = src[src_start + r*src_step + stride*q] for q < count and
    the rows r < `rows`: by whole vectors at strides 1 and 2 (copy_run, copy_every_other),
    else a value at a time."""
    if stride == 1:
        for r in range(rows):
            copy_run(dst, dst_start + r * dst_step, src, src_start + r * src_step, count)
    elif stride == 2:
        for r in range(rows):
            copy_every_other(dst, dst_start + r * dst_step, src, src_start + r * src_step, count)
    else:
        for r in range(rows):
            for q in range(count):
                dst[dst_start + r * dst_step + q] = src[src_start + r * src_step + stride * q]


@njit(cache=True, nogil=True)
def pad_plane(x, s, c, ph, pw, plane):
    """plane[(r + ph) * Wp + q + pw] = x[s, c, r, q] with Wp = W + 2*pw: the interior of a flat
    zero-bordered (H + 2*ph, Wp) plane (its border left as it is), a row at a time."""
    h, w = x.shape[2], x.shape[3]
    width = w + 2 * pw
    source = x[s, c].reshape(-1)
    for r in range(h):
        copy_run(plane, (r + ph) * width + pw, source, r * w, w)
