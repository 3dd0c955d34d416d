"""Runs of values copied by vectors and one masked vector (snrt/backends/cpu_copy.py)."""

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from snrt.backends.cpu_copy import copy_run


@njit
def _copy(dst, dst_start, src, src_start, count):
    copy_run(dst, dst_start, src, src_start, count)


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
