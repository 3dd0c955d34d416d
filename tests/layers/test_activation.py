import numpy as np
import pytest
import torch

from snrt.backends.cpu_activation import CompiledActivation
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.layers.activation import ELU, GELU, Identity, LeakyReLU, ReLU, ReLU6, Sigmoid, SiLU, Softmax, Tanh
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from tests.layers.harness import check_layer


def away_from_zero(shape, seed=0):
    """Values with |x| >= 0.1 so that no finite difference straddles a kink."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.1, 2.0, size=shape) * rng.choice([-1.0, 1.0], size=shape)
    return x


# each layer with its PyTorch reference; the test's id is the layer's repr (a lambda's repr holds
# its address, which differs between pytest-xdist workers)
ACTIVATIONS = [
    (ReLU(), lambda xs, p: torch.relu(xs[0])),
    (ReLU6(), lambda xs, p: torch.nn.functional.relu6(xs[0])),
    (LeakyReLU(slope=0.1), lambda xs, p: torch.nn.functional.leaky_relu(xs[0], 0.1)),
    (Sigmoid(), lambda xs, p: torch.sigmoid(xs[0])),
    (Tanh(), lambda xs, p: torch.tanh(xs[0])),
    (SiLU(), lambda xs, p: torch.nn.functional.silu(xs[0])),
    (ELU(), lambda xs, p: torch.nn.functional.elu(xs[0])),
    (ELU(alpha=2.5), lambda xs, p: torch.nn.functional.elu(xs[0], 2.5)),
    (ELU(alpha=0.3), lambda xs, p: torch.nn.functional.elu(xs[0], 0.3)),
    (GELU(), lambda xs, p: torch.nn.functional.gelu(xs[0])),
    (GELU(approximate="tanh"), lambda xs, p: torch.nn.functional.gelu(xs[0], approximate="tanh")),
    (Identity(), lambda xs, p: xs[0]),
    (Softmax(), lambda xs, p: torch.softmax(xs[0], dim=1)),
]


@pytest.mark.parametrize("layer, reference", ACTIVATIONS, ids=[repr(layer) for layer, _ in ACTIVATIONS])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_activation(layer, reference, shape):
    check_layer(layer, [away_from_zero(shape)], reference)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 7)])
def test_compiled_relu(shape):
    """The CPU backend's ReLU kernel: the same checks, and the same bits as the layer's code,
    a NaN in the saved output included (check mode's poison must stay visible)."""
    kernel = CPU_KERNELS.kernel_for(ReLU(), [shape])
    assert isinstance(kernel, CompiledActivation)
    check_layer(kernel, [away_from_zero(shape)], lambda xs, p: torch.relu(xs[0]))
    rng = np.random.default_rng(1)
    y = np.maximum(rng.standard_normal(shape), 0).astype(np.float32)
    y.flat[0] = np.nan
    gy = rng.standard_normal(shape).astype(np.float32)
    expected, got = np.empty_like(y), np.empty_like(y)
    ReLU().backward(KernelContext(np), gy, Saved((None,), y), {}, {}, [expected], {})
    kernel.backward(KernelContext(np), gy, Saved((None,), y), {}, {}, [got], {})
    np.testing.assert_array_equal(got, expected)
    assert np.isnan(got.flat[0])


COMPILED_ACTIVATIONS = [(layer, reference) for layer, reference in ACTIVATIONS
                        if type(layer) in (GELU, SiLU, Sigmoid, ELU, ReLU, ReLU6)]


@pytest.mark.parametrize("layer, reference", COMPILED_ACTIVATIONS, ids=[repr(l) for l, _ in COMPILED_ACTIVATIONS])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 700)])  # 700 * 3: vectors and a remainder
def test_compiled_activations(layer, reference, shape):
    """The CPU backend's kernels (float32; float64 runs the layer's code) by the same checks."""
    kernel = CPU_KERNELS.kernel_for(layer, [shape])
    assert isinstance(kernel, CompiledActivation)
    check_layer(kernel, [away_from_zero(shape)], reference)


@pytest.mark.parametrize("layer, reference", COMPILED_ACTIVATIONS, ids=[repr(l) for l, _ in COMPILED_ACTIVATIONS])
def test_compiled_activations_over_a_wide_range(layer, reference):
    """From -80 to 80 (the exponential's clamped range and beyond) the kernels' values and
    gradients agree with PyTorch's to 1e-6 (GELU's erf formula is within 1.5e-7, times |x|;
    where PyTorch's tanh saturates to 1 in float32 its tanh-form gradient is 0, the kernel's a
    few 1e-7), and NaN stays NaN (first, in the kernels' vector loop, and last, in its
    remainder)."""
    x = np.concatenate([[np.nan], np.linspace(-80, 80, 8001), [np.nan]]).astype(np.float32)
    kernel = CPU_KERNELS.kernel_for(layer, [x.shape])
    y, (gx,) = np.empty_like(x), [np.empty_like(x)]
    workspace = [np.zeros(kernel.workspace_bytes([x.shape], phase), np.uint8) for phase in (FORWARD, BACKWARD)]
    kernel.forward(KernelContext(np, workspace=workspace[0]), [x], {}, {}, y, {})
    kernel.backward(KernelContext(np, workspace=workspace[1]), np.ones_like(x), Saved((x,), y), {}, {}, [gx], {})
    t = torch.tensor(x[1:-1], requires_grad=True)
    out = reference([t], {})
    out.sum().backward()
    np.testing.assert_allclose(y[1:-1], out.detach().numpy(), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(gx[1:-1], t.grad.numpy(), rtol=2e-6, atol=1e-6)
    assert np.isnan(y[[0, -1]]).all() and np.isnan(gx[[0, -1]]).all()


def test_sigmoid_is_finite_for_large_inputs():
    from tests.layers.harness import run_forward

    y, _ = run_forward(Sigmoid(), [np.array([[-1e4, 0.0, 1e4]], dtype=np.float32)], {})
    np.testing.assert_array_equal(y, [[0.0, 0.5, 1.0]])


@pytest.mark.parametrize("slope", [0.0, 1.5, -0.1])
def test_leaky_relu_rejects_bad_slope(slope):
    with pytest.raises(ValueError, match="slope"):
        LeakyReLU(slope=slope)


def test_softmax_along_another_axis():
    check_layer(Softmax(axis=3), [away_from_zero((2, 3, 4, 5))], lambda xs, p: torch.softmax(xs[0], dim=3))


def test_softmax_axis_out_of_range():
    from snrt.errors import ShapeError

    with pytest.raises(ShapeError, match="axis 3 is out of range"):
        Softmax(axis=3).infer_shape([(2, 7)])


def test_gelu_erf_matches_torch_over_a_wide_range():
    """The erf formula behind GELU(approximate: none) agrees with PyTorch's exact erf to float32
    precision from -8 to 8, the tails included."""
    from tests.layers.harness import run_forward

    x = np.linspace(-8, 8, 4001).reshape(1, -1)
    y, _ = run_forward(GELU(), [x], {})
    expected = torch.nn.functional.gelu(torch.tensor(x)).numpy()
    np.testing.assert_allclose(y, expected, rtol=0, atol=3e-7)


@pytest.mark.parametrize("options, name", [(dict(alpha=0), "alpha"), (dict(alpha=float("nan")), "alpha"),
                                           (dict(alpha=True), "alpha")])
def test_elu_rejects_bad_alpha(options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        ELU(**options)


def test_gelu_and_softmax_reject_bad_options():
    with pytest.raises(ValueError, match="option 'approximate'"):
        GELU(approximate="fast")
    with pytest.raises(ValueError, match="option 'axis'"):
        Softmax(axis=0)


def test_relu6_clips_at_six():
    """Inputs on both sides of 0 and of 6 (none within 0.1 of either kink)."""
    x = away_from_zero((4, 50)) * 5
    x[np.abs(x - 6) < 0.1] += 0.2
    assert (x > 6).any() and ((x > 0) & (x < 6)).any() and (x < 0).any()
    check_layer(ReLU6(), [x], lambda xs, p: torch.nn.functional.relu6(xs[0]))


@pytest.mark.parametrize("axis, shape", [(1, (2, 3, 4, 5)), (1, (3, 7)), (3, (2, 3, 4, 5)), (1, (2, 5, 1100)),
                                         (2, (2, 3, 300, 700))])  # 1100, 700: more than one block of the kernel
def test_compiled_softmax(axis, shape):
    """The CPU backend's Softmax kernel: the layer's checks against PyTorch, the layer's own
    values to float32 rounding, and a NaN along the axis gives NaN there only."""
    from snrt.backends.cpu_activation import CompiledSoftmax
    from tests.layers.harness import run_forward

    layer = Softmax(axis=axis)
    kernel = CPU_KERNELS.kernel_for(layer, [shape])
    assert isinstance(kernel, CompiledSoftmax)
    if np.prod(shape) < 10_000:
        check_layer(kernel, [away_from_zero(shape)], lambda xs, p: torch.softmax(xs[0], dim=axis))
    x = (away_from_zero(shape, seed=2) * 5).astype(np.float32)
    x[(0,) * x.ndim] = np.nan
    (ours, _), (theirs, _) = run_forward(kernel, [x], {}), run_forward(layer, [x], {})
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=1e-7)
    nan_line = np.isnan(theirs)
    assert nan_line.any() and np.array_equal(np.isnan(ours), nan_line)
    rng = np.random.default_rng(3)
    y, gy = theirs, rng.standard_normal(shape).astype(np.float32)
    gx, expected = np.empty_like(y), np.empty_like(y)
    workspace = np.zeros(max(kernel.workspace_bytes([shape], BACKWARD), layer.workspace_bytes([shape], BACKWARD)),
                         np.uint8)
    kernel.backward(KernelContext(np, workspace=workspace), gy, Saved((x,), y), {}, {}, [gx], {})
    layer.backward(KernelContext(np, workspace=workspace), gy, Saved((x,), y), {}, {}, [expected], {})
    np.testing.assert_allclose(gx, expected, rtol=1e-5, atol=1e-6)  # gy - sum(gy y) cancels: rounding of O(1) terms
