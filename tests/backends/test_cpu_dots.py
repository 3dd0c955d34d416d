"""The blocks of dot products written in LLVM's IR (snrt/backends/cpu_dots.py)."""

import numpy as np
import pytest
from numba import njit
from numba.core.errors import TypingError

from snrt.backends.cpu_dots import BLOCK, VECTOR_BYTES, block_dots, dots

SHAPES = sorted({BLOCK, (4, 4), (6, 4), (1, 3)})  # the one in use, the others it may be on another processor
KERNELS = {shape: block_dots(*shape) for shape in SHAPES}


def _caller(shape):
    kernel = KERNELS[shape]

    @njit
    def call(a, a_rows, b, b_rows, length, segments, a_stride, b_stride):
        return kernel(a, a_rows, b, b_rows, length, segments, a_stride, b_stride)

    return call


CALLERS = {shape: _caller(shape) for shape in SHAPES}


def _dots(shape, a, b, length):
    """The dot products of the rows of 2-d a and b over [0, length)."""
    rows = [np.arange(n) * m.shape[1] for n, m in zip(shape, (a, b))]
    return np.array(CALLERS[shape](a.reshape(-1), rows[0], b.reshape(-1), rows[1], length, 1, 0, 0))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("length", [0, 1, 7, 16, 17, 144, 147, 1000])  # none, the tail alone, whole vectors and a tail
def test_dots_are_the_dot_products_of_every_pair_of_rows(shape, dtype, length):
    rng = np.random.default_rng(length)
    a, b = (rng.standard_normal((n, length + 5)).astype(dtype) for n in shape)  # values past `length` left out
    got = _dots(shape, a, b, length)
    expected = a[:, :length].astype(np.float64) @ b[:, :length].astype(np.float64).T
    tolerance = (1e-5 if dtype == np.float32 else 1e-12) * max(1.0, np.sqrt(length))
    assert got.shape == shape
    np.testing.assert_allclose(got, expected, rtol=0, atol=tolerance)


def test_the_masked_tail_reads_nothing_past_the_last_run():
    """Rows that end where their array ends: the last step's loads are masked, not read past
    (values past the end would be picked up, or fault)."""
    rng = np.random.default_rng(3)
    length = 16 * 5 + 3
    a, b = (rng.standard_normal((n, length)).astype(np.float32) for n in BLOCK)
    expected = a.astype(np.float64) @ b.astype(np.float64).T
    np.testing.assert_allclose(_dots(BLOCK, a, b, length), expected, rtol=0, atol=1e-4)


def test_dots_give_the_same_bits_for_the_same_rows_wherever_they_lie():
    rng = np.random.default_rng(1)
    a, b = (rng.standard_normal((n, 300)).astype(np.float32) for n in BLOCK)
    moved = np.zeros(a.size + 1, np.float32)[1:].reshape(a.shape)  # C-contiguous, 4 bytes off the alignment
    moved[...] = a
    np.testing.assert_array_equal(_dots(BLOCK, a, b, 300), _dots(BLOCK, moved, b, 300))
    assert VECTOR_BYTES in (32, 64)


def test_dots_refuse_rows_that_are_not_contiguous():
    a = np.zeros(40, np.float32)
    rows = np.zeros(8, np.intp)
    with pytest.raises(TypingError):
        CALLERS[BLOCK](a[::2], rows, a[::2], rows, 10, 1, 0, 0)


@pytest.mark.parametrize("length", [16, 21, 64])  # whole vectors, and a tail in every run
def test_dots_over_runs_sum_the_runs_at_their_strides(length):
    """Channels of two (N, C, L) tensors: row c is the runs x[n, c, :L] for every n, C*L apart."""
    rng = np.random.default_rng(length)
    a, b = rng.standard_normal((3, 7, length)).astype(np.float32), rng.standard_normal((3, 7, length)).astype(np.float32)
    picked_a, picked_b = [0, 1, 3, 4, 5, 6][:BLOCK[0]], [0, 2, 5, 6][:BLOCK[1]]
    got = np.array(dots_of_runs(a.reshape(-1), np.array(picked_a) * length, b.reshape(-1), np.array(picked_b) * length,
                                length, 3, 7 * length, 7 * length))
    expected = np.einsum("nil,njl->ij", a[:, picked_a].astype(np.float64), b[:, picked_b].astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.sqrt(3 * length))


@njit
def dots_of_runs(a, a_rows, b, b_rows, length, segments, a_stride, b_stride):
    return dots(a, a_rows, b, b_rows, length, segments, a_stride, b_stride)
