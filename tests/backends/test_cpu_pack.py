"""The tile kernels' packed weights (snrt/backends/cpu_tiles.pack_weight): a layer's C-contiguous weight by
blocks transposed in registers (transpose_block), any other view value by value, both the same layout, in
blocks of BLOCK_OUTS output channels (the pixel tiles) or of several BLOCK_OUTS (the channel tiles)."""

import numpy as np
import pytest
from numba import njit

from snrt.backends.cpu_tiles import BLOCK_OUTS, pack_weight, transpose_block


def packed_reference(weight, width):
    """wpack[b, k, o] = weight[b*width + o, k] (weight (O, C, kh, kw) flattened past O), 0 past O."""
    outs, blocks = weight.shape[0], -(-weight.shape[0] // width)
    full = np.zeros((blocks * width, *weight.shape[1:]), weight.dtype)
    full[:outs] = weight
    return full.reshape(blocks, width, -1).transpose(0, 2, 1)


def pack(weight, width):
    outs, channels, kh, kw = weight.shape
    taps, blocks = channels * kh * kw, -(-outs // width)
    wpack = np.full((blocks, taps, width), np.nan, weight.dtype)
    pack_weight(weight, 8, 8, 1, 1, wpack, np.empty(blocks * width, weight.dtype), np.empty(taps, np.int64),
                weight[:0, 0, 0, 0])
    return wpack


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("width", [BLOCK_OUTS, 4 * BLOCK_OUTS])
@pytest.mark.parametrize("shape", [
    (1536, 384, 1, 1),  # whole blocks, whole groups of taps
    (13, 5, 3, 3),  # a partial last block, 45 taps: 5 whole groups of 8 and 5 more (AVX-512)
    (3, 2, 1, 1),  # fewer outputs than a block: value by value only
    (20, 3, 7, 7),
])
def test_a_contiguous_weight_and_any_view_pack_alike(dtype, width, shape):
    rng = np.random.default_rng(sum(shape))
    weight = rng.standard_normal(shape).astype(dtype)
    np.testing.assert_array_equal(pack(weight, width), packed_reference(weight, width))
    flipped = weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # the data gradient's view
    np.testing.assert_array_equal(pack(flipped, width), packed_reference(np.ascontiguousarray(flipped), width))


@njit
def _transpose(source, start, stride, target, target_start, target_stride):
    transpose_block(source, start, stride, target, target_start, target_stride)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("target_stride", [BLOCK_OUTS, BLOCK_OUTS + 3])
def test_transpose_block_writes_the_block_transposed_and_nothing_else(dtype, target_stride):
    stride, start = 11, 3  # rows 11 apart, the block from column 3
    source = np.arange(BLOCK_OUTS * stride + start, dtype=dtype)
    target = np.full(BLOCK_OUTS * target_stride + 4, -1, dtype)
    _transpose(source, start, stride, target, 2, target_stride)
    block = source[start:start + BLOCK_OUTS * stride].reshape(BLOCK_OUTS, stride)[:, :BLOCK_OUTS]
    written = target[2:2 + BLOCK_OUTS * target_stride].reshape(BLOCK_OUTS, target_stride)
    np.testing.assert_array_equal(written[:, :BLOCK_OUTS], block.T)
    assert (written[:, BLOCK_OUTS:] == -1).all()
    assert (target[:2] == -1).all() and (target[2 + BLOCK_OUTS * target_stride:] == -1).all()
