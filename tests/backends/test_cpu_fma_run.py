"""A depthwise channel's taps summed on its padded plane's grid (snrt/backends/cpu_tiles.fma_run), and an output
pixel's channels over channels-last data (fma_channel_run)."""

import numpy as np
import pytest
from numba import njit

from snrt.backends.cpu_tiles import fma_channel_run, fma_run, run_slack


@njit
def _run(plane, kh, kw, row_step, column_step, taps, bias, out, count):
    fma_run(plane, kh, kw, row_step, column_step, taps, bias, out, count)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kernel, steps, count", [
    ((3, 3), (20, 1), 100),  # a 3x3 on planes 20 wide; 100 outputs, the last group partly past them
    ((7, 7), (62, 1), 3472),  # ConvNeXt's 7x7 on 56x56 maps padded to 62 wide
    ((2, 5), (30, 2), 64),  # a dilated kernel, exactly one group (float32) or two (float64)
    ((1, 1), (9, 1), 1),
])
def test_fma_run_sums_the_taps_of_every_output_in_tap_order(dtype, kernel, steps, count):
    (kh, kw), (row_step, column_step) = kernel, steps
    rng = np.random.default_rng(count)
    slack = run_slack(np.dtype(dtype).itemsize)
    reach = count + (kh - 1) * row_step + (kw - 1) * column_step
    plane = rng.standard_normal(reach + slack).astype(dtype)
    taps = rng.standard_normal(kh * kw).astype(dtype)
    out = np.full(count + slack, np.nan, dtype)
    _run(plane, kh, kw, row_step, column_step, taps, dtype(0.25), out, count)
    expected = np.full(count, dtype(0.25))
    for i in range(kh):
        for j in range(kw):  # one multiply-add at a time, in tap order: fma_run's bits up to fusing
            expected = expected + taps[i * kw + j] * plane[i * row_step + j * column_step:][:count]
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out[:count], expected, rtol=tolerance, atol=tolerance * kh * kw)


@njit
def _channel_run(source, base, offsets, tap_rows, taps, taps_stride, bias, with_bias, out, out_start, count):
    fma_channel_run(source, base, offsets, tap_rows, taps, taps_stride, bias, with_bias, out, out_start, count)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("count", [1, 15, 64, 100, 672])  # part of a vector, of a group, whole groups and a part
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("wider", [0, 37])  # taps rows of the run's count, or of more channels
def test_fma_channel_run_sums_each_channels_taps_and_touches_nothing_past_them(dtype, count, with_bias, wider):
    """The arrays end where the run's reads end (a read past them would fault or show as a
    wrong value); an empty bias is never read; out is written only in the run; only the listed
    taps' rows of taps are read (row 1, not listed, is NaN), and with rows wider than the run,
    only the run's part of each (the rest is NaN)."""
    rng = np.random.default_rng(count)
    offsets = np.array([0, 3 * count, 7 * count], np.int64)  # three taps, whole pixels apart
    tap_rows = np.array([2, 0, 3], np.int64)  # of four rows, out of order
    base = 2 * count
    source = rng.standard_normal(base + 7 * count + count).astype(dtype)
    stride = count + wider
    taps = np.full(3 * stride + count, np.nan, dtype)
    for k in tap_rows:
        taps[k * stride:k * stride + count] = rng.standard_normal(count)
    bias = rng.standard_normal(count).astype(dtype) if with_bias else np.zeros(0, dtype)
    out = np.full(count + 9, -7, dtype)
    _channel_run(source, base, offsets, tap_rows, taps, stride, bias, bias.size, out, 4, count)
    expected = bias.astype(np.float64) if with_bias else np.zeros(count)
    for row, offset in zip(tap_rows, offsets):
        expected = expected + taps[row * stride:row * stride + count] * source[base + offset:][:count]
    np.testing.assert_allclose(out[4:4 + count], expected, **({"rtol": 1e-5, "atol": 1e-6} if dtype == np.float32 else {"rtol": 1e-12}))
    assert (out[:4] == -7).all() and (out[4 + count:] == -7).all()
