"""The CPU's compiled conversions between fp32 and the 2-byte types give NumPy's float16 and
ml_dtypes' bfloat16 results bit for bit: every fp16 value widened, every rounding case
narrowed (each upper half of an fp32 with the lower halves around every rounding point), and
sums; on the kernel threads as on one."""

import warnings

import ml_dtypes
import numpy as np
import pytest

from snrt.backends import cpu_cast
from snrt.backends.numpy_backend import NumpyBackend

TYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# lower 16 bits of an fp32 around the rounding points of both types (bf16 keeps the upper 16,
# fp16's normal range the upper 19: bit 12 is its halfway bit), and some in between
LOW_HALVES = (0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x2001, 0x3000, 0x5000, 0x7FFF, 0x8000,
              0x8001, 0x9000, 0xB000, 0xEFFF, 0xF000, 0xFFFF)


def _reference(array, dtype):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # NumPy warns of NaNs and overflow
        return array.astype(dtype)


def _bits(array):
    return array.view(np.uint16 if array.itemsize == 2 else np.uint32)


def every_two_byte_value(kind):
    return np.arange(1 << 16, dtype=np.uint16).view(TYPES[kind])


def rounding_cases():
    """fp32 values: every upper half with each of LOW_HALVES, then random bit patterns."""
    uppers = np.arange(1 << 16, dtype=np.uint32) << 16
    lows = np.array(LOW_HALVES, dtype=np.uint32)
    cases = (uppers[:, None] | lows[None, :]).reshape(-1)
    rest = np.random.default_rng(0).integers(0, 1 << 32, size=1 << 20, dtype=np.uint32)
    return np.concatenate([cases, rest]).view(np.float32)


def test_widening_every_fp16_value_keeps_every_bit():
    narrow = every_two_byte_value("float16")
    wide = np.empty(narrow.shape, np.float32)
    cpu_cast.convert(wide, narrow)
    np.testing.assert_array_equal(_bits(wide), _bits(_reference(narrow, np.float32)))


@pytest.mark.parametrize("kind", TYPES)
def test_narrowing_rounds_every_case_as_the_reference(kind):
    wide = rounding_cases()
    narrow = np.empty(wide.shape, TYPES[kind])
    cpu_cast.convert(narrow, wide)
    expected = _reference(wide, TYPES[kind])
    mismatched = np.flatnonzero(_bits(narrow) != _bits(expected))
    assert mismatched.size == 0, [(hex(int(w)), hex(int(got)), hex(int(want))) for w, got, want in zip(
        _bits(wide)[mismatched[:5]], _bits(narrow)[mismatched[:5]], _bits(expected)[mismatched[:5]])]


@pytest.mark.parametrize("kind", TYPES)
def test_sums_are_the_references_sums(kind):
    total_values = every_two_byte_value(kind)
    rng = np.random.default_rng(1)
    for _ in range(3):
        part = total_values[rng.permutation(total_values.size)]
        total = total_values.copy()
        cpu_cast.add_into(total, part)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            expected = total_values + part
        nan = np.isnan(expected.astype(np.float32))
        np.testing.assert_array_equal(np.isnan(total.astype(np.float32)), nan)
        np.testing.assert_array_equal(_bits(total)[~nan], _bits(expected)[~nan])


@pytest.mark.parametrize("kind", TYPES)
def test_one_thread_and_the_kernel_threads_convert_alike(kind, monkeypatch):
    wide = np.random.default_rng(2).standard_normal((4, 3, cpu_cast.SPLIT_VALUES)).astype(np.float32)
    results = []
    for split in (cpu_cast.SPLIT_VALUES, wide.size + 1):  # threads from SPLIT_VALUES; one thread
        monkeypatch.setattr(cpu_cast, "SPLIT_VALUES", split)
        narrow = np.empty(wide.shape, TYPES[kind])
        cpu_cast.convert(narrow, wide)
        back = np.empty(wide.shape, np.float32)
        cpu_cast.convert(back, narrow)
        cpu_cast.add_into(narrow, narrow)
        results.append((_bits(narrow).copy(), _bits(back).copy()))
    for one, other in zip(*results):
        np.testing.assert_array_equal(one, other)
    np.testing.assert_array_equal(results[0][1], _bits(_reference(_reference(wide, TYPES[kind]), np.float32)))


def test_other_arrays_are_assigned_as_numpy_does():
    """Strided views, other dtypes, broadcasting and arrays under COMPILED_FROM values take
    NumPy's assignment, whose results these are."""
    wide = np.arange(24, dtype=np.float32).reshape(4, 6) / 7
    strided = np.zeros((4, 3), np.float16)
    cpu_cast.convert(strided, wide[:, ::2])
    np.testing.assert_array_equal(strided, wide[:, ::2].astype(np.float16))
    doubles = np.zeros((4, 6), np.float64)
    cpu_cast.convert(doubles, wide)
    np.testing.assert_array_equal(doubles, wide.astype(np.float64))
    broadcast = np.zeros((4, 6), ml_dtypes.bfloat16)
    cpu_cast.convert(broadcast, wide[0])
    np.testing.assert_array_equal(broadcast, np.broadcast_to(wide[0].astype(ml_dtypes.bfloat16), (4, 6)))
    total = np.ones((4, 3), np.float16)
    cpu_cast.add_into(total, np.ones((4, 6), np.float16)[:, ::2])
    np.testing.assert_array_equal(total, np.full((4, 3), 2, np.float16))


def test_the_cpu_backend_feeds_and_accumulates_2_byte_buffers_with_them():
    backend = NumpyBackend(1 << 12)
    try:
        batch = np.random.default_rng(3).standard_normal((4, 8, cpu_cast.COMPILED_FROM)).astype(np.float32)
        view = np.empty(batch.shape, np.float16)
        backend.upload(view, batch)
        np.testing.assert_array_equal(_bits(view), _bits(batch.astype(np.float16)))
        before = view.copy()
        backend.accumulate(view, before)
        np.testing.assert_array_equal(view, before + before)
    finally:
        backend.close()
