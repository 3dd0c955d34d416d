"""Runs of values copied by vectors and one masked vector (snrt/backends/cpu_copy.py)."""

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from snrt.backends.cpu_copy import copy_every_other, copy_run, copy_strided


@njit
def _copy(dst, dst_start, src, src_start, count):
    copy_run(dst, dst_start, src, src_start, count)


@njit
def _every_other(dst, dst_start, src, src_start, count):
    copy_every_other(dst, dst_start, src, src_start, count)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 15, 16, 17, 32, 33, 70])  # none, a masked vector alone, whole ones, both
@pytest.mark.parametrize("starts", [(0, 0), (3, 5), (1, 0)])  # off the vectors' alignment on either side
def test_copy_run_copies_the_run_and_touches_nothing_else(dtype, count, starts):
    rng = np.random.default_rng(count)
    src = rng.standard_normal(100).astype(dtype)
    dst = np.full(100, -7, dtype)
    _copy(dst, starts[0], src, starts[1], count)
    expected = np.full(100, -7, dtype)
    expected[starts[0]:starts[0] + count] = src[starts[1]:starts[1] + count]
    np.testing.assert_array_equal(dst, expected)


def test_copy_run_keeps_nan_and_infinity_bits():
    src = np.array([np.nan, np.inf, -np.inf, -0.0, 1e-45] * 5, np.float32)
    dst = np.zeros_like(src)
    _copy(dst, 0, src, 0, src.size)
    assert dst.tobytes() == src.tobytes()


def test_copy_run_refuses_mixed_dtypes_and_strided_arrays():
    a = np.zeros(20, np.float32)
    with pytest.raises(TypingError):
        _copy(a, 0, np.zeros(20, np.float64), 0, 5)
    with pytest.raises(TypingError):
        _copy(a, 0, a[::2], 0, 5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [0, 1, 7, 8, 9, 15, 16, 17, 32, 33, 40])
@pytest.mark.parametrize("starts", [(0, 0), (3, 5), (1, 0)])
def test_copy_every_other_takes_every_second_value_and_reads_no_further(dtype, count, starts):
    """The source ends right after its last value read (src[start + 2*(count-1)]): a read past
    it would fault or, under NumPy's view, show as a wrong value; the destination is touched
    only in the run."""
    rng = np.random.default_rng(count)
    src = rng.standard_normal(starts[1] + max(0, 2 * count - 1)).astype(dtype)
    dst = np.full(60, -7, dtype)
    _every_other(dst, starts[0], src, starts[1], count)
    expected = np.full(60, -7, dtype)
    expected[starts[0]:starts[0] + count] = src[starts[1]::2][:count]
    np.testing.assert_array_equal(dst, expected)


@pytest.mark.parametrize("stride", [1, 2, 3])
def test_copy_strided_copies_rows_at_the_stride(stride):
    src = np.arange(200, dtype=np.float32)
    dst = np.full(80, -1, np.float32)
    copy_strided(dst, 2, 10, src, 4, 30, 3, 5, stride)  # 3 rows of 5 values, 10 apart, read 30 apart
    expected = np.full(80, -1, np.float32)
    for r in range(3):
        expected[2 + 10 * r:][:5] = src[4 + 30 * r::stride][:5]
    np.testing.assert_array_equal(dst, expected)
