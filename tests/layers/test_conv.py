import json
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import snrt.threads
from snrt.backends import cpu_channel_tiles, cpu_choice, cpu_conv, cpu_depthwise
from snrt.backends.cpu_conv import ChosenConv2d, DirectConv2d
from snrt.backends.cpu_depthwise import ROWS_MIN_WIDTH, CompiledDepthwiseConv2d
from snrt.backends.cpu_tiles import lanes_of
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.errors import ShapeError, SnrtError
from snrt.graph import Graph
from snrt.layers.input import Input
from snrt.layers.loss import SoftmaxCrossEntropy
from snrt.layers.norm import BatchNorm
from snrt.layers.pool import GlobalAvgPool
from snrt.scheduler import cost
from snrt.scheduler.planner import make_plan
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved, numel, scratch_bytes
from snrt.layers.conv import Conv2d, ConvTranspose2d
from tests.layers.harness import check_layer


def _reference(layer):
    def reference(xs, p):
        return torch.nn.functional.conv2d(xs[0], p["weight"], p.get("bias"), layer.stride, layer.padding,
                                          layer.dilation, layer.groups)
    return reference


def _check(shape, **options):
    x = np.random.default_rng(0).standard_normal(shape)
    layer = Conv2d(**options)
    check_layer(layer, [x], _reference(layer))
    return layer


@pytest.mark.parametrize("options", [
    dict(out_channels=3, kernel=3),
    dict(out_channels=3, kernel=3, padding=1),
    dict(out_channels=3, kernel=3, stride=2),
    dict(out_channels=3, kernel=3, stride=2, padding=1),
    dict(out_channels=3, kernel=3, stride=(2, 1), padding=(1, 2)),
    dict(out_channels=3, kernel=3, padding=1, dilation=2),
    dict(out_channels=2, kernel=(2, 3), stride=(1, 2), padding=(0, 1), dilation=(2, 1)),
    dict(out_channels=6, kernel=3, padding=1, groups=2),
    dict(out_channels=4, kernel=3, padding=1, stride=2, groups=4),  # depthwise
    dict(out_channels=8, kernel=3, padding=1, groups=4),  # depthwise, channel multiplier 2
    dict(out_channels=3, kernel=3, padding=1, bias=False),
    dict(out_channels=3, kernel=(1, 3), padding=(0, 1)),
    dict(out_channels=3, kernel=(3, 1), padding=(1, 0)),
    dict(out_channels=3, kernel=(7, 1), padding=(3, 0)),  # Inception-style factorised
    dict(out_channels=3, kernel=(1, 7), padding=(0, 3)),
    dict(out_channels=3, kernel=5, padding=3),  # padding wider than some taps reach
    dict(out_channels=3, kernel=1),  # 1x1 fast path
    dict(out_channels=6, kernel=1, groups=2, bias=False),
    dict(out_channels=5, kernel=1, stride=2),  # 1x1 strided: general path
    dict(out_channels=5, kernel=1, padding=1),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_conv2d(options):
    _check((2, 4, 7, 6), **options)


@pytest.mark.parametrize("options", [
    dict(out_channels=4, kernel=3, padding=1),
    dict(out_channels=4, kernel=3, padding=1, stride=2, bias=False),
    dict(out_channels=8, kernel=3, padding=1),  # channel multiplier 2
    dict(out_channels=4, kernel=5, padding=2, stride=2),
    dict(out_channels=4, kernel=7, padding=3),  # ConvNeXt's
    dict(out_channels=8, kernel=(3, 5), padding=(1, 2)),  # taps of a row: four, then one
    dict(out_channels=4, kernel=3, padding=2, dilation=2),
    dict(out_channels=4, kernel=(3, 1), stride=(1, 3), padding=(2, 0)),
    dict(out_channels=4, kernel=3),  # no padding
    dict(out_channels=4, kernel=2, stride=3, padding=4),  # padding wider than the taps reach
    dict(out_channels=4, kernel=3, padding=3),  # the same at stride 1: the data gradient scattered
    dict(out_channels=4, kernel=3, padding=1, stride=(2, 1)),  # rows skipped, columns contiguous
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape, rows", [((2, 4, 9, 5), False), ((2, 4, 9, 12), None), ((2, 4, 5, 70), True)],
                         ids=["channels-last", "either", "rows"])
def test_compiled_depthwise_convolution(options, shape, rows):
    """Every algorithm against the reference; by rows, the data gradient gathered (the flipped
    taps over padded gy) at stride 1 with one output per input channel and padding within the
    taps' reach, else scattered."""
    x = np.random.default_rng(1).standard_normal(shape)
    layer = Conv2d(groups=4, **options)
    width = layer.infer_shape([shape])[3]
    if rows is not None:  # each algorithm in turn, in both phases
        assert all((width >= least) == rows for least in ROWS_MIN_WIDTH.values())
    kernel = CPU_KERNELS.kernel_for(layer, [x.shape])
    assert isinstance(kernel, CompiledDepthwiseConv2d)
    reach = [d * (k - 1) for d, k in zip(layer.dilation, layer.kernel)]
    gathers = layer.stride == (1, 1) and layer.out_channels == 4 and all(p <= r for p, r in zip(layer.padding, reach))
    assert (kernel._gy_padding([shape]) is not None) == gathers
    check_layer(kernel, [x], _reference(layer))


def test_only_depthwise_convolutions_get_the_depthwise_kernel():
    shape = [(2, 4, 9, 8)]
    for groups, compiled in ((1, False), (2, False), (4, True)):
        kernel = CPU_KERNELS.kernel_for(Conv2d(out_channels=8, kernel=3, groups=groups), shape)
        assert isinstance(kernel, CompiledDepthwiseConv2d) is compiled


@pytest.mark.parametrize("options", [
    dict(out_channels=3, kernel=3, padding=1),
    dict(out_channels=5, kernel=3),  # no padding
    dict(out_channels=6, kernel=(2, 3), padding=(0, 1), bias=False),
    dict(out_channels=3, kernel=5, padding=4),  # padding as wide as the data gradient allows
    dict(out_channels=9, kernel=(7, 1), padding=(3, 0)),
    dict(out_channels=7, kernel=(1, 3), padding=(0, 1)),
    dict(out_channels=4, kernel=3, padding=1, stride=2),  # strided: the forward only is the kernel's
    dict(out_channels=5, kernel=7, padding=3, stride=2),  # a stem's
    dict(out_channels=3, kernel=(3, 2), stride=(1, 3)),
    dict(out_channels=6, kernel=(2, 3), padding=(1, 0), stride=(3, 2)),  # more rows between bands than taps
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape", [(2, 4, 7, 6), (3, 17, 9, 11)])
def test_direct_convolution(options, shape):
    x = np.random.default_rng(1).standard_normal(shape)
    layer = Conv2d(**options)
    assert DirectConv2d.serves(layer, [shape])
    check_layer(DirectConv2d(layer), [x], _reference(layer))


@pytest.mark.parametrize("bias", [True, False])
def test_direct_pointwise_convolution(bias):
    """A 1x1 at stride 1 over 16 pixels: cpu_tiles.pointwise_tiles, in float64 (8 lanes, so
    two vectors a sample) against finite differences and the reference."""
    x = np.random.default_rng(3).standard_normal((3, 5, 4, 4))
    layer = Conv2d(out_channels=9, kernel=1, bias=bias)
    assert DirectConv2d.serves(layer, [x.shape])
    check_layer(DirectConv2d(layer), [x], _reference(layer))


@pytest.mark.parametrize("options", [
    dict(kernel=3, padding=1),
    dict(kernel=3, padding=1, stride=2),  # the forward through x's phase planes, gx phase by phase
    dict(kernel=(3, 1), padding=(1, 0), bias=False),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("outs", [32, 64])  # float64: one block of 4 vectors of 8 channels, two
def test_narrow_maps_convolve_by_vectors_of_output_channels(options, outs):
    """Output maps where pixel vectors would waste lanes and channels in whole blocks:
    cpu_channel_tiles (the forward, and gx: 32 channels), in float64 against finite
    differences and the reference; 5 samples of 7 x 6 pixels, so that tiles run across
    samples and a thread's last tile is partial."""
    x = np.random.default_rng(8).standard_normal((5, 32, 7, 6))
    kernel = DirectConv2d(Conv2d(out_channels=outs, **options))
    layer = kernel.layer
    planes = cpu_conv.phase_planes(7, 6, layer.padding, layer.stride)
    assert cpu_conv._channel_tiles(layer.kernel, planes, layer.infer_shape([x.shape])[2:], outs, 8)
    check_layer(kernel, [x], _reference(layer))


@pytest.mark.parametrize("kernel, planes, out_map, outs, served", [
    ((3, 3), (10, 10), (8, 8), 64, True),  # 8 of a vector's 10 pixels are outputs
    ((3, 3), (10, 10), (8, 8), 48, False),  # not a whole block of channels
    ((3, 3), (18, 18), (16, 16), 64, False),  # a whole vector a row
    ((3, 3), (58, 58), (56, 56), 64, True),  # rows of 3.5 vectors
    ((1, 1), (7, 7), (7, 7), 2048, True),  # a 1x1 of 49 pixels: pointwise_tiles' 4 vectors 77% outputs
    ((1, 1), (14, 14), (14, 14), 256, False),  # 196 pixels: 13 vectors, 94%
    ((1, 1), (28, 28), (28, 28), 512, False),  # 784 pixels: 49 whole vectors (the map as one run)
])
def test_channel_tiles_serve_where_pixel_vectors_waste_lanes(kernel, planes, out_map, outs, served):
    assert cpu_conv._channel_tiles(kernel, planes, out_map, outs, 4) is served


@pytest.mark.parametrize("options, size", [(dict(kernel=3, padding=1), 8), (dict(kernel=3, padding=1, stride=2), 8),
                                           (dict(kernel=1), 7)],  # a 1x1 over 49 pixels: pointwise_tiles' are 77% full
                         ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) if isinstance(o, dict) else str(o))
@pytest.mark.parametrize("chunk_bytes", [None, 1])  # all taps at once; a channel's taps a chunk, sums stored between
def test_channel_tiles_compute_the_same_bits_as_pixel_tiles(options, size, chunk_bytes, monkeypatch):
    """Each output is the same chain of multiply-adds (bias, then the taps in order) in both
    tile kernels, in chunks of taps too, so switching a shape from one to the other changes no
    bit of a run."""
    if chunk_bytes:
        monkeypatch.setattr(cpu_channel_tiles, "CHUNK_BYTES", chunk_bytes)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 64, size, size), dtype=np.float32)
    kernel = DirectConv2d(Conv2d(out_channels=64, **options))
    in_shapes = [x.shape]
    params = {name: rng.standard_normal(spec.shape, dtype=np.float32)
              for name, spec in kernel.layer.param_specs(in_shapes).items()}
    gy = rng.standard_normal(kernel.layer.infer_shape(in_shapes), dtype=np.float32)

    def run():
        workspace = {phase: np.zeros(kernel.workspace_bytes(in_shapes, phase), np.uint8) for phase in (FORWARD, BACKWARD)}
        y, gx = np.empty_like(gy), np.empty_like(x)
        gparams = {name: np.empty_like(value) for name, value in params.items()}
        kernel.forward(KernelContext(np, workspace=workspace[FORWARD]), [x], params, {}, y, {})
        kernel.backward(KernelContext(np, workspace=workspace[BACKWARD]), gy, Saved((x,), None), params, {}, [gx],
                        gparams)
        return y, gx

    served = []
    real = cpu_conv._channel_tiles
    monkeypatch.setattr(cpu_conv, "_channel_tiles", lambda *args: served.append(real(*args)) or served[-1])
    channels = run()
    assert any(served)
    monkeypatch.setattr(cpu_conv, "_channel_tiles", lambda *args: False)
    kernel._layouts.clear()  # the workspace arrays it remembered are the channel tiles'
    pixels = run()
    for by_channels, by_pixels in zip(channels, pixels):
        np.testing.assert_array_equal(by_channels, by_pixels)


@pytest.mark.parametrize("options", [
    dict(kernel=1),
    dict(kernel=3, padding=1),
    dict(kernel=3, padding=1, stride=2),  # two phases of x's planes each way
    dict(kernel=(2, 3), padding=(1, 0), stride=(2, 3)),  # six phases, taps past some phases' reach
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
@pytest.mark.parametrize("shape", [(3, 20, 7, 7), (2, 9, 4, 5), (2, 16, 10, 10)])  # 20 channels: 3 vectors of 8,
# the last in part; 16 channels of 10 columns: x's planes by 8 x 8 blocks transposed (stride 1), and the rest
def test_the_weight_gradient_over_small_maps_is_an_implicit_gemm(options, shape):
    """Output maps under GEMM_PIXELS and at least a vector of input channels: gweight by
    cpu_weight_gemm (x in padded phase planes with the channels last, vectors of input
    channels), in float64, against finite differences and the reference."""
    x = np.random.default_rng(5).standard_normal(shape)
    kernel = DirectConv2d(Conv2d(out_channels=11, **options))
    assert kernel._gemm_grad_weight([x.shape], 8)
    check_layer(kernel, [x], _reference(kernel.layer))


def test_the_weight_gradient_over_larger_maps_or_few_channels_is_by_dot_products():
    layer = Conv2d(out_channels=4, kernel=3, padding=1)
    assert not DirectConv2d(layer)._gemm_grad_weight([(2, 16, 12, 11)], 4)  # 132 output pixels
    assert not DirectConv2d(layer)._gemm_grad_weight([(2, lanes_of(4) - 1, 8, 8)], 4)  # fewer channels than a vector


@pytest.mark.parametrize("elements", [100, 400, 1 << 20])  # spans of 3 pixels (the last 1), 8 (a vector), all 16
def test_the_direct_pointwise_weight_gradient_sums_its_spans_of_pixels(elements, monkeypatch):
    """A 1x1's weight gradient reads x and gy where they are, a run of pixels per sample, the
    pixels in spans of about POINTWISE_SPAN_ELEMENTS values of x and gy, added in order."""
    monkeypatch.setattr(cpu_conv, "POINTWISE_SPAN_ELEMENTS", elements)
    x = np.random.default_rng(4).standard_normal((3, 5, 4, 4))
    kernel = DirectConv2d(Conv2d(out_channels=9, kernel=1, bias=False))
    data_gradient = kernel._grad_input_arrays([x.shape], snrt.threads.kernel_threads(), 8)
    assert kernel.workspace_bytes([x.shape], BACKWARD, 8) == cpu_conv._size(data_gradient, 8)  # no copies of x or gy
    check_layer(kernel, [x], _reference(kernel.layer))


@pytest.mark.parametrize("outs, kernel, shape", [(16, 3, (4, 6)), (6, 3, (6, 4)), (5, 1, (6, 4))])
def test_weight_gradient_blocks_run_along_whichever_side_repeats_fewer_rows(outs, kernel, shape):
    """block_shape with 6 x 4 blocks: 16 output channels in blocks of 4 (none repeated; 6 would
    repeat 2 in 18), 6 in one block of 6; and in float64 against finite differences and the
    reference either way."""
    layer = Conv2d(out_channels=outs, kernel=kernel, padding=kernel // 2)
    x = np.random.default_rng(7).standard_normal((2, 4, 5, 6))
    if cpu_conv.BLOCK == (6, 4):  # AVX-512's; AVX's 4 x 4 is the same either way
        assert cpu_conv.block_shape(outs, 4 * kernel * kernel) == shape
    check_layer(DirectConv2d(layer), [x], _reference(layer))


@pytest.mark.parametrize("elements", [1, 2000])  # a chunk per sample; two samples a chunk, the last short
@pytest.mark.parametrize("stride", [1, (2, 3)])  # at (2, 3): 6 phase planes of x a channel
def test_the_direct_weight_gradient_sums_its_chunks_of_samples(elements, stride, monkeypatch):
    monkeypatch.setattr(cpu_conv, "GRAD_WEIGHT_ELEMENTS", elements if stride == 1 else elements * 13 // 20)
    layer = Conv2d(out_channels=5, kernel=(3, 2), padding=(1, 0), stride=stride)
    x = np.random.default_rng(2).standard_normal((5, 6, 7, 8))
    kernel = DirectConv2d(layer)
    assert kernel._grad_weight_samples([x.shape]) == (1 if elements == 1 else 2)
    check_layer(kernel, [x], _reference(layer))


@pytest.mark.parametrize("options, served", [
    (dict(out_channels=4, kernel=3, padding=1), True),
    (dict(out_channels=4, kernel=3, padding=1, stride=2), True),  # the forward
    (dict(out_channels=4, kernel=3, padding=2, dilation=2), False),
    (dict(out_channels=4, kernel=3, padding=1, groups=2), False),
    (dict(out_channels=4, kernel=1), True),  # a 1x1 over 81 pixels: 5 vectors, the last moved back
    (dict(out_channels=4, kernel=1, stride=2), True),  # over x's 5 x 5 pixels at the stride, copied out
    (dict(out_channels=4, kernel=3, padding=3), False),  # the data gradient's padding would be negative
])
def test_direct_convolution_serves_dense_kernels(options, served):
    assert DirectConv2d.serves(Conv2d(**options), [(2, 4, 9, 9)]) is served
    kernel = CPU_KERNELS.kernel_for(Conv2d(**options), [(2, 4, 9, 9)])
    assert isinstance(kernel, ChosenConv2d) is served
    assert not DirectConv2d.serves(Conv2d(out_channels=4, kernel=1), [(2, 4, 3, 5)])  # 15 pixels: under a vector
    assert not DirectConv2d.serves(Conv2d(out_channels=4, kernel=1, stride=2), [(2, 4, 7, 5)])  # 4 x 3 outputs


@pytest.mark.parametrize("stride, shape", [(2, (3, 5, 9, 9)), ((2, 3), (2, 6, 10, 14)), ((3, 1), (2, 4, 14, 5))])
def test_a_strided_1x1_runs_over_the_pixels_at_its_stride_copied_out(stride, shape):
    """A 1x1 at a stride over 1: forward and weight gradient as a 1x1 at stride 1 over
    x[:, :, ::sh, ::sw] copied into the workspace (before the unit-stride kernel's arrays), the
    data gradient phase by phase (one phase has the tap, the others are zeros); in float64,
    against finite differences and the reference."""
    layer = Conv2d(out_channels=7, kernel=1, stride=stride)
    x = np.random.default_rng(6).standard_normal(shape)
    kernel = DirectConv2d(layer)
    assert kernel.serves(layer, [x.shape]) and kernel.unit_stride.layer.stride == (1, 1)
    subsampled = kernel._subsampled([x.shape])
    assert subsampled == x[:, :, ::layer.stride[0], ::layer.stride[1]].shape
    assert kernel.workspace_bytes([x.shape], FORWARD, 8) == scratch_bytes(
        numel(subsampled) * 8, kernel.unit_stride.workspace_bytes([subsampled], FORWARD, 8))
    check_layer(kernel, [x], _reference(layer))


def test_a_strided_convolutions_direct_backward_works_phase_by_phase(monkeypatch):
    """At a stride over 1 the weight gradient reads x's phase planes, and gx is computed phase by
    phase, each the convolution of gy with a sub-kernel (2x2, 2x1, 1x2 and 1x1 of a 3x3 at
    stride 2) into a plane of its own; the larger of the two parts' workspaces is reserved."""
    monkeypatch.setenv("SNRT_CPU_KERNELS", "direct")
    layer, shapes = Conv2d(out_channels=4, kernel=3, padding=1, stride=2), [(2, 4, 9, 9)]
    kernel, direct = CPU_KERNELS.kernel_for(layer, shapes), DirectConv2d(layer)
    assert isinstance(kernel.chosen(shapes, FORWARD), DirectConv2d)
    assert isinstance(kernel.chosen(shapes, BACKWARD), DirectConv2d)
    assert direct._plane(shapes) == (6, 6)  # 11 x 11 padded, in 2 x 2 phases
    assert [direct._phase_taps(p) for p in direct._phases()] == [(2, 2), (2, 1), (1, 2), (1, 1)]
    assert direct._phase_arrays(shapes, (0, 0), 1, 4)[0][0] == (2, 4, 6, 6)  # 5 x 5 outputs, a row more
    parts = [direct._grad_weight_arrays(shapes)] + [direct._phase_arrays(shapes, p, snrt.threads.kernel_threads(), 4)
                                                    for p in direct._phases()]
    assert kernel.workspace_bytes(shapes, BACKWARD) == max(cpu_conv._size(arrays, 4) for arrays in parts)


def _direct_run(layer, x, params, gy, threads, monkeypatch, kernel_class=DirectConv2d):
    """Forward and backward of `kernel_class` (DirectConv2d) on `threads` kernel threads, each
    in exactly the workspace it declares: (y, gx, gweight, gbias)."""
    monkeypatch.setattr(snrt.threads, "_LIMIT", [threads])
    kernel = kernel_class(layer)
    ws = {phase: np.zeros(kernel.workspace_bytes([x.shape], phase), np.uint8) for phase in (FORWARD, BACKWARD)}
    y = np.full(gy.shape, np.nan, np.float32)
    kernel.forward(KernelContext(np, workspace=ws[FORWARD]), [x], params, {}, y, {})
    gx = np.full_like(x, np.nan)
    grads = {k: np.full_like(v, np.nan) for k, v in params.items()}
    kernel.backward(KernelContext(np, workspace=ws[BACKWARD]), gy, Saved(xs=(x,)), params, {}, [gx], grads)
    return y, gx, grads["weight"], grads.get("bias")


@pytest.mark.parametrize("shape, outs, kernel, padding", [
    ((3, 5, 10, 9), 6, 3, 1),  # a map narrower than a vector: vectors run across rows
    ((3, 4, 5, 37), 19, 3, 1),  # rows of two whole vectors and a part; three blocks of channels, the last short
    ((3, 5, 6, 17), 9, 3, 1),  # 17 wide: vectors along the padded rows (by_rows), those inside one row stored whole
    ((5, 3, 3, 16), 9, (3, 5), (1, 2)),  # one whole vector a row, an odd count a sample: pairs across samples
    ((2, 6, 7, 7), 4, 3, 0),  # no padding
    ((3, 6, 4, 8), 19, 1, 0),  # 1x1: x read in place, 2 vectors a sample, three blocks of channels
    ((3, 5, 4, 12), 3, 1, 0),  # 1x1: 3 vectors a sample, tiles across samples, the last vector alone
    ((3, 5, 7, 7), 10, 1, 0),  # 1x1 over 49 pixels: a sample's 4th vector moved back 15 lanes, 1 stored
    ((2, 3, 5, 5), 9, 1, 0),  # 1x1 over 25 pixels: 2 vectors a sample, the second 9 lanes new
])
def test_the_tile_kernel_matches_pytorch_forward_and_data_gradient_in_float32(shape, outs, kernel, padding,
                                                                                monkeypatch):
    """cpu_tiles at stride 1 (the forward, and the data gradient as a convolution of gy), on
    two threads in exactly its workspace: PyTorch's values to float32 rounding."""
    rng = np.random.default_rng(8)
    layer = Conv2d(out_channels=outs, kernel=kernel, padding=padding)
    x = rng.standard_normal(shape, dtype=np.float32)
    params = {k: rng.standard_normal(s.shape, dtype=np.float32) for k, s in layer.param_specs([x.shape]).items()}
    gy = rng.standard_normal(layer.infer_shape([x.shape]), dtype=np.float32)
    y, gx, gweight, gbias = _direct_run(layer, x, params, gy, 2, monkeypatch)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, torch.tensor(params["weight"]), torch.tensor(params["bias"]),
                                    padding=layer.padding)
    yt.backward(torch.tensor(gy))
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(gx, xt.grad.numpy(), rtol=1e-5, atol=2e-5)


def test_maps_whose_rows_would_leave_many_lanes_empty_run_along_the_padded_rows():
    from snrt.backends.cpu_tiles import by_rows

    assert [by_rows(wo, wo + 2, 16) for wo in (8, 16, 17, 20, 24, 28, 32, 56)] == [False, True, False, False, True,
                                                                                      True, True, True]
    assert by_rows(20, 22, 8) and not by_rows(17, 19, 8)  # AVX: 24 lanes a row against 22 (19) along them


AVX_CHECK = """
import json, sys
import numpy as np
import snrt.backends.cpu_dots as dots
dots.VECTOR_BYTES = 32  # a processor without AVX-512, before the kernels read it
dots.BLOCK = (4, 4)
dots.dots = dots.block_dots(*dots.BLOCK)
import torch
from snrt.backends import cpu_tiles
from snrt.backends.cpu_conv import DirectConv2d
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.conv import Conv2d
errors = []
for shape, outs, kernel, padding, stride in json.loads(sys.argv[1]):
    rng = np.random.default_rng(1)
    layer = Conv2d(out_channels=outs, kernel=kernel, padding=padding, stride=stride)
    x = rng.standard_normal(shape, dtype=np.float32)
    params = {k: rng.standard_normal(s.shape, dtype=np.float32) for k, s in layer.param_specs([x.shape]).items()}
    kernel_ = DirectConv2d(layer)
    y = np.empty(layer.infer_shape([x.shape]), np.float32)
    workspace = {phase: np.zeros(kernel_.workspace_bytes([x.shape], phase), np.uint8) for phase in (FORWARD, BACKWARD)}
    kernel_.forward(KernelContext(np, workspace=workspace[FORWARD]), [x], params, {}, y, {})
    gy = rng.standard_normal(y.shape, dtype=np.float32)
    gx, grads = np.empty_like(x), {k: np.empty_like(v) for k, v in params.items()}
    kernel_.backward(KernelContext(np, workspace=workspace[BACKWARD]), gy, Saved(xs=(x,)), params, {}, [gx], grads)
    xt = torch.tensor(x, requires_grad=True)
    yt = torch.nn.functional.conv2d(xt, torch.tensor(params["weight"]), torch.tensor(params["bias"]),
                                    padding=layer.padding, stride=layer.stride)
    yt.backward(torch.tensor(gy))
    weight_grad = torch.ops.aten.convolution_backward(torch.tensor(gy), torch.tensor(x), torch.tensor(params["weight"]),
                                                      None, layer.stride, layer.padding, (1, 1), False, (0, 0), 1,
                                                      (False, True, False))[1].numpy()
    errors.append(max(float(np.abs(y - yt.detach().numpy()).max()), float(np.abs(gx - xt.grad.numpy()).max()),
                      float(np.abs(grads["weight"] - weight_grad).max())))
import snrt.backends.cpu_conv as conv
print(json.dumps({"lanes": cpu_tiles.lanes_of(4), "block": cpu_tiles.BLOCK_OUTS, "dots": conv.BLOCK, "errors": errors}))
"""


def test_the_tile_kernel_with_avx_vectors_matches_pytorch(tmp_path):
    """The tiles as a processor without AVX-512 runs them (8 lanes, 4 output channels a tile;
    the weight gradients by 4 x 4 dot products or the implicit GEMM's vectors of 8 channels), in
    a process of their own (compiled afresh: numba's cache keeps no global's value)."""
    cases = [[(3, 5, 10, 9), 6, 3, 1, 1], [(3, 4, 5, 37), 19, 3, 1, 1], [(5, 3, 3, 16), 9, [3, 5], [1, 2], 1],
             [(3, 5, 4, 6), 3, 1, 0, 1], [(2, 3, 11, 20), 5, 3, 1, [2, 3]], [(2, 3, 11, 20), 5, 1, 0, [2, 3]],
             [(2, 9, 5, 6), 5, 3, 1, 1], [(2, 17, 8, 8), 5, 3, 1, 2]]  # weight gradients by the implicit GEMM
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", AVX_CHECK, json.dumps(cases)], capture_output=True, text=True,
                          env=env, cwd=str(Path(__file__).resolve().parents[2]), timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert (result["lanes"], result["block"], result["dots"]) == (8, 4, [4, 4])
    assert len(result["errors"]) == len(cases) and max(result["errors"]) < 1e-4, result


@pytest.mark.parametrize("stride, shape, kernel", [(1, (3, 5, 10, 9), 3), (2, (3, 5, 10, 9), 3), (1, (3, 4, 5, 37), 3),
                                                  (1, (3, 5, 4, 12), 1)])
def test_direct_convolution_gives_the_same_bits_on_any_number_of_threads(stride, shape, kernel, monkeypatch):
    rng = np.random.default_rng(5)
    layer = Conv2d(out_channels=6, kernel=kernel, padding=kernel // 2, stride=stride)
    x = rng.standard_normal(shape, dtype=np.float32)
    params = {k: rng.standard_normal(s.shape, dtype=np.float32) for k, s in layer.param_specs([x.shape]).items()}
    gy = rng.standard_normal(layer.infer_shape([x.shape]), dtype=np.float32)
    one = _direct_run(layer, x, params, gy, 1, monkeypatch)
    for threads in (2, 3, 7):  # 7: more threads than rows for some
        for a, b in zip(one, _direct_run(layer, x, params, gy, threads, monkeypatch)):
            np.testing.assert_array_equal(a, b)


def test_depthwise_channels_last_gives_the_same_bits_on_any_number_of_threads(monkeypatch):
    """A map narrower than ROWS_MIN_WIDTH with enough multiply-adds: channels last, its
    forward's samples split among the threads (each thread its own padded input and rows)."""
    monkeypatch.setattr(cpu_depthwise, "SPLIT_PRODUCTS", 1)
    rng = np.random.default_rng(8)
    layer = Conv2d(out_channels=12, kernel=5, padding=2, groups=6)  # two outputs an input channel
    x = rng.standard_normal((5, 6, 4, 3), dtype=np.float32)
    params = {k: rng.standard_normal(s.shape, dtype=np.float32) for k, s in layer.param_specs([x.shape]).items()}
    gy = rng.standard_normal(layer.infer_shape([x.shape]), dtype=np.float32)
    monkeypatch.setattr(snrt.threads, "_LIMIT", [3])
    assert CompiledDepthwiseConv2d(layer)._threads([x.shape], FORWARD) == 3
    one = _direct_run(layer, x, params, gy, 1, monkeypatch, CompiledDepthwiseConv2d)
    for threads in (2, 3, 7):  # 7: more threads than samples
        for a, b in zip(one, _direct_run(layer, x, params, gy, threads, monkeypatch, CompiledDepthwiseConv2d)):
            np.testing.assert_array_equal(a, b)
    reference = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(params["weight"]), torch.tensor(params["bias"]),
                                           padding=2, groups=6).numpy()
    np.testing.assert_allclose(one[0], reference, rtol=1e-5, atol=1e-5)


def test_direct_convolution_runs_on_fewer_threads_in_a_workspace_planned_for_fewer(monkeypatch):
    rng = np.random.default_rng(6)
    layer = Conv2d(out_channels=4, kernel=3, padding=1, bias=False)
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    weight = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    monkeypatch.setattr(snrt.threads, "_LIMIT", [1])
    kernel = DirectConv2d(layer)
    ws = np.zeros(kernel.workspace_bytes([x.shape], FORWARD), np.uint8)
    monkeypatch.setattr(snrt.threads, "_LIMIT", [4])  # limited after planning
    y = np.empty((2, 4, 8, 8), np.float32)
    kernel.forward(KernelContext(np, workspace=ws), [x], {"weight": weight}, {}, y, {})
    expected = torch.nn.functional.conv2d(torch.tensor(x), torch.tensor(weight), padding=1).numpy()
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-5)


def test_direct_convolution_runs_in_a_child_forked_after_it_ran(monkeypatch):
    """`snrt plan` forks a child that plans (and may measure kernels) while the parent goes on:
    the child must not wait on the parent's kernel threads, which it does not have."""
    rng = np.random.default_rng(7)
    layer = Conv2d(out_channels=4, kernel=3, padding=1, bias=False)
    x = rng.standard_normal((2, 3, 8, 8), dtype=np.float32)
    weight = rng.standard_normal((4, 3, 3, 3), dtype=np.float32)
    gy = rng.standard_normal((2, 4, 8, 8), dtype=np.float32)
    y = _direct_run(layer, x, {"weight": weight}, gy, 2, monkeypatch)[0]  # the parent's pool exists now
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)

    def child():
        send.send(_direct_run(layer, x, {"weight": weight}, gy, 2, monkeypatch)[0])
        os._exit(0)

    process = multiprocessing.get_context("fork").Process(target=child, daemon=True)
    process.start()
    try:
        assert receive.poll(60), "the forked child hung"
        np.testing.assert_array_equal(receive.recv(), y)
    finally:
        process.kill()
        process.join()


def test_convolution_algorithm_is_measured_once_and_kept_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})
    timed = []
    real = cpu_choice.best_seconds
    monkeypatch.setattr(cpu_choice, "best_seconds", lambda *args: timed.append(args[2:]) or real(*args))
    layer, shape = Conv2d(out_channels=4, kernel=3, padding=1), [(2, 3, 8, 8)]
    kernel = CPU_KERNELS.kernel_for(layer, shape)
    chosen = {phase: kernel.chosen(shape, phase) for phase in (FORWARD, BACKWARD)}
    assert all(isinstance(k, (Conv2d, DirectConv2d)) for k in chosen.values())
    assert _distinct(timed) == [(shape, FORWARD), (shape, BACKWARD)]  # each twice where im2col won once
    measured = len(timed)
    kernel.workspace_bytes(shape, FORWARD)  # asked again: remembered
    assert len(timed) == measured
    entries = json.loads((tmp_path / "cpu-kernels.json").read_text())
    assert sorted(entry["kernel"] for entry in entries.values()) == sorted(
        "direct" if isinstance(k, DirectConv2d) else "im2col" for k in chosen.values())
    assert all(set(entry["seconds"]) == {"direct", "im2col"} for entry in entries.values())
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})  # a new process: the file answers
    assert {phase: type(kernel.chosen(shape, phase)) for phase in chosen} == {p: type(k) for p, k in chosen.items()}
    assert len(timed) == measured
    (tmp_path / "cpu-kernels.json").write_text("{not json")  # damaged: measured again
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})
    kernel.chosen(shape, FORWARD)
    assert len(timed) > measured


def test_choices_are_kept_per_processor_generation_not_per_vendor_line():
    """Two virtual machines may both call their processor 'AMD EPYC': the family and model
    numbers tell the generations apart in the choices file's keys."""
    info = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {}\nmodel\t\t: {}\nmodel name\t: AMD EPYC\n"
    older, newer = cpu_choice.named_cpu(info.format(25, 17)), cpu_choice.named_cpu(info.format(26, 2))
    assert older == "AMD EPYC (family 25, model 17)" and newer == "AMD EPYC (family 26, model 2)"
    assert cpu_choice.named_cpu("model name\t: Some CPU\n") == "Some CPU"
    assert cpu_choice.named_cpu("processor\t: 0\n") is None  # no name: the caller asks the platform


def _distinct(items):
    """`items` without repeats, in order (lists inside: not hashable)."""
    return [item for i, item in enumerate(items) if item not in items[:i]]


@pytest.mark.parametrize("first, second, chosen, calls", [
    ({"direct": 1.0, "im2col": 0.8}, {"direct": 1.0, "im2col": 0.85}, "im2col", 2),  # confirmed
    ({"direct": 1.0, "im2col": 0.8}, {"direct": 0.7, "im2col": 0.85}, "direct", 2),  # the first was noise
    ({"direct": 1.0, "im2col": 0.95}, None, "direct", 1),  # the default kept: measured once
])
def test_leaving_the_default_kernel_takes_two_measurements_that_agree(monkeypatch, tmp_path, first, second, chosen,
                                                                       calls):
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})
    answers = [first, second]
    monkeypatch.setattr(cpu_choice, "best_seconds", lambda *args: dict(answers.pop(0)))
    layer, shape = Conv2d(out_channels=4, kernel=3, padding=1), [(2, 3, 8, 8)]
    kernel = CPU_KERNELS.kernel_for(layer, shape)
    assert kernel.chosen(shape, FORWARD) is kernel.candidates[chosen]
    assert len(answers) == 2 - calls
    best = {name: min(a[name] for a in (first, second) if a) for name in first}
    assert cpu_choice.chosen_seconds(layer, shape, FORWARD, kernel.candidates) == pytest.approx(best[chosen])


@pytest.mark.parametrize("seconds, chosen", [
    ({"direct": 1.0, "im2col": 0.85}, "im2col"),
    ({"direct": 1.0, "im2col": 0.95}, "direct"),  # a near tie keeps the default
    ({"direct": 1.0, "im2col": 1.5}, "direct"),
    ({"direct": 0.5, "im2col": 2.0, "other": 0.4}, "other"),
])
def test_another_kernel_replaces_the_default_only_when_clearly_faster(seconds, chosen):
    assert cpu_choice.pick(seconds) == chosen


def test_the_direct_kernel_is_the_default_candidate():
    kernel = CPU_KERNELS.kernel_for(Conv2d(out_channels=4, kernel=3, padding=1), [(2, 3, 8, 8)])
    assert list(kernel.candidates) == ["direct", "im2col"]


def test_big_batches_share_one_measurement_at_a_bounded_batch(monkeypatch, tmp_path):
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})
    monkeypatch.setattr(cpu_choice, "MEASURED_ELEMENTS", 3 * 8 * 8 * 5)  # 5 samples of (3, 8, 8)
    timed = []
    real = cpu_choice.best_seconds
    monkeypatch.setattr(cpu_choice, "best_seconds", lambda *args: timed.append(args[2]) or real(*args))
    layer = Conv2d(out_channels=4, kernel=3, padding=1)
    for batch in (64, 7, 5, 3):
        CPU_KERNELS.kernel_for(layer, [(batch, 3, 8, 8)]).chosen([(batch, 3, 8, 8)], FORWARD)
    assert _distinct(timed) == [[(5, 3, 8, 8)], [(3, 3, 8, 8)]]  # 64, 7 and 5 samples: measured once, at 5


def test_the_cost_model_takes_the_chosen_kernels_measured_time_scaled_to_the_batch(monkeypatch, tmp_path):
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})
    monkeypatch.setattr(cpu_choice, "MEASURED_ELEMENTS", 3 * 8 * 8 * 5)  # measured at 5 samples
    times = {FORWARD: {"direct": 0.002, "im2col": 0.001}, BACKWARD: {"direct": 0.003, "im2col": 0.004}}
    monkeypatch.setattr(cpu_choice, "best_seconds", lambda candidates, layer, shapes, phase: dict(times[phase]))
    layer = Conv2d(out_channels=4, kernel=3, padding=1)
    shapes = [(20, 3, 8, 8)]
    assert CPU_KERNELS.measured_seconds(layer, shapes, FORWARD) == pytest.approx(0.001 * 20 / 5)  # im2col's
    assert CPU_KERNELS.measured_seconds(layer, shapes, BACKWARD) == pytest.approx(0.003 * 20 / 5)  # direct's
    assert CPU_KERNELS.measured_seconds(layer, shapes, FORWARD, itemsize=2) is None  # bf16 adds its staging
    assert CPU_KERNELS.measured_seconds(BatchNorm(), shapes, FORWARD) is None  # the rates predict the rest
    graph = Graph("two_convs")
    graph.add(Input(shape=(3, 8, 8)), name="data")
    graph.add(Input(shape=(), dtype="int64"), name="label")
    graph.add(Conv2d(out_channels=3, kernel=1), inputs=["data"], name="first")
    graph.add(layer, inputs=["first"], name="conv")
    graph.add(GlobalAvgPool(), inputs=["conv"], name="pool")
    graph.add(SoftmaxCrossEntropy(), inputs=["pool", "label"], name="loss")
    steps = {s.kind: s for s in make_plan(graph, 20, "none", kernels=CPU_KERNELS).steps
             if s.node == "conv" and s.kind in ("forward", "backward")}
    for kind, phase in (("forward", FORWARD), ("backward", BACKWARD)):
        assert cost.step_seconds(steps[kind], graph, 20, cost.CPU, CPU_KERNELS) == pytest.approx(
            min(times[phase].values()) * 20 / 5 + cost.CPU.step_overhead_s)
    monkeypatch.setenv("SNRT_CPU_KERNELS", "direct")  # forced: nothing measured
    assert CPU_KERNELS.measured_seconds(layer, shapes, FORWARD) is None


def test_a_choice_without_a_usable_time_leaves_the_step_to_the_rates(monkeypatch, tmp_path):
    monkeypatch.setenv("SNRT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_choice, "_CHOSEN", {})
    layer, shapes = Conv2d(out_channels=4, kernel=3, padding=1), [(2, 3, 8, 8)]
    entry = cpu_choice._entry(layer, shapes, FORWARD, CPU_KERNELS.kernel_for(layer, shapes).candidates)
    for seconds in (None, {"direct": float("nan"), "im2col": float("nan")}, {"direct": -1.0, "im2col": True}, "1"):
        entry["seconds"] = seconds
        assert CPU_KERNELS.measured_seconds(layer, shapes, FORWARD) is None


@pytest.mark.parametrize("name, kind", [("im2col", Conv2d), ("direct", DirectConv2d)])
def test_convolution_algorithm_can_be_forced(monkeypatch, name, kind):
    monkeypatch.setenv("SNRT_CPU_KERNELS", name)
    kernel = CPU_KERNELS.kernel_for(Conv2d(out_channels=4, kernel=3, padding=1), [(2, 3, 8, 8)])
    assert isinstance(kernel.chosen([(2, 3, 8, 8)], BACKWARD), kind)


def test_unknown_forced_algorithm_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("SNRT_CPU_KERNELS", "winograd")
    kernel = CPU_KERNELS.kernel_for(Conv2d(out_channels=4, kernel=3, padding=1), [(2, 3, 8, 8)])
    expected = "SNRT_CPU_KERNELS is 'winograd': expected 'measure' or one of 'direct', 'im2col'"
    with pytest.raises(SnrtError, match=expected):
        kernel.workspace_bytes([(2, 3, 8, 8)], FORWARD)


def test_conv2d_kernel_covers_input():
    _check((1, 2, 3, 3), out_channels=2, kernel=3)  # 1x1 output, one GEMM column per sample


def test_conv2d_pointwise_single_sample():
    _check((1, 4, 5, 3), out_channels=3, kernel=1)  # no workspace at all, forward or backward


def test_conv2d_single_sample_big_stride():
    _check((1, 3, 9, 8), out_channels=2, kernel=2, stride=4, padding=2)


def test_conv2d_float32_matches_float64():
    rng = np.random.default_rng(3)
    layer = Conv2d(out_channels=4, kernel=3, padding=1, stride=2)
    x64 = rng.standard_normal((2, 3, 8, 8))
    params = {k: rng.standard_normal(s.shape) for k, s in layer.param_specs([x64.shape]).items()}
    outs = []
    for dtype in (np.float32, np.float64):
        y = np.full(layer.infer_shape([x64.shape]), np.nan, dtype)
        ws = np.zeros(layer.workspace_bytes([x64.shape], FORWARD, np.dtype(dtype).itemsize), np.uint8)
        layer.forward(KernelContext(np, workspace=ws), [x64.astype(dtype)],
                      {k: v.astype(dtype) for k, v in params.items()}, {}, y, {})
        assert y.dtype == dtype
        outs.append(y)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_conv2d_skips_data_gradient():
    rng = np.random.default_rng(4)
    layer = Conv2d(out_channels=3, kernel=3, padding=1)
    x = rng.standard_normal((2, 2, 5, 5))
    params = {k: rng.standard_normal(s.shape) for k, s in layer.param_specs([x.shape]).items()}
    gy = rng.standard_normal(layer.infer_shape([x.shape]))
    ws = np.zeros(layer.workspace_bytes([x.shape], BACKWARD, 8), np.uint8)
    gparams = {k: np.full_like(v, np.nan) for k, v in params.items()}
    layer.backward(KernelContext(np, workspace=ws), gy, Saved(xs=(x,)), params, {}, [None], gparams)
    xt = torch.tensor(x)
    wt = torch.tensor(params["weight"], requires_grad=True)
    bt = torch.tensor(params["bias"], requires_grad=True)
    torch.nn.functional.conv2d(xt, wt, bt, 1, 1).backward(torch.tensor(gy))
    np.testing.assert_allclose(gparams["weight"], wt.grad.numpy(), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(gparams["bias"], bt.grad.numpy(), rtol=1e-10, atol=1e-10)


def test_conv2d_infer_shape_and_params():
    layer = Conv2d(out_channels=64, kernel=7, stride=2, padding=3)
    assert layer.infer_shape([(8, 3, 224, 224)]) == (8, 64, 112, 112)
    specs = Conv2d(out_channels=8, kernel=(3, 1), groups=2).param_specs([(2, 4, 5, 5)])
    assert specs["weight"].shape == (8, 2, 3, 1) and specs["weight"].init == "he_normal"
    assert specs["weight"].fan_in == 2 * 3 and specs["weight"].fan_out == 8 * 3 // 2
    assert specs["bias"].shape == (8,) and specs["bias"].init == "zeros" and not specs["bias"].decay
    assert "bias" not in Conv2d(out_channels=8, bias=False).param_specs([(2, 4, 5, 5)])
    assert Conv2d(out_channels=1, kernel=3, dilation=2, padding=(2, 0)).infer_shape([(1, 1, 9, 9)]) == (1, 1, 9, 5)


def test_conv2d_options_normalised():
    layer = Conv2d(out_channels=2, kernel=(1, 7), stride=2, padding=[0, 3])
    assert layer.kernel == (1, 7) and layer.stride == (2, 2) and layer.padding == (0, 3)
    assert layer.dilation == (1, 1)
    assert layer.options()["kernel"] == [1, 7]


def test_conv2d_workspace():
    shape = [(2, 4, 7, 6)]
    layer = Conv2d(out_channels=3, kernel=3, padding=1)
    col, out = 4 * 9 * 2 * 7 * 6 * 8, 3 * 2 * 7 * 6 * 8  # whole batch in one chunk
    weight_grad_t = 4 * 9 * 3 * 8  # 3 output channels: the weight gradient is computed transposed
    assert layer.workspace_bytes(shape, FORWARD, 8) == scratch_bytes(col, out)
    assert layer.workspace_bytes(shape, BACKWARD, 8) == scratch_bytes(col, out, weight_grad_t)
    pointwise, big = Conv2d(out_channels=3, kernel=1), [(2, 4, 32, 32)]  # 1024 pixels: x[n] is the column matrix
    assert pointwise.workspace_bytes(big, FORWARD, 4) == 0
    assert pointwise.workspace_bytes(big, BACKWARD, 4) == scratch_bytes(3 * 4 * 4)
    assert pointwise.workspace_bytes([(1, 4, 32, 32)], BACKWARD, 4) == scratch_bytes(3 * 4 * 4)
    wide = Conv2d(out_channels=128, kernel=1)  # more than 64 outputs: gy col^T into gW directly
    assert wide.workspace_bytes([(1, 4, 32, 32)], BACKWARD, 4) == 0
    # a small map groups the samples as other kernels do: a copy of x as the column matrix, gy staged
    assert pointwise.workspace_bytes(shape, FORWARD, 4) == scratch_bytes(4 * 2 * 42 * 4, 3 * 2 * 42 * 4)
    assert pointwise.workspace_bytes(shape, BACKWARD, 4) == scratch_bytes(4 * 2 * 42 * 4, 3 * 2 * 42 * 4, 3 * 4 * 4)


def test_conv2d_workspace_is_one_chunk():
    """The workspace holds one chunk's column matrix, not the batch's: bands of rows of one
    sample for big images, a few samples for small ones, about gemm_columns GEMM columns."""
    layer = Conv2d(out_channels=64, kernel=3, padding=1)
    columns = 19 * 56  # forward: 56 rows in 3 bands of at most 19 rows (gemm_columns 1024)
    assert layer._chunking(8, 64, 56, 56, FORWARD) == (1, 19)
    assert layer.workspace_bytes([(8, 64, 56, 56)], FORWARD, 4) == 64 * 9 * columns * 4
    assert layer._chunking(8, 64, 56, 56, BACKWARD) == (1, 56)  # backward: whole samples
    assert layer.workspace_bytes([(8, 64, 56, 56)], BACKWARD, 4) == scratch_bytes(
        64 * 9 * 56 * 56 * 4, 64 * 64 * 9 * 4)
    assert layer._chunking(8, 64, 14, 14, FORWARD) == (4, 14)  # 2 chunks of 4 samples, 784 columns
    assert layer.workspace_bytes([(8, 64, 14, 14)], FORWARD, 4) == scratch_bytes(
        64 * 9 * 4 * 196 * 4, 64 * 4 * 196 * 4)
    assert layer.workspace_bytes([(1, 64, 14, 14)], BACKWARD, 4) == scratch_bytes(64 * 9 * 196 * 4,
                                                                                   64 * 9 * 64 * 4)
    stem = Conv2d(out_channels=64, kernel=7, stride=2, padding=3)
    assert stem._chunking(8, 3, 112, 112, FORWARD) == (2, 112)  # 3 channels: big chunks, few numpy calls


# gemm_columns 1: one output row per forward chunk; 10: bands of 2, 2, 2, 1 rows (or 2 + 1
# samples); backward: single samples;
# 50: 2 + 1 samples; 100: the whole batch in one chunk.
@pytest.mark.parametrize("gemm_columns", [1, 10, 50, 100])
@pytest.mark.parametrize("options", [
    dict(out_channels=4, kernel=3, padding=1, groups=2),
    dict(out_channels=3, kernel=(2, 3), stride=2, bias=False),
    dict(out_channels=2, kernel=3, padding=(2, 1), dilation=(2, 1)),
    dict(out_channels=4, kernel=1, groups=2),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_conv2d_batch_chunks(monkeypatch, gemm_columns, options):
    monkeypatch.setattr(Conv2d, "gemm_columns", gemm_columns)
    monkeypatch.setattr(Conv2d, "tap_elements", 1)
    _check((3, 4, 7, 5), **options)


def test_conv2d_cost():
    layer = Conv2d(out_channels=8, kernel=3, padding=1, groups=2)
    forward = layer.cost([(2, 4, 5, 5)], FORWARD)
    assert forward.flops == 2 * 2 * 8 * 25 * 2 * 9 + 2 * 8 * 25
    assert layer.cost([(2, 4, 5, 5)], BACKWARD).flops > forward.flops


@pytest.mark.parametrize("in_shape, options, words", [
    ((2, 4, 7), dict(), "NCHW"),
    ((2, 3, 7, 7), dict(groups=2, out_channels=2), "input channels 3"),
    ((2, 4, 7, 7), dict(groups=2, out_channels=3), "out_channels 3"),
    ((2, 4, 2, 7), dict(kernel=3), "output spatial size"),
    ((2, 4, 5, 5), dict(kernel=3, dilation=3), "output spatial size"),
])
def test_conv2d_shape_errors(in_shape, options, words):
    with pytest.raises(ShapeError, match=words):
        Conv2d(**{"out_channels": 1, **options}).infer_shape([in_shape])


@pytest.mark.parametrize("options, name", [
    (dict(stride=0), "stride"),
    (dict(kernel=(3, 0)), "kernel"),
    (dict(kernel=(3, 3, 3)), "kernel"),
    (dict(kernel=2.5), "kernel"),
    (dict(dilation=True), "dilation"),
    (dict(padding=-1), "padding"),
    (dict(padding="valid"), "padding"),
    (dict(out_channels=0), "out_channels"),
    (dict(groups=0), "groups"),
    (dict(bias="yes"), "bias"),
])
def test_conv2d_option_validation(options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        Conv2d(**{"out_channels": 1, **options})


def test_conv2d_stride_message():
    with pytest.raises(ValueError, match=r"option 'stride' must be a positive int or pair of positive ints, got 0"):
        Conv2d(out_channels=1, stride=0)


@pytest.mark.parametrize("gemm_columns", [5, 1000])
@pytest.mark.parametrize("options", [
    dict(out_channels=3, kernel=3, padding=2, stride=2),
    dict(out_channels=4, kernel=(3, 1), padding=(1, 0), groups=2),
    dict(out_channels=3, kernel=3, padding=1),
    dict(out_channels=3, kernel=1),
])
def test_conv2d_ignores_stale_workspace(monkeypatch, options, gemm_columns):
    """The harness hands out zeroed workspace; a planned one holds leftovers (here NaN bytes)."""
    monkeypatch.setattr(Conv2d, "gemm_columns", gemm_columns)
    monkeypatch.setattr(Conv2d, "tap_elements", 1)
    rng = np.random.default_rng(5)
    layer = Conv2d(**options)
    x = rng.standard_normal((2, 4, 6, 5))
    params = {k: rng.standard_normal(s.shape) for k, s in layer.param_specs([x.shape]).items()}
    gy = rng.standard_normal(layer.infer_shape([x.shape]))
    results = []
    for fill in (0, 0xFF):
        def ctx(phase):
            return KernelContext(np, workspace=np.full(layer.workspace_bytes([x.shape], phase, 8), fill, np.uint8))
        y = np.full(gy.shape, np.nan)
        layer.forward(ctx(FORWARD), [x], params, {}, y, {})
        gxs, gparams = [np.full_like(x, np.nan)], {k: np.full_like(v, np.nan) for k, v in params.items()}
        layer.backward(ctx(BACKWARD), gy, Saved(xs=(x,)), params, {}, gxs, gparams)
        results.append([y, gxs[0], *gparams.values()])
    for clean, stale in zip(*results):
        assert not np.isnan(stale).any()
        np.testing.assert_array_equal(clean, stale)


@pytest.mark.parametrize("max_out", [0, 1 << 30], ids=["gy-colT", "transposed"])
@pytest.mark.parametrize("gemm_columns", [10, 1024], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("options", [
    dict(out_channels=3, kernel=3, padding=1),
    dict(out_channels=6, kernel=3, padding=1, groups=2),
    dict(out_channels=3, kernel=1),
], ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_conv2d_weight_gradient_in_either_orientation(monkeypatch, max_out, gemm_columns, options):
    """Both GEMM orientations of the weight gradient (chosen by output channels per group),
    with one chunk and with the partial sums of many, against PyTorch and finite differences."""
    import snrt.layers.conv as conv

    monkeypatch.setattr(conv, "TRANSPOSED_WEIGHT_GRAD_MAX_OUT", max_out)
    monkeypatch.setattr(Conv2d, "gemm_columns", gemm_columns)
    monkeypatch.setattr(Conv2d, "tap_elements", 1)
    layer = _check((3, 4, 7, 6), **options)
    assert layer._weight_grad_transposed() == (max_out > 0)


@pytest.mark.parametrize("kernel, dilation", [(3, 1), (5, 1), ((3, 5), 2), ((1, 3), 1)])
def test_padding_same_keeps_the_size_and_matches_pytorch(kernel, dilation):
    layer = Conv2d(out_channels=3, kernel=kernel, dilation=dilation, padding="same")
    x = np.random.default_rng(0).standard_normal((2, 2, 7, 6))
    check_layer(layer, [x], lambda xs, p: torch.nn.functional.conv2d(xs[0], p["weight"], p["bias"], padding="same",
                                                                    dilation=dilation))
    assert layer.infer_shape([(2, 2, 7, 6)]) == (2, 3, 7, 6)


@pytest.mark.parametrize("options, words", [(dict(kernel=3, stride=2), "needs stride 1"),
                                            (dict(kernel=2), "to pad both sides alike")])
def test_padding_same_refuses_what_it_cannot_do_symmetrically(options, words):
    with pytest.raises(ValueError, match=words):
        Conv2d(out_channels=1, padding="same", **options)


def _transposed_reference(layer):
    def reference(xs, p):
        return torch.nn.functional.conv_transpose2d(xs[0], p["weight"], p.get("bias"), layer.stride, layer.padding,
                                                    layer.output_padding, layer.groups, layer.dilation)
    return reference


@pytest.mark.parametrize("gemm_columns", [10, 1024], ids=["chunks", "one-chunk"])
@pytest.mark.parametrize("shape, options", [
    ((2, 3, 4, 5), dict(out_channels=4, kernel=3)),
    ((2, 3, 4, 4), dict(out_channels=2, kernel=2, stride=2)),  # U-Net's 2x upsampling
    ((2, 3, 4, 5), dict(out_channels=4, kernel=3, stride=2, padding=1, output_padding=1)),
    ((1, 4, 3, 3), dict(out_channels=6, kernel=(2, 3), stride=(2, 1), padding=(0, 1), dilation=(1, 2))),
    ((2, 4, 3, 4), dict(out_channels=6, kernel=3, padding=1, groups=2, bias=False)),
    ((3, 4, 3, 3), dict(out_channels=4, kernel=3, stride=2, groups=4)),  # depthwise
    ((2, 5, 3, 4), dict(out_channels=3, kernel=1)),  # pointwise: no column matrix
])
def test_conv_transpose2d_matches_pytorch(monkeypatch, gemm_columns, shape, options):
    monkeypatch.setattr(Conv2d, "gemm_columns", gemm_columns)
    monkeypatch.setattr(Conv2d, "tap_elements", 1)
    layer = ConvTranspose2d(**options)
    x = np.random.default_rng(3).standard_normal(shape)
    check_layer(layer, [x], _transposed_reference(layer))


def test_conv_transpose2d_shapes_and_params():
    layer = ConvTranspose2d(out_channels=8, kernel=4, stride=2, padding=1)
    assert layer.infer_shape([(2, 16, 7, 9)]) == (2, 8, 14, 18)
    specs = layer.param_specs([(2, 16, 7, 9)])
    assert specs["weight"].shape == (16, 8, 4, 4) and specs["bias"].shape == (8,) and not specs["bias"].decay
    assert specs["weight"].fan_in == 16 * 2 * 2
    assert layer.saves.inputs == (0,) and layer.recompute_cost == "expensive"
    assert layer.cost([(2, 16, 7, 9)], BACKWARD).flops > layer.cost([(2, 16, 7, 9)], FORWARD).flops > 0


@pytest.mark.parametrize("options, name", [
    (dict(out_channels=2, output_padding=1), "output_padding"),  # not below the stride 1
    (dict(out_channels=2, stride=2, output_padding=-1), "output_padding"),
    (dict(out_channels=2, padding="same"), "padding"),
    (dict(out_channels=0), "out_channels"),
    (dict(out_channels=2, bias="yes"), "bias"),
])
def test_conv_transpose2d_option_validation(options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        ConvTranspose2d(**options)


@pytest.mark.parametrize("in_shape, options, words", [
    ((2, 3, 4), dict(out_channels=2), "NCHW"),
    ((2, 3, 4, 4), dict(out_channels=2, groups=2), "not divisible by groups"),
    ((2, 3, 1, 1), dict(out_channels=2, kernel=1, padding=1), "< 1"),
])
def test_conv_transpose2d_shape_errors(in_shape, options, words):
    with pytest.raises(ShapeError, match=words):
        ConvTranspose2d(**options).infer_shape([in_shape])


@pytest.mark.parametrize("stride, fitted, out", [((10**6, 2), (6, 2), (1, 2)), ((10**12, 10**12), (6, 5), (1, 1)),
                                                ((3, 7), (3, 5), (2, 1))])
def test_a_stride_past_the_input_is_fitted_to_it_and_computes_what_torch_does_with_it(stride, fitted, out):
    """A window that cannot move along an axis (no second one fits) leaves the stride nothing to
    do: the graph keeps the smallest that leaves only the first window, so no kernel sizes its
    work (phase planes, windows) by a stride of 10^12, and the results are torch's with it."""
    options = dict(out_channels=3, kernel=3, padding=1, stride=stride)
    graph = Graph()
    graph.add(Input((4, 5, 4)), name="data")
    graph.add(Conv2d(**options))
    assert graph["conv2d0"].layer.stride == fitted and graph["conv2d0"].shape == (3, *out)
    x = np.random.default_rng(0).standard_normal((2, 4, 5, 4))
    check_layer(graph["conv2d0"].layer, [x], _reference(Conv2d(**options)))
