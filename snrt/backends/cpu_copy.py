"""Short runs of values copied by whole vectors, for the padding copies of the convolutions.

Padding a map copies it row by row, and the rows of CIFAR's maps are 8, 16 or 32 values. A
compiled loop copies such a row a value at a time: LLVM vectorizes it 64 values a step, so a
shorter row never reaches the vector loop. `copy_run` moves a row as full vectors and one
masked vector for the rest, in LLVM's IR (as cpu_dots): padding 16 samples of 16 channels at
32x32 (8,192 rows, the planes zeroed first) took 127 us on one thread, 40 us this way.
`pad_plane` pads one channel of one sample with it.
"""

import llvmlite.ir as ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from snrt.backends.cpu_dots import VECTOR_BYTES


@intrinsic
def copy_run(typingctx, dst, dst_start, src, src_start, count):
    """dst[dst_start:][:count] = src[src_start:][:count] for 1-d contiguous arrays of one dtype,
    float32 or float64; the runs must not overlap."""
    if dst.dtype not in (types.float32, types.float64) or src.dtype != dst.dtype or \
            any(a.ndim != 1 or a.layout != "C" for a in (dst, src)):
        return None
    single = dst.dtype == types.float32
    lanes = VECTOR_BYTES // (4 if single else 8)

    def codegen(context, builder, signature, args):
        to, start_to, source, start_from, length = args
        to = context.make_array(signature.args[0])(context, builder, to).data
        source = context.make_array(signature.args[2])(context, builder, source).data
        name = f"v{lanes}{'f32' if single else 'f64'}"
        vector = ir.VectorType(ir.FloatType() if single else ir.DoubleType(), lanes)
        mask_type, align = ir.VectorType(ir.IntType(1), lanes), ir.IntType(32)
        pointer = vector.as_pointer()
        masked_load = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vector, [pointer, align, mask_type, vector]),
            f"llvm.masked.load.{name}.p0{name}")
        masked_store = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [vector, pointer, align, mask_type]),
            f"llvm.masked.store.{name}.p0{name}")
        index = length.type
        lane_count = ir.Constant(index, lanes)

        def at(base, start, offset):
            return builder.bitcast(builder.gep(base, [builder.add(start, offset)]), pointer)

        whole = builder.sdiv(length, lane_count)
        with cgutils.for_range(builder, whole) as loop:
            offset = builder.mul(loop.index, lane_count)
            builder.store(builder.load(at(source, start_from, offset), align=1), at(to, start_to, offset), align=1)
        done = builder.mul(whole, lane_count)
        rest = builder.sub(length, done)
        with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(index, 0))):
            wide = ir.VectorType(index, lanes)
            rests = builder.shuffle_vector(builder.insert_element(ir.Constant(wide, ir.Undefined), rest,
                                                                  ir.Constant(ir.IntType(32), 0)),
                                           ir.Constant(wide, ir.Undefined),
                                           ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))
            mask = builder.icmp_signed("<", ir.Constant(wide, list(range(lanes))), rests)
            values = builder.call(masked_load, [at(source, start_from, done), ir.Constant(align, 1), mask,
                                                ir.Constant(vector, ir.Undefined)])
            builder.call(masked_store, [values, at(to, start_to, done), ir.Constant(align, 1), mask])
        return context.get_dummy_value()

    return types.void(dst, types.intp, src, types.intp, types.intp), codegen


@njit(cache=True, nogil=True)
def pad_plane(x, s, c, ph, pw, plane):
    """plane[(r + ph) * Wp + q + pw] = x[s, c, r, q] with Wp = W + 2*pw: the interior of a flat
    zero-bordered (H + 2*ph, Wp) plane (its border left as it is), a row at a time."""
    h, w = x.shape[2], x.shape[3]
    width = w + 2 * pw
    source = x[s, c].reshape(-1)
    for r in range(h):
        copy_run(plane, (r + ph) * width + pw, source, r * w, w)
