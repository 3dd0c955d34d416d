import numpy as np
import pytest
import torch
import torch.nn.functional as F

from snrt.errors import ShapeError
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved, scratch_bytes
from snrt.threads import kernel_threads
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.backends.cpu_pool import CompiledAvgPool, CompiledMaxPool
from snrt.layers.pool import AvgPool, GlobalAvgPool, MaxPool
from tests.layers.harness import check_layer, run_backward, run_forward


def distinct(shape, seed=0):
    """Distinct values 0.1 apart, so finite differences never cross a max-pool kink."""
    return np.random.default_rng(seed).permutation(int(np.prod(shape))).reshape(shape) / 10.0


# (kernel, stride, padding, ceil_mode, input shape)
WINDOWS = [
    (2, None, 0, False, (2, 3, 6, 6)),
    (3, 2, 1, False, (2, 2, 7, 7)),
    (3, 2, 1, True, (2, 2, 8, 8)),  # ceil: the last window overhangs the right padding
    (3, 2, 0, True, (1, 2, 6, 6)),  # ceil: the last window overhangs the input, no padding
    (3, 3, 1, True, (1, 2, 5, 5)),  # ceil would add a window starting in the right padding: dropped
    ((2, 3), (1, 2), (1, 1), False, (2, 2, 5, 7)),
    ((3, 2), (2, 1), (1, 0), True, (1, 3, 6, 5)),
    (1, 2, 0, False, (1, 2, 5, 4)),
    ((4, 1), (3, 1), (2, 0), True, (1, 2, 9, 3)),
]


def _pool_kwargs(kernel, stride, padding, ceil_mode):
    return dict(kernel=kernel, stride=stride, padding=padding, ceil_mode=ceil_mode)


def _torch_kwargs(kernel, stride, padding, ceil_mode):
    return dict(kernel_size=kernel, stride=stride, padding=padding, ceil_mode=ceil_mode)


# the layer's own NumPy code, and the CPU backend's compiled kernel for it
KERNELS = pytest.mark.parametrize("kernel_of", [lambda layer: layer, CompiledMaxPool], ids=["numpy", "compiled"])


@KERNELS
@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, shape", WINDOWS)
def test_max_pool(kernel, stride, padding, ceil_mode, shape, kernel_of):
    layer = kernel_of(MaxPool(**_pool_kwargs(kernel, stride, padding, ceil_mode)))
    kwargs = _torch_kwargs(kernel, stride, padding, ceil_mode)
    check_layer(layer, [distinct(shape)], lambda xs, p: F.max_pool2d(xs[0], **kwargs))


@pytest.mark.parametrize("kernel_of", [lambda layer: layer, CompiledAvgPool], ids=["numpy", "compiled"])
@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, shape", WINDOWS)
def test_avg_pool(kernel, stride, padding, ceil_mode, shape, count_include_pad, kernel_of):
    layer = AvgPool(**_pool_kwargs(kernel, stride, padding, ceil_mode), count_include_pad=count_include_pad)
    kwargs = _torch_kwargs(kernel, stride, padding, ceil_mode)
    x = np.random.default_rng(1).standard_normal(shape)
    check_layer(kernel_of(layer), [x], lambda xs, p: F.avg_pool2d(xs[0], count_include_pad=count_include_pad, **kwargs))


@pytest.mark.parametrize("count_include_pad", [True, False])
@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, shape", WINDOWS)
def test_the_compiled_avg_pool_is_the_layers_bit_for_bit(kernel, stride, padding, ceil_mode, shape,
                                                         count_include_pad):
    """Forward and backward: the same sums in the same order and the same products by 1 /
    divisor as the layer's passes (overlapping windows add several products at one place)."""
    layer = AvgPool(**_pool_kwargs(kernel, stride, padding, ceil_mode), count_include_pad=count_include_pad)
    compiled = CPU_KERNELS.kernel_for(layer, [shape])
    assert isinstance(compiled, CompiledAvgPool) and compiled.workspace_bytes([shape], BACKWARD) == 0
    rng = np.random.default_rng(7)
    x = rng.standard_normal(shape).astype(np.float32)
    (expected, _), (got, _) = run_forward(layer, [x], {}), run_forward(compiled, [x], {})
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))
    gy = rng.standard_normal(expected.shape).astype(np.float32)
    (expected_gx,), _ = run_backward(layer, [x], expected, {}, gy, {})
    (got_gx,), _ = run_backward(compiled, [x], got, {}, gy, {})
    np.testing.assert_array_equal(got_gx.view(np.uint32), expected_gx.view(np.uint32))


@KERNELS
def test_max_pool_large_window_uses_int32_indices(kernel_of):
    layer = kernel_of(MaxPool(kernel=16, stride=1))
    assert layer.aux_specs([(1, 1, 16, 16)])["argmax"].dtype == "int32"
    assert MaxPool(kernel=(15, 17)).aux_specs([(1, 1, 15, 17)])["argmax"].dtype == "uint8"
    check_layer(layer, [distinct((1, 2, 17, 18))], lambda xs, p: F.max_pool2d(xs[0], 16, 1))


@KERNELS
def test_max_pool_ties_go_to_the_first_maximum_like_torch(kernel_of):
    x = np.zeros((1, 2, 6, 6), dtype=np.float32)
    x[0, 1, 2:4, 2:4] = 1.0  # a tie inside each window covering it
    layer = kernel_of(MaxPool(kernel=3, stride=1, padding=1))
    y, aux = run_forward(layer, [x], {})
    gy = np.random.default_rng(2).standard_normal(y.shape).astype(np.float32)
    gxs, _ = run_backward(layer, [x], y, aux, gy, {})
    tx = torch.tensor(x, requires_grad=True)
    F.max_pool2d(tx, 3, 1, 1).backward(torch.tensor(gy))
    np.testing.assert_allclose(gxs[0], tx.grad.numpy(), rtol=1e-6, atol=1e-6)


@KERNELS
def test_max_pool_argmax_is_the_window_index(kernel_of):
    x = np.arange(16, dtype=np.float32).reshape(1, 1, 4, 4)
    _, aux = run_forward(kernel_of(MaxPool(kernel=2)), [x], {})
    assert aux["argmax"].dtype == np.uint8
    np.testing.assert_array_equal(aux["argmax"], 3)  # bottom-right of every 2x2 window
    _, aux = run_forward(kernel_of(MaxPool(kernel=3, stride=2, padding=1)), [x], {})
    np.testing.assert_array_equal(aux["argmax"][0, 0], [[8, 8], [8, 8]])


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, shape", WINDOWS)
def test_the_compiled_max_pool_forward_is_the_layers_bit_for_bit_nan_included(kernel, stride, padding, ceil_mode,
                                                                                shape):
    layer = MaxPool(**_pool_kwargs(kernel, stride, padding, ceil_mode))
    assert isinstance(CPU_KERNELS.kernel_for(layer, [shape]), CompiledMaxPool)
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    x.flat[::7] = np.nan
    expected, got = run_forward(layer, [x], {}), run_forward(CompiledMaxPool(layer), [x], {})
    np.testing.assert_array_equal(got[0], expected[0])
    np.testing.assert_array_equal(got[1]["argmax"], expected[1]["argmax"])


@pytest.mark.parametrize("kernel, stride, padding, ceil_mode, shape", WINDOWS)
def test_the_compiled_max_pool_backward_adds_each_gy_at_its_argmax_in_output_order(kernel, stride, padding,
                                                                                    ceil_mode, shape):
    """Bit for bit, each map's gy added at their windows' argmax positions one output after
    the other (np.add.at's order), those outside x (a window of -inf keeps its first offset,
    which may be padding) left out; overlapping windows add several gy at one place."""
    layer = MaxPool(**_pool_kwargs(kernel, stride, padding, ceil_mode))
    x = np.random.default_rng(5).standard_normal(shape).astype(np.float32)
    x[..., ::3, :] = x[..., :2, :] = -np.inf  # the top windows see only -inf and padding
    y, aux = run_forward(layer, [x], {})
    gy = np.random.default_rng(6).standard_normal(y.shape).astype(np.float32)
    (got,), _ = run_backward(CompiledMaxPool(layer), [x], y, aux, gy, {})
    (_, kw), (sh, sw), (ph, pw) = layer.kernel, layer.stride, layer.padding
    k = aux["argmax"].astype(np.int64)
    rows = np.arange(y.shape[2])[:, None] * sh - ph + k // kw
    columns = np.arange(y.shape[3])[None, :] * sw - pw + k % kw
    inside = (rows >= 0) & (rows < shape[2]) & (columns >= 0) & (columns < shape[3])
    maps = np.arange(shape[0] * shape[1]).reshape(shape[0], shape[1], 1, 1)
    expected = np.zeros(shape, np.float32)
    np.add.at(expected.reshape(-1), ((maps * shape[2] + rows) * shape[3] + columns)[inside], gy[inside])
    assert (~inside).any() == (ph > 0)
    np.testing.assert_array_equal(got.view(np.uint32), expected.view(np.uint32))


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (1, 2, 1, 1), (3, 2, 11, 13)])
@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
def test_global_avg_pool(shape, compiled):
    x = np.random.default_rng(3).standard_normal(shape)
    layer = GlobalAvgPool()
    assert layer.infer_shape([shape]) == shape[:2]
    kernel = CPU_KERNELS.kernel_for(layer, [shape]) if compiled else layer
    assert (kernel is layer) != compiled
    check_layer(kernel, [x], lambda xs, p: torch.flatten(F.adaptive_avg_pool2d(xs[0], 1), 1))


def test_pools_save_nothing_but_max_pool_argmax():
    for layer in (MaxPool(3), AvgPool(3), GlobalAvgPool()):
        assert layer.saves.inputs == () and not layer.saves.output
        assert layer.recompute_cost == "cheap"
    assert AvgPool(2).aux_specs([(1, 1, 4, 4)]) == {}
    assert MaxPool(3, 2, 1).aux_specs([(2, 3, 8, 8)])["argmax"].shape == (2, 3, 4, 4)


def test_options_are_normalised():
    layer = MaxPool(kernel=3)
    assert layer.kernel == (3, 3) and layer.stride == (3, 3) and layer.padding == (0, 0)
    layer = AvgPool(kernel=[2, 3], stride=[1, 2], padding=(1, 0))
    assert layer.kernel == (2, 3) and layer.stride == (1, 2) and layer.padding == (1, 0)
    assert AvgPool(kernel=2).options() == {
        "kernel": [2, 2], "stride": [2, 2], "padding": [0, 0], "ceil_mode": False, "count_include_pad": True,
    }


@pytest.mark.parametrize("cls", [MaxPool, AvgPool])
@pytest.mark.parametrize("options, name", [
    (dict(kernel=None), "kernel"),
    (dict(kernel=0), "kernel"),
    (dict(kernel=True), "kernel"),
    (dict(kernel="3"), "kernel"),
    (dict(kernel=(1, 2, 3)), "kernel"),
    (dict(kernel=2, stride=0), "stride"),
    (dict(kernel=2, stride=(1, -1)), "stride"),
    (dict(kernel=2, padding=-1), "padding"),
    (dict(kernel=2, padding=1.0), "padding"),
    (dict(kernel=2, ceil_mode=1), "ceil_mode"),
])
def test_option_validation(cls, options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        cls(**options)


def test_avg_pool_count_include_pad_validation():
    with pytest.raises(ValueError, match="option 'count_include_pad'"):
        AvgPool(kernel=2, count_include_pad="no")


@pytest.mark.parametrize("cls", [MaxPool, AvgPool])
@pytest.mark.parametrize("layer_options, shape, message", [
    (dict(kernel=2), (2, 3, 4), "NCHW"),
    (dict(kernel=2), (2, 3, 4, 4, 4), "NCHW"),
    (dict(kernel=5), (1, 1, 4, 6), "larger than the padded input height 4"),
    (dict(kernel=(3, 5), padding=(1, 0)), (1, 1, 8, 4), "larger than the padded input width 4"),
    (dict(kernel=3, padding=2), (1, 1, 8, 8), "padding 2 must be at most half the kernel size 3"),
    (dict(kernel=(4, 2), padding=(2, 2)), (1, 1, 8, 8), "padding 2 must be at most half the kernel size 2"),
])
def test_shape_errors(cls, layer_options, shape, message):
    with pytest.raises(ShapeError, match=message):
        cls(**layer_options).infer_shape([shape])


def test_global_avg_pool_needs_nchw():
    with pytest.raises(ShapeError, match="NCHW"):
        GlobalAvgPool().infer_shape([(2, 3)])


def test_costs_and_workspace():
    shape = [(8, 16, 32, 32)]
    for layer in (MaxPool(3, 2, 1), AvgPool(3, 2, 1), GlobalAvgPool()):
        forward, backward = layer.cost(shape, FORWARD), layer.cost(shape, BACKWARD)
        assert forward.flops > 0 and forward.bytes >= 8 * 16 * 32 * 32 * 4
        assert backward.bytes >= forward.bytes
    assert MaxPool(3, 2, 1).cost(shape, FORWARD).flops == 2 * 9 * 8 * 16 * 16 * 16
    assert AvgPool(3, 2, 1).workspace_bytes(shape, FORWARD) == 0
    assert AvgPool(3, 2, 1).workspace_bytes(shape, BACKWARD) == 8 * 16 * 16 * 16 * 4
    assert MaxPool(3, 2, 1).workspace_bytes(shape, FORWARD) == 2 * 8 * 16 * 16 * 16  # mask, uint8 step
    assert MaxPool(16).workspace_bytes(shape, FORWARD) == 5 * 8 * 16 * 2 * 2  # mask, int32 step
    assert MaxPool(3, 2, 1).workspace_bytes(shape, BACKWARD) == 5 * 8 * 16 * 16 * 16  # mask, float32 part
    assert GlobalAvgPool().workspace_bytes(shape, BACKWARD) == 0


@pytest.mark.parametrize("shape, output", [((2, 3, 7, 5), (3, 2)), ((2, 3, 6, 6), 3), ((1, 2, 5, 7), 1),
                                           ((1, 2, 4, 4), (4, 4)), ((1, 2, 3, 3), (5, 2))])
@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "compiled"])
def test_adaptive_avg_pool_matches_pytorch_bins(shape, output, compiled):
    from snrt.layers.pool import AdaptiveAvgPool

    x = np.random.default_rng(0).standard_normal(shape)
    layer = AdaptiveAvgPool(output=output)
    kernel = CPU_KERNELS.kernel_for(layer, [shape]) if compiled else layer
    assert (kernel is layer) != compiled
    check_layer(kernel, [x], lambda xs, p: torch.nn.functional.adaptive_avg_pool2d(xs[0], output))


@pytest.mark.parametrize("scale", [2, (3, 2), 1])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
@pytest.mark.parametrize("compiled", [False, True], ids=["numpy", "cpu-kernels"])
def test_upsample_matches_pytorch(scale, mode, compiled):
    from snrt.layers.pool import Upsample
    from snrt.torch_reference import OPS

    layer = Upsample(scale=scale, mode=mode)
    x = np.random.default_rng(0).standard_normal((2, 3, 4, 5))
    kernel = CPU_KERNELS.kernel_for(layer, [x.shape]) if compiled else layer
    assert (kernel is layer) != compiled
    check_layer(kernel, [x], lambda xs, p: OPS["Upsample"](layer, xs, p, {}, True))
    assert layer.infer_shape([x.shape]) == (2, 3, 4 * layer.scale[0], 5 * layer.scale[1])


@pytest.mark.parametrize("scale", [2, (3, 2)])
def test_compiled_bilinear_upsample_gives_the_layers_values_in_float32(scale):
    """The bilinear kernel against the layer's weight-matrix products, float32, both ways, on
    maps wide enough that the kernel threads share them."""
    from snrt.backends.cpu_resample import CompiledUpsample
    from snrt.layers.pool import Upsample

    layer, shape = Upsample(scale=scale, mode="bilinear"), (2, 64, 48, 40)
    rng = np.random.default_rng(4)
    x = rng.standard_normal(shape).astype(np.float32)
    kernel = CPU_KERNELS.kernel_for(layer, [shape])
    rows = kernel_threads() * 48 * 40 * layer.scale[1]  # each thread's rows interpolated along the columns
    assert isinstance(kernel, CompiledUpsample)
    assert kernel.workspace_bytes([shape], FORWARD) == kernel.workspace_bytes([shape], BACKWARD) == scratch_bytes(4 * rows)
    (ours, _), (theirs, _) = run_forward(kernel, [x], {}), run_forward(layer, [x], {})
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    gy = rng.standard_normal(ours.shape).astype(np.float32)
    gx, expected = np.empty_like(x), np.empty_like(x)
    workspace = np.zeros(layer.workspace_bytes([shape], BACKWARD), np.uint8)
    kernel.backward(KernelContext(np, workspace=np.zeros(kernel.workspace_bytes([shape], BACKWARD), np.uint8)), gy,
                    Saved((x,), ours), {}, {}, [gx], {})
    layer.backward(KernelContext(np, workspace=workspace), gy, Saved((x,), ours), {}, {}, [expected], {})
    np.testing.assert_allclose(gx, expected, rtol=1e-5, atol=1e-5)


def test_upsample_rejects_bad_options():
    from snrt.layers.pool import Upsample

    with pytest.raises(ValueError, match="option 'mode'"):
        Upsample(mode="bicubic")
    with pytest.raises(ValueError, match="option 'scale'"):
        Upsample(scale=0)


@pytest.mark.parametrize("cls", [MaxPool, AvgPool])
@pytest.mark.parametrize("kernel, stride, padding, ceil_mode", [(3, 10**9, 1, True), (2, (10**9, 1), 0, False),
                                                                 (3, 4, 1, True)])
def test_a_stride_past_the_input_is_fitted_to_it_and_pools_what_torch_does_with_it(cls, kernel, stride, padding,
                                                                                   ceil_mode):
    from snrt.graph import Graph
    from snrt.layers.input import Input

    graph = Graph()
    graph.add(Input((2, 4, 4)), name="data")
    name = graph.add(cls(**_pool_kwargs(kernel, stride, padding, ceil_mode)))
    layer = graph[name].layer
    assert max(layer.stride) <= 5  # at most the input plus its padding: nothing sized by 10^9
    kwargs = _torch_kwargs(kernel, stride, padding, ceil_mode)
    torch_pool = F.max_pool2d if cls is MaxPool else F.avg_pool2d
    check_layer(layer, [distinct((2, 2, 4, 4))], lambda xs, p: torch_pool(xs[0], **kwargs))
