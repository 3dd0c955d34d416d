"""Sixteen dot products at once for the CPU's compiled kernels, written in LLVM's IR.

`dots4x4(a0, a1, a2, a3, b0, b1, b2, b3, length, segments, a_stride, b_stride)` is ((a0.b0,
a0.b1, a0.b2, a0.b3), (a1.b0, ...), ...) over `segments` runs of `length` values, run s at
s*a_stride of each a row and s*b_stride of each b row (one run: a plain dot product over
[0, length); several: a channel's pixels in each sample of an NCHW tensor, say): each step of
the loop loads 8 vectors (one of each row, of `VECTOR_BYTES`) and adds their 16 products to
16 vector accumulators, 8 loads for 16 fused multiply-adds; the last length % lanes values of
each run take a scalar loop of their own. numba's loop
vectorizer gives the same loop, but then sums each accumulator across its lanes on its own,
about 8 instructions an output: for the short rows of a 3x3 convolution over 16 channels (144
values) a sixth of the work. Here the accumulators are summed together: vectors are paired,
shuffled so that each half of the lanes holds one of the pair's, and added, halving the
vectors at each step until one vector holds a lane's worth of the sums (about 2 instructions
an output).

The sums run in an order fixed by the code (lane by lane along the runs, then the tree, then
the tails) and the machine's vector width: the same rows give the same bits in every run on a
machine, on any number of threads.
"""

import llvmlite.binding as llvm
import llvmlite.ir as ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _vector_bytes():
    """The widest vector register of this processor that the loop should use: 64 bytes with
    AVX-512 (16 accumulators in 32 registers), else 32 (AVX: 16 accumulators in 16)."""
    try:
        return 64 if llvm.get_host_cpu_features().get("avx512f") else 32
    except RuntimeError:  # features unknown
        return 32


VECTOR_BYTES = _vector_bytes()


def _lane_sums(builder, vectors, lanes):
    """One vector whose lane k is the sum of the lanes of vectors[k] (len(vectors) == lanes):
    at each step, a pair (u, v) becomes the sum of two shuffles, the first taking the even
    blocks of `width` lanes of u and of v, the second the odd ones."""
    width = 1
    while len(vectors) > 1:
        even, odd = [], []
        for block in range(lanes // (2 * width)):
            first = block * 2 * width
            even += [first + e for e in range(width)] + [lanes + first + e for e in range(width)]
            odd += [first + width + e for e in range(width)] + [lanes + first + width + e for e in range(width)]
        masks = [ir.Constant(ir.VectorType(ir.IntType(32), lanes), mask) for mask in (even, odd)]
        vectors = [builder.fadd(builder.shuffle_vector(u, v, masks[0]), builder.shuffle_vector(u, v, masks[1]))
                   for u, v in zip(vectors[::2], vectors[1::2])]
        width *= 2
    return vectors[0]


@intrinsic
def dots4x4(typingctx, a0, a1, a2, a3, b0, b1, b2, b3, length, segments, a_stride, b_stride):
    """The 16 dot products of 4 rows by 4 rows over `segments` runs of `length` values (module
    docstring). The rows: contiguous 1-d arrays of one dtype, float32 or float64, reaching past
    their last run."""
    rows = (a0, a1, a2, a3, b0, b1, b2, b3)
    dtype = a0.dtype
    if dtype not in (types.float32, types.float64) or any(r.dtype != dtype or r.ndim != 1 or r.layout != "C"
                                                          for r in rows):
        return None  # contiguous rows only: the loads assume one value after another
    result = types.UniTuple(types.UniTuple(dtype, 4), 4)

    def codegen(context, builder, signature, args):
        single = dtype == types.float32
        lanes = VECTOR_BYTES // (4 if single else 8)
        scalar = ir.FloatType() if single else ir.DoubleType()
        vector = ir.VectorType(scalar, lanes)
        suffix = "f32" if single else "f64"
        fma_vector = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                                    f"llvm.fma.v{lanes}{suffix}")
        fma_scalar = cgutils.get_or_insert_function(builder.module, ir.FunctionType(scalar, [scalar] * 3),
                                                    f"llvm.fma.{suffix}")
        bases = [context.make_array(ty)(context, builder, value).data for ty, value in zip(signature.args[:8], args)]
        length, segments, a_stride, b_stride = args[8:]
        lane_count = ir.Constant(length.type, lanes)
        vectors = [[cgutils.alloca_once_value(builder, ir.Constant(vector, [0.0] * lanes)) for _ in range(4)]
                   for _ in range(4)]  # promoted to registers by the compiler
        scalars = [[cgutils.alloca_once_value(builder, ir.Constant(scalar, 0.0)) for _ in range(4)] for _ in range(4)]
        steps = builder.sdiv(length, lane_count)
        done = builder.mul(steps, lane_count)
        with cgutils.for_range(builder, segments) as segment:
            data = [builder.gep(p, [builder.mul(segment.index, a_stride if k < 4 else b_stride)])
                    for k, p in enumerate(bases)]
            with cgutils.for_range(builder, steps) as loop:
                t = builder.mul(loop.index, lane_count)
                loaded = [builder.load(builder.bitcast(builder.gep(p, [t]), vector.as_pointer()), align=1)
                          for p in data]
                for i in range(4):
                    for j in range(4):
                        slot = vectors[i][j]
                        builder.store(builder.call(fma_vector, [loaded[i], loaded[4 + j], builder.load(slot)]), slot)
            with cgutils.for_range(builder, builder.sub(length, done)) as loop:
                t = builder.add(done, loop.index)
                loaded = [builder.load(builder.gep(p, [t])) for p in data]
                for i in range(4):
                    for j in range(4):
                        slot = scalars[i][j]
                        builder.store(builder.call(fma_scalar, [loaded[i], loaded[4 + j], builder.load(slot)]), slot)
        flat = [builder.load(vectors[i][j]) for i in range(4) for j in range(4)]
        sums = [_lane_sums(builder, flat[k:k + lanes], lanes) for k in range(0, 16, lanes)]
        values = [builder.fadd(builder.extract_element(sums[k // lanes], ir.Constant(ir.IntType(32), k % lanes)),
                               builder.load(scalars[k // 4][k % 4])) for k in range(16)]
        return context.make_tuple(builder, result, [
            context.make_tuple(builder, result.dtype, values[4 * i:4 * i + 4]) for i in range(4)])

    return result(*rows, types.intp, types.intp, types.intp, types.intp), codegen
