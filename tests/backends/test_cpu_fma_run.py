"""A depthwise channel's taps summed on its padded plane's grid (snrt/backends/cpu_tiles.fma_run)."""

import numpy as np
import pytest
from numba import njit

from snrt.backends.cpu_tiles import fma_run, run_slack


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
