"""The sixteen dot products written in LLVM's IR (snrt/backends/cpu_dots.py)."""

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from snrt.backends.cpu_dots import VECTOR_BYTES, dots4x4


@njit
def _dots(a, b, length):
    return dots4x4(a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], length, 1, 0, 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", [0, 1, 7, 16, 17, 144, 147, 1000])  # none, the tail alone, whole vectors and a tail
def test_dots4x4_are_the_dot_products_of_every_pair_of_rows(dtype, length):
    rng = np.random.default_rng(length)
    a, b = (rng.standard_normal((4, length + 5)).astype(dtype) for _ in range(2))  # values past `length` left out
    got = np.array(_dots(a, b, length))
    expected = a[:, :length].astype(np.float64) @ b[:, :length].astype(np.float64).T
    tolerance = (1e-5 if dtype == np.float32 else 1e-12) * max(1.0, np.sqrt(length))
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)


def test_dots4x4_give_the_same_bits_for_the_same_rows_wherever_they_lie():
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((4, 300)).astype(np.float32) for _ in range(2))
    moved = np.zeros(4 * 300 + 1, np.float32)[1:].reshape(4, 300)  # C-contiguous, 4 bytes off the alignment
    moved[...] = a
    np.testing.assert_array_equal(np.array(_dots(a, b, 300)), np.array(_dots(moved, b, 300)))
    assert VECTOR_BYTES in (32, 64)


def test_dots4x4_refuse_rows_that_are_not_contiguous():
    a = np.zeros((4, 20), np.float32)
    with pytest.raises(TypingError):
        _dots(a[:, ::2], a[:, ::2], 10)



@njit
def _dots_of_runs(a, b, a_rows, b_rows, length, segments, a_stride, b_stride):
    """dots4x4 of the rows that start at a[a_rows[k]:] and b[b_rows[k]:]."""
    a0, a1, a2, a3 = a[a_rows[0]:], a[a_rows[1]:], a[a_rows[2]:], a[a_rows[3]:]
    b0, b1, b2, b3 = b[b_rows[0]:], b[b_rows[1]:], b[b_rows[2]:], b[b_rows[3]:]
    return dots4x4(a0, a1, a2, a3, b0, b1, b2, b3, length, segments, a_stride, b_stride)


@pytest.mark.parametrize("length", [16, 21, 64])  # whole vectors, and a tail in every run
def test_dots4x4_over_runs_sum_the_runs_at_their_strides(length):
    """Channels of two (N, C, L) tensors: row c is the runs x[n, c, :L] for every n, C*L apart."""
    rng = np.random.default_rng(length)
    a, b = rng.standard_normal((3, 5, length)).astype(np.float32), rng.standard_normal((3, 7, length)).astype(np.float32)
    picked_a, picked_b = [0, 1, 3, 4], [0, 2, 5, 6]
    got = np.array(_dots_of_runs(a.reshape(-1), b.reshape(-1), np.array(picked_a) * length,
                                 np.array(picked_b) * length, length, 3, 5 * length, 7 * length))
    expected = np.einsum("nil,njl->ij", a[:, picked_a].astype(np.float64), b[:, picked_b].astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.sqrt(3 * length))
