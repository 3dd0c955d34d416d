"""Conversions between fp32 and the 2-byte storage types on the CPU, compiled.

A bf16 or fp16 plan stages every step's 2-byte arrays in fp32 (snrt/layers/staging.py): each
one it reads is widened, each one it writes is rounded back, and a gradient with several
contributions is summed in fp32 and rounded. NumPy converts float16 a value at a time in C
(widening 1M values took 1.7 ms on the 2-core reference machine, rounding 2.6 ms, against
0.09 ms for a plain copy), and ml_dtypes rounds bfloat16 at 0.4 ms. Here each conversion is one
vectorized loop over the bits, on the kernel threads from SPLIT_VALUES values.

The results are NumPy's and ml_dtypes' bit for bit (tests/backends/test_cpu_cast.py checks every
2-byte value and every rounding case): rounding is to nearest, ties to even; a value past the
2-byte type's range becomes infinite; fp16 keeps a NaN's payload as NumPy does (its top ten
bits, or 1 where those are zero), bf16 makes every NaN the quiet NaN of its sign as ml_dtypes
does; widening keeps every bit. A sum is the fp32 sum of the widened values, rounded: what
NumPy's float16 and ml_dtypes' bfloat16 additions compute.
"""

import llvmlite.ir as ir
import numpy as np
from numba import njit, types
from numba.extending import intrinsic

from snrt.backends.cpu_common import threads_for
from snrt.backends.cpu_parallel import run_split

SPLIT_VALUES = 1 << 15  # below this many values one thread converts (a hand-off costs a few µs)
# No fastmath: the rounding of fp16's subnormals is one fp32 addition that must stay as written.
EXACT = {"cache": True, "error_model": "numpy", "nogil": True}
FP32_EXPONENT_SHIFT = 23
HALF_TO_FLOAT_BIAS = (127 - 15) << FP32_EXPONENT_SHIFT  # fp32's exponent bias minus fp16's, in place
ONE_HALF_BITS = 126 << FP32_EXPONENT_SHIFT  # 0.5f, whose ulp is fp16's smallest subnormal, 2^-24


@intrinsic
def _float_of(typingctx, bits):
    """The float32 whose bits are the uint32 `bits`."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of(typingctx, value):
    """The bits of the float32 `value`, as a uint32."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


@njit(**EXACT, inline="always")
def _half_to_float(h):
    """The fp32 value of the fp16 bits `h` (an int in [0, 2^16))."""
    sign = (h & 0x8000) << 16
    magnitude = h & 0x7FFF
    if magnitude >= 0x7C00:  # infinite or NaN: the payload moves up with the exponent's ones
        bits = sign | 0x7F800000 | ((magnitude & 0x3FF) << 13)
    elif magnitude >= 0x400:  # normal: the same significand, the exponent rebiased
        bits = sign | ((magnitude << 13) + HALF_TO_FLOAT_BIAS)
    else:  # zero or subnormal: magnitude units of 2^-24, a normal fp32 (exact)
        bits = sign | np.int64(_bits_of(np.float32(magnitude) * np.float32(2.0 ** -24)))
    return _float_of(np.uint32(bits))


@njit(**EXACT, inline="always")
def _float_to_half(value):
    """The fp16 bits nearest the float32 `value` (ties to even)."""
    bits = np.int64(_bits_of(value))
    sign = (bits >> 16) & 0x8000
    magnitude = bits & 0x7FFFFFFF
    if magnitude > 0x7F800000:  # NaN: the payload's top ten bits, never zero (that is infinity)
        payload = (magnitude >> 13) & 0x3FF
        half = 0x7C00 | (payload if payload != 0 else 1)
    elif magnitude >= 0x477FF000:  # from 65520 (halfway past the largest fp16, 65504, to even): infinite
        half = 0x7C00
    elif magnitude >= 0x38800000:  # fp16's normal range: drop 13 bits, adding half of them less one
        # plus the kept last bit, which rounds the halfway case to even; a carry moves the exponent
        half = (magnitude - HALF_TO_FLOAT_BIAS + 0xFFF + ((magnitude >> 13) & 1)) >> 13
    else:  # below fp16's normal range: adding 0.5 rounds to a multiple of 2^-24, its count is the bits
        total = _float_of(np.uint32(magnitude)) + _float_of(np.uint32(ONE_HALF_BITS))
        half = np.int64(_bits_of(total)) - ONE_HALF_BITS
    return np.uint16(sign | half)


@njit(**EXACT, inline="always")
def _bfloat_to_float(h):
    """The fp32 value of the bf16 bits `h`: fp32's upper half."""
    return _float_of(np.uint32(h << 16))


@njit(**EXACT, inline="always")
def _float_to_bfloat(value):
    """The bf16 bits nearest the float32 `value` (ties to even); a NaN becomes the quiet NaN of
    its sign."""
    bits = np.int64(_bits_of(value))
    if bits & 0x7FFFFFFF > 0x7F800000:
        return np.uint16(((bits >> 16) & 0x8000) | 0x7FC0)
    return np.uint16((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16)


@njit(**EXACT, inline="always")
def _to_float(h, half):
    """The fp32 value of the 2-byte bits `h`: fp16's where `half`, else bf16's."""
    return _half_to_float(h) if half else _bfloat_to_float(h)


@njit(**EXACT, inline="always")
def _from_float(value, half):
    """The 2-byte bits nearest the float32 `value`: fp16's where `half`, else bf16's."""
    return _float_to_half(value) if half else _float_to_bfloat(value)


def _converters(half):
    """The compiled loops of one 2-byte type, fp16 where `half` is True, else bf16: widen,
    narrow, and add into a sum."""

    @njit(**EXACT)
    def widen(src, out, i0, i1):
        """out[i] = the fp32 value of the 2-byte bits src[i], for i in [i0, i1)."""
        src, out = src[i0:i1], out[i0:i1]  # indices from 0: a loop from i0 would not vectorize
        for i in range(src.size):
            out[i] = _to_float(np.int64(src[i]), half)

    @njit(**EXACT)
    def narrow(src, out, i0, i1):
        """out[i] = the 2-byte bits nearest the fp32 src[i]."""
        src, out = src[i0:i1], out[i0:i1]
        for i in range(src.size):
            out[i] = _from_float(src[i], half)

    @njit(**EXACT)
    def add(total, part, i0, i1):
        """total[i] = the 2-byte bits nearest the fp32 sum of total[i] and part[i] (both bits)."""
        total, part = total[i0:i1], part[i0:i1]
        for i in range(total.size):
            total[i] = _from_float(_to_float(np.int64(total[i]), half) + _to_float(np.int64(part[i]), half), half)

    return widen, narrow, add


CONVERTERS = {"float16": _converters(True), "bfloat16": _converters(False)}


def _flat(array, dtype):
    """`array`'s values as a 1-d view of `dtype`'s width (it must be C-contiguous)."""
    return array.reshape(-1).view(dtype)


def _compiled(*arrays):
    """Whether the loops serve these arrays: NumPy arrays, C-contiguous, of one shape."""
    return all(isinstance(a, np.ndarray) and a.flags.c_contiguous and a.shape == arrays[0].shape for a in arrays)


def _run(loop, size, *arrays):
    run_split(loop, 0, size, threads_for(size, SPLIT_VALUES), arrays)


def convert(out, array):
    """out[...] = array for `out` and `array` of one shape, one of them float32 and the other
    bfloat16 or float16 (compiled); any other pair by NumPy's assignment."""
    pair = {out.dtype.name, array.dtype.name} if isinstance(out, np.ndarray) and isinstance(array, np.ndarray) else ()
    narrow_type = next(iter(pair - {"float32"}), None) if "float32" in pair and len(pair) == 2 else None
    if narrow_type not in CONVERTERS or not _compiled(out, array):
        out[...] = array
        return
    widen, narrow, _ = CONVERTERS[narrow_type]
    if out.dtype == np.float32:
        _run(widen, out.size, _flat(array, np.uint16), _flat(out, np.float32))
    else:
        _run(narrow, out.size, _flat(array, np.float32), _flat(out, np.uint16))


def add_into(total, part):
    """total += part; for two bfloat16 or float16 arrays of one shape compiled (the fp32 sum,
    rounded), else NumPy's addition."""
    kind = total.dtype.name
    if kind not in CONVERTERS or part.dtype != total.dtype or not _compiled(total, part):
        total += part
        return
    _run(CONVERTERS[kind][2], total.size, _flat(total, np.uint16), _flat(part, np.uint16))
