"""Conversions between fp32 and the 2-byte storage types on the CPU, compiled.

A bf16 or fp16 plan stages every step's 2-byte arrays in fp32 (snrt/layers/staging.py): each
one it reads is widened, each one it writes is rounded back, and a gradient with several
contributions is summed in fp32 and rounded. NumPy converts float16 a value at a time in C
(widening 1M values took 1.7 ms on the 2-core reference machine, rounding 2.6 ms, against
0.09 ms for a plain copy, and a sum 5.2 ms), and ml_dtypes rounds bfloat16 at 0.4 ms and sums it
at 1.4 ms. Here each of those is one vectorized loop over the bits (0.22, 0.24, 1.2, 0.07 and
0.10 ms), on the kernel threads from SPLIT_VALUES values, for arrays of COMPILED_FROM values or
more (on fewer, a call costs more than NumPy's conversion). Widening bf16 is ml_dtypes' (a
shift; no faster here).

The results are NumPy's and ml_dtypes' bit for bit (tests/backends/test_cpu_cast.py checks every
2-byte value and every rounding case): rounding is to nearest, ties to even; a value past the
2-byte type's range becomes infinite; fp16 keeps a NaN's payload as NumPy does (its top ten
bits, or 1 where those are zero), bf16 makes every NaN the quiet NaN of its sign as ml_dtypes
does; widening keeps every bit. A sum is the fp32 sum of the widened values, rounded: what
NumPy's float16 and ml_dtypes' bfloat16 additions compute.
"""

import ml_dtypes
import numpy as np
from numba import njit

from snrt.backends.cpu_common import EXACT, bits_of_float, float_from_bits
from snrt.backends.cpu_parallel import run_split
from snrt.threads import kernel_threads

COMPILED_FROM = 1 << 12  # below this many values NumPy's (ml_dtypes') conversion, which a call here costs more than
SPLIT_VALUES = 1 << 15  # below this many values one thread converts (a hand-off costs a few µs)
# EXACT (no fastmath): the rounding of fp16's subnormals is one fp32 addition that must stay as written.
FP32_EXPONENT_SHIFT = 23
HALF_TO_FLOAT_BIAS = (127 - 15) << FP32_EXPONENT_SHIFT  # fp32's exponent bias minus fp16's, in place
ONE_HALF_BITS = 126 << FP32_EXPONENT_SHIFT  # 0.5f, whose ulp is fp16's smallest subnormal, 2^-24


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
        bits = sign | bits_of_float(np.float32(magnitude) * np.float32(2.0 ** -24))
    return float_from_bits(bits)


@njit(**EXACT, inline="always")
def _float_to_half(value):
    """The fp16 bits nearest the float32 `value` (ties to even)."""
    bits = bits_of_float(value)
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
        total = float_from_bits(magnitude) + float_from_bits(ONE_HALF_BITS)
        half = bits_of_float(total) - ONE_HALF_BITS
    return np.uint16(sign | half)


@njit(**EXACT, inline="always")
def _bfloat_to_float(h):
    """The fp32 value of the bf16 bits `h`: fp32's upper half."""
    return float_from_bits(h << 16)


@njit(**EXACT, inline="always")
def _float_to_bfloat(value):
    """The bf16 bits nearest the float32 `value` (ties to even); a NaN becomes the quiet NaN of
    its sign."""
    bits = bits_of_float(value)
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


@njit(**EXACT)
def widen_half(src, out, i0, i1):
    """out[i] = the fp32 value of the fp16 bits src[i], for i in [i0, i1)."""
    src, out = src[i0:i1], out[i0:i1]  # indices from 0: a loop from i0 would not vectorize
    for i in range(src.size):
        out[i] = _half_to_float(np.int64(src[i]))


def _rounding_loops(half):
    """The compiled loops that round to one 2-byte type, fp16 where `half` is True, else bf16:
    narrow, and add into a sum."""

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

    return narrow, add


NARROW_HALF, ADD_HALF = _rounding_loops(True)
NARROW_BFLOAT, ADD_BFLOAT = _rounding_loops(False)
_F32, _U16 = np.dtype(np.float32), np.dtype(np.uint16)
_F16, _BF16 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)
# (out's dtype, the array's): the loop, and the dtypes it sees the array and out as. Not bf16 to
# fp32: ml_dtypes' widening, a shift, took 0.7 us for 4K values where a call here took 2.0
CONVERSIONS = {(_F32, _F16): (widen_half, _U16, _F32), (_F16, _F32): (NARROW_HALF, _F32, _U16),
               (_BF16, _F32): (NARROW_BFLOAT, _F32, _U16)}
SUMS = {_F16: ADD_HALF, _BF16: ADD_BFLOAT}


def _compiled(one, other):
    """Whether the loops serve these arrays: NumPy arrays of one shape, C-contiguous, of at
    least COMPILED_FROM values (a smaller one NumPy converts in less than the call costs)."""
    return (isinstance(one, np.ndarray) and isinstance(other, np.ndarray) and one.shape == other.shape
            and one.size >= COMPILED_FROM and one.flags.c_contiguous and other.flags.c_contiguous)


def _run(loop, source, target):
    """loop(source, target, i0, i1) over both 1-d arrays, on the kernel threads from SPLIT_VALUES."""
    size = source.size
    if size < SPLIT_VALUES:
        loop(source, target, 0, size)
    else:
        run_split(loop, 0, size, kernel_threads(), (source, target))


def convert(out, array):
    """out[...] = array for `out` and `array` of one shape, one of them float32 and the other
    bfloat16 or float16 (compiled); any other pair by NumPy's assignment."""
    conversion = CONVERSIONS.get((out.dtype, array.dtype))
    if conversion is None or not _compiled(out, array):
        out[...] = array
        return
    loop, source_type, target_type = conversion
    _run(loop, array.reshape(-1).view(source_type), out.reshape(-1).view(target_type))


def add_into(total, part):
    """total += part; for two bfloat16 or float16 arrays of one shape compiled (the fp32 sum,
    rounded), else NumPy's addition."""
    loop = SUMS.get(total.dtype) if part.dtype == total.dtype else None
    if loop is None or not _compiled(total, part):
        total += part
        return
    _run(loop, total.reshape(-1).view(_U16), part.reshape(-1).view(_U16))
