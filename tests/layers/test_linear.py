import numpy as np
import pytest
import torch

from snrt.errors import ShapeError
from snrt.layers.linear import Flatten, Linear, Reshape
from tests.layers.harness import check_layer


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(4, 6), (3, 2, 3, 2)])
def test_linear(bias, shape):
    x = np.random.default_rng(0).standard_normal(shape)

    def reference(xs, p):
        return torch.nn.functional.linear(xs[0].reshape(xs[0].shape[0], -1), p["weight"], p.get("bias"))

    check_layer(Linear(out_features=5, bias=bias), [x], reference)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape, out, transposed", [((4, 6), 5, True), ((3, 2, 3, 2), 3, True), ((9, 6), 5, False)])
def test_the_cpu_backends_linear_computes_w_x_transposed_for_few_samples(bias, shape, out, transposed):
    """TransposedLinear: with at least as many outputs as samples the forward is W x^T in
    planned scratch, copied transposed into y (the layer's values to fp32 rounding, gradients
    the layer's); with fewer, the layer's own product and no workspace."""
    from snrt.backends.cpu_kernels import CPU_KERNELS
    from snrt.backends.cpu_linear import TransposedLinear
    from snrt.layers.base import BACKWARD, FORWARD, KernelContext

    layer = Linear(out_features=out, bias=bias)
    kernel = CPU_KERNELS.kernel_for(layer, [shape])
    assert isinstance(kernel, TransposedLinear) and kernel.transposed([shape]) == transposed
    assert kernel.workspace_bytes([shape], FORWARD) == (out * shape[0] * 4 if transposed else 0)
    assert kernel.workspace_bytes([shape], BACKWARD) == 0
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape, dtype=np.float32)
    params = {k: rng.standard_normal(s.shape, dtype=np.float32) for k, s in layer.param_specs([shape]).items()}
    ours, theirs = np.full((shape[0], out), np.nan, np.float32), np.empty((shape[0], out), np.float32)
    workspace = np.zeros(kernel.workspace_bytes([shape], FORWARD), np.uint8)
    kernel.forward(KernelContext(np, workspace=workspace), [x], params, {}, ours, {})
    layer.forward(KernelContext(np), [x], params, {}, theirs, {})
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)

    def reference(xs, p):
        return torch.nn.functional.linear(xs[0].reshape(xs[0].shape[0], -1), p["weight"], p.get("bias"))

    check_layer(kernel, [rng.standard_normal(shape)], reference)


def test_linear_param_shapes_and_init():
    specs = Linear(out_features=10).param_specs([(2, 3, 4, 4)])
    assert specs["weight"].shape == (10, 48) and specs["weight"].fan_in == 48
    assert specs["bias"].shape == (10,) and specs["bias"].init == "zeros" and not specs["bias"].decay


def test_linear_needs_features():
    with pytest.raises(ShapeError):
        Linear(out_features=3).infer_shape([(4,)])


def test_flatten():
    x = np.random.default_rng(1).standard_normal((2, 3, 4, 5))
    check_layer(Flatten(), [x], lambda xs, p: torch.flatten(xs[0], 1))


@pytest.mark.parametrize("shape, target", [((2, 3, 4, 4), (48,)), ((2, 3, 4, 4), (12, -1)), ((2, 12), (3, 2, 2)),
                                           ((2, 3, 4, 4), (-1, 3, 4))])
def test_reshape_matches_pytorch(shape, target):
    x = np.random.default_rng(0).standard_normal(shape)
    check_layer(Reshape(shape=target), [x], lambda xs, p: xs[0].reshape(shape[0], *target))


def test_reshape_errors():
    with pytest.raises(ShapeError, match="cannot reshape"):
        Reshape(shape=(5, -1)).infer_shape([(2, 3, 4)])
    for bad in ([], [0], [-1, -1], [2.5], "x"):
        with pytest.raises(ValueError, match="option 'shape'"):
            Reshape(shape=bad)
