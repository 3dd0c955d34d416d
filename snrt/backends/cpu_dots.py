"""Blocks of dot products at once for the CPU's compiled kernels, written in LLVM's IR.

`block_dots(rows, columns)` is a compiled function dots(a, a_offsets, b, b_offsets, length,
segments, a_stride, b_stride): the rows x columns dot products of the rows of a that start at
a_offsets[:rows] by those of b that start at b_offsets[:columns] (a tuple of `rows` tuples of
`columns` values), over `segments` runs of `length` values, run s at s*a_stride of each a row
and s*b_stride of each b row (one run: a plain dot product over [0, length); several: a
channel's pixels in each sample of an NCHW tensor, say). Each step of the loop loads
rows + columns vectors (one of each row, of `VECTOR_BYTES`) and adds their rows * columns
products to as many vector accumulators; the last length % lanes values of each run are one
more step whose loads are masked (no value past a run is read). `BLOCK` is the shape for this
processor: 6 x 4 with AVX-512's 32 vector registers (24 accumulators, 10 loads for 24 fused
multiply-adds, where 4 x 4 has 8 for 16), 4 x 4 with AVX's 16. numba's loop vectorizer gives the same loop, but then sums each accumulator across
its lanes on its own, about 8 instructions an output: for the short rows of a 3x3 convolution
over 16 channels (144 values) a sixth of the work. Here the accumulators are summed together:
vectors are paired, shuffled so that each half of the lanes holds one of the pair's, and
added, halving the vectors at each step until one vector holds a lane's worth of the sums
(about 2 instructions an output).

The sums run in an order fixed by the code (lane by lane along the runs, the masked steps
included, then the tree) and the machine's vector width: the same rows give the same bits in
every run on a machine, on any number of threads.
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
BLOCK = (6, 4) if VECTOR_BYTES == 64 else (4, 4)  # (rows, columns) of the dot products computed at once


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


def _splat(builder, value, lanes):
    """A vector of `lanes` copies of the scalar `value`."""
    empty = ir.Constant(ir.VectorType(value.type, lanes), ir.Undefined)
    first = builder.insert_element(empty, value, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, empty, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))


def block_dots(rows, columns):
    """The compiled dots(a, a_offsets, b, b_offsets, length, segments, a_stride, b_stride) of
    `rows` x `columns` dot products (module docstring). a and b: contiguous 1-d arrays of one
    dtype, float32 or float64, reaching past the last run of every row; the offsets: 1-d
    integer arrays of at least `rows` and `columns` values."""

    @intrinsic
    def dots(typingctx, a, a_offsets, b, b_offsets, length, segments, a_stride, b_stride):
        dtype = a.dtype
        if dtype not in (types.float32, types.float64) or any(
                r.dtype != dtype or r.ndim != 1 or r.layout != "C" for r in (a, b)):
            return None  # contiguous rows only: the loads assume one value after another
        if any(not isinstance(o, types.Array) or o.ndim != 1 or not isinstance(o.dtype, types.Integer)
               for o in (a_offsets, b_offsets)):
            return None
        result = types.UniTuple(types.UniTuple(dtype, columns), rows)

        def codegen(context, builder, signature, args):
            single = dtype == types.float32
            lanes = VECTOR_BYTES // (4 if single else 8)
            vector = ir.VectorType(ir.FloatType() if single else ir.DoubleType(), lanes)
            suffix = "f32" if single else "f64"
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vector, [vector] * 3),
                                                 f"llvm.fma.v{lanes}{suffix}")
            mask_type = ir.VectorType(ir.IntType(1), lanes)
            masked_load = cgutils.get_or_insert_function(builder.module, ir.FunctionType(
                vector, [vector.as_pointer(), ir.IntType(32), mask_type, vector]), f"llvm.masked.load.v{lanes}{suffix}.p0")
            length, segments, a_stride, b_stride = args[4:]
            firsts = []
            for array_type, array, offsets_type, offsets, count in ((signature.args[0], args[0], signature.args[1],
                                                                     args[1], rows),
                                                                    (signature.args[2], args[2], signature.args[3],
                                                                     args[3], columns)):
                data = context.make_array(array_type)(context, builder, array).data
                starts = context.make_array(offsets_type)(context, builder, offsets).data
                for k in range(count):
                    offset = builder.load(builder.gep(starts, [ir.Constant(ir.IntType(64), k)]))
                    firsts.append(builder.gep(data, [builder.sext(offset, length.type)
                                                     if offset.type.width < length.type.width else offset]))
            lane_count = ir.Constant(length.type, lanes)
            zeros = ir.Constant(vector, [0.0] * lanes)
            sums = [[cgutils.alloca_once_value(builder, zeros) for _ in range(columns)]
                    for _ in range(rows)]  # promoted to registers by the compiler
            steps = builder.sdiv(length, lane_count)
            done = builder.mul(steps, lane_count)
            rest = builder.sub(length, done)
            lane_numbers = ir.Constant(ir.VectorType(length.type, lanes), list(range(lanes)))
            tail_mask = builder.icmp_signed("<", lane_numbers, _splat(builder, rest, lanes))

            def accumulate(loaded):
                for i in range(rows):
                    for j in range(columns):
                        slot = sums[i][j]
                        builder.store(builder.call(fma, [loaded[i], loaded[rows + j], builder.load(slot)]), slot)

            with cgutils.for_range(builder, segments) as segment:
                data = [builder.gep(p, [builder.mul(segment.index, a_stride if k < rows else b_stride)])
                        for k, p in enumerate(firsts)]
                with cgutils.for_range(builder, steps) as loop:
                    t = builder.mul(loop.index, lane_count)
                    accumulate([builder.load(builder.bitcast(builder.gep(p, [t]), vector.as_pointer()), align=1)
                                for p in data])
                with builder.if_then(builder.icmp_signed(">", rest, ir.Constant(rest.type, 0))):
                    accumulate([builder.call(masked_load, [builder.bitcast(builder.gep(p, [done]), vector.as_pointer()),
                                                           ir.Constant(ir.IntType(32), 1), tail_mask, zeros])
                                for p in data])
            flat = [builder.load(sums[i][j]) for i in range(rows) for j in range(columns)]
            flat += [zeros] * (-len(flat) % lanes)
            reduced = [_lane_sums(builder, flat[k:k + lanes], lanes) for k in range(0, len(flat), lanes)]
            values = [builder.extract_element(reduced[k // lanes], ir.Constant(ir.IntType(32), k % lanes))
                      for k in range(rows * columns)]
            return context.make_tuple(builder, result, [context.make_tuple(
                builder, result.dtype, values[columns * i:columns * (i + 1)]) for i in range(rows)])

        return result(a, a_offsets, b, b_offsets, types.intp, types.intp, types.intp, types.intp), codegen

    return dots


dots = block_dots(*BLOCK)
