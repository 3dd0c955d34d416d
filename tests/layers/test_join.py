import numpy as np
import pytest
import torch

from snrt.backends.cpu_channel import CompiledGateMul, CompiledScale
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.errors import ShapeError
from snrt.layers.base import KernelContext, Saved
from snrt.layers.join import Add, Concat, Mul, Scale
from tests.layers.harness import check_layer


def randn(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("n_inputs", [2, 3])
def test_add(n_inputs):
    xs = [randn(2, 3, 4, 4, seed=i) for i in range(n_inputs)]
    check_layer(Add(), xs, lambda t, p: sum(t[1:], t[0]))


def test_add_rejects_mismatched_shapes():
    with pytest.raises(ShapeError, match="same shape"):
        Add().infer_shape([(1, 3, 4, 4), (1, 4, 4, 4)])


@pytest.mark.parametrize("axis", [1, 2])
def test_concat(axis):
    shapes = [(2, 3, 4, 5), (2, 3, 4, 5)]
    shapes = [tuple(c + i if d == axis else c for d, c in enumerate(s)) for i, s in enumerate(shapes)]
    xs = [randn(*s, seed=i) for i, s in enumerate(shapes)]
    check_layer(Concat(axis=axis), xs, lambda t, p: torch.cat(t, dim=axis))


def test_concat_writes_the_gradients_asked_for_at_the_offsets_of_every_input():
    """An input no parameter reaches (the images) gets no gradient: its slice of gy is skipped,
    found from the step's input shapes."""
    shapes = [(2, 3, 4, 4), (2, 2, 4, 4), (2, 1, 4, 4), (2, 4, 4, 4)]
    gy = np.random.default_rng(0).standard_normal((2, 10, 4, 4)).astype(np.float32)
    gxs = [None, np.empty(shapes[1], np.float32), None, np.empty(shapes[3], np.float32)]
    Concat().backward(KernelContext(np, in_shapes=shapes), gy, Saved((None,) * 4), {}, {}, gxs, {})
    np.testing.assert_array_equal(gxs[1], gy[:, 3:5])
    np.testing.assert_array_equal(gxs[3], gy[:, 6:])
    with pytest.raises(ValueError, match="needs the inputs' shapes"):
        Concat().backward(KernelContext(np), gy, Saved((None,) * 4), {}, {}, gxs, {})


@pytest.mark.parametrize("axis, shapes", [
    (1, [(2, 3, 4, 5), (2, 1, 4, 5)]),
    (2, [(2, 3, 4, 5), (2, 3, 2, 5), (2, 3, 1, 5)]),
    (3, [(2, 3, 4, 1), (2, 3, 4, 7)]),
    (1, [(4, 64, 32, 33), (4, 16, 32, 33), (4, 0, 32, 33)]),  # over SPLIT_VALUES values: split; an empty input
])
@pytest.mark.parametrize("split", [True, False])
def test_the_cpu_backend_concatenates_with_the_layers_bits_on_the_kernel_threads(axis, shapes, split, monkeypatch):
    """CompiledConcat: every input in its columns of the output, each gradient out of gy's
    (those asked for: one left None, its offset from the step's shapes), on the kernel threads
    or on one; float64, and a missing gradient without the shapes, by the layer's code."""
    from snrt.backends import cpu_join

    if not split:
        monkeypatch.setattr(cpu_join, "SPLIT_VALUES", 1 << 40)
    rng = np.random.default_rng(7)
    layer = Concat(axis=axis)
    kernel = CPU_KERNELS.kernel_for(layer, shapes)
    assert isinstance(kernel, cpu_join.CompiledConcat) and kernel.workspace_bytes(shapes, "backward") == 0
    xs = [rng.standard_normal(shape, dtype=np.float32) for shape in shapes]
    out_shape = layer.infer_shape(shapes)
    ours, theirs = np.full(out_shape, np.nan, np.float32), np.full(out_shape, np.nan, np.float32)
    kernel.forward(KernelContext(np), xs, {}, {}, ours, {})
    layer.forward(KernelContext(np), xs, {}, {}, theirs, {})
    np.testing.assert_array_equal(ours, theirs)
    np.testing.assert_array_equal(ours, np.concatenate(xs, axis=axis))
    gy = rng.standard_normal(out_shape, dtype=np.float32)
    gxs = [np.full(shape, np.nan, np.float32) for shape in shapes]
    gxs[0] = None
    kernel.backward(KernelContext(np, in_shapes=shapes), gy, Saved((None,) * len(shapes)), {}, {}, gxs, {})
    pieces = np.split(gy, np.cumsum([shape[axis] for shape in shapes])[:-1], axis=axis)
    assert all(np.array_equal(gx, piece) for gx, piece in zip(gxs[1:], pieces[1:]))
    with pytest.raises(ValueError, match="needs the inputs' shapes"):
        kernel.backward(KernelContext(np), gy, Saved((None,) * len(shapes)), {}, {}, gxs, {})
    small = [tuple(c + i if d == axis else c for d, c in enumerate((2, 3, 4, 5))) for i in range(2)]
    check_layer(kernel, [randn(*shape, seed=i) for i, shape in enumerate(small)], lambda ts, p: torch.cat(ts, dim=axis))


def test_concat_infers_channels_and_rejects_mismatch():
    assert Concat().infer_shape([(2, 3, 8, 8), (2, 5, 8, 8), (2, 1, 8, 8)]) == (2, 9, 8, 8)
    with pytest.raises(ShapeError, match="agree except on axis 1"):
        Concat().infer_shape([(2, 3, 8, 8), (2, 5, 4, 4)])


@pytest.mark.parametrize("x_shape, gate_shape", [
    ((2, 3, 4, 5), (2, 3, 4, 5)), ((2, 3, 4, 5), (2, 3)), ((2, 3, 4, 5), (2, 3, 1, 1)), ((2, 3, 4, 5), (2, 3, 4)),
    ((2, 3, 4, 5), (2, 1, 4, 1)), ((2, 3, 1, 1), (2, 3)),  # a 1x1 feature map: nothing to sum, shapes differ
])
def test_mul_with_a_gate_of_any_broadcastable_shape(x_shape, gate_shape):
    """A squeeze-and-excitation gate (N, C) or (N, C, 1, 1), a full product, and partial ones."""
    x, g = randn(*x_shape), randn(*gate_shape, seed=1)

    def reference(xs, p):
        gate = xs[1].reshape(xs[1].shape + (1,) * (xs[0].dim() - xs[1].dim()))
        return xs[0] * gate

    check_layer(Mul(), [x, g], reference)


@pytest.mark.parametrize("x_shape, gate_shape, compiled", [
    ((2, 3, 4, 5), (2, 3), True), ((3, 4, 7, 2), (3, 4, 1, 1), True), ((2, 3, 4), (2, 3), True),
    ((2, 3, 4, 5), (2, 3, 4, 5), False), ((2, 3, 4, 5), (2, 1, 4, 1), False), ((2, 3), (2, 3), False),
])
def test_the_cpu_backend_multiplies_by_a_channel_gate_with_a_kernel_of_its_own(x_shape, gate_shape, compiled):
    """The compiled channel-gate product (float32; float64 runs the layer's code) by the same
    checks; other gates are the layer's."""
    kernel = CPU_KERNELS.kernel_for(Mul(), [x_shape, gate_shape])
    assert isinstance(kernel, CompiledGateMul) == compiled
    x, g = randn(*x_shape), randn(*gate_shape, seed=1)
    check_layer(kernel, [x, g], lambda xs, p: xs[0] * xs[1].reshape(xs[1].shape + (1,) * (xs[0].dim() - xs[1].dim())))


@pytest.mark.parametrize("wanted", [(True, False), (False, True)])
def test_the_compiled_gate_product_gives_only_the_gradients_asked_for(wanted):
    from snrt.layers.base import KernelContext, Saved

    rng = np.random.default_rng(3)
    x, gate = rng.standard_normal((2, 3, 4, 5), dtype=np.float32), rng.standard_normal((2, 3), dtype=np.float32)
    gy = rng.standard_normal(x.shape, dtype=np.float32)
    kernel = CPU_KERNELS.kernel_for(Mul(), [x.shape, gate.shape])
    gxs = [np.full_like(a, np.nan) if want else None for a, want in zip((x, gate), wanted)]
    kernel.backward(KernelContext(np), gy, Saved((x, gate), None), {}, {}, gxs, {})
    expected = (gy * gate[:, :, None, None], (gy * x).sum(axis=(2, 3)))
    for got, want in zip(gxs, expected):
        if got is not None:
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (3, 6, 9)])
def test_the_cpu_backend_scales_channels_with_a_kernel_of_its_own(shape):
    kernel = CPU_KERNELS.kernel_for(Scale(init=0.3), [shape])
    assert isinstance(kernel, CompiledScale)
    check_layer(kernel, [randn(*shape)], lambda xs, p: xs[0] * p["weight"].reshape(1, -1, *([1] * (len(shape) - 2))))


@pytest.mark.parametrize("gate_shape", [(2, 4), (2, 3, 2), (1, 3), (2, 3, 4, 5, 1)])
def test_mul_rejects_a_gate_that_does_not_broadcast(gate_shape):
    with pytest.raises(ShapeError, match="does not broadcast"):
        Mul().infer_shape([(2, 3, 4, 5), gate_shape])


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 6)])
def test_scale_matches_pytorch(shape):
    check_layer(Scale(init=0.3), [randn(*shape)],
                lambda xs, p: xs[0] * p["weight"].reshape(1, -1, *([1] * (len(shape) - 2))))


def test_scale_starts_at_init_and_rejects_bad_init():
    from snrt.init import initial_value

    spec = Scale(init=1e-6).param_specs([(2, 5, 3, 3)])["weight"]
    np.testing.assert_array_equal(initial_value(spec, 0, "gamma", "weight"), np.full(5, 1e-6, np.float32))
    assert not spec.decay
    for bad in (float("nan"), "small", True):
        with pytest.raises(ValueError, match="option 'init'"):
            Scale(init=bad)


@pytest.mark.parametrize("inputs", [2, 3, 5])
@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (4, 16, 128, 130)])  # the second: over 2^20 values, split
def test_the_cpu_backend_adds_with_the_layers_bits_on_the_kernel_threads(inputs, shape):
    """CompiledAdd: the layer's values bit for bit (the same adds in the same order), its
    input gradients copies of gy (one without a gradient left alone), float64 by the layer."""
    from snrt.backends.cpu_join import CompiledAdd
    from snrt.layers.base import KernelContext, Saved

    rng = np.random.default_rng(5)
    xs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(inputs)]
    layer = Add()
    kernel = CPU_KERNELS.kernel_for(layer, [shape] * inputs)
    assert isinstance(kernel, CompiledAdd) and kernel.workspace_bytes([shape] * inputs, "forward") == 0
    ours, theirs = np.empty(shape, np.float32), np.empty(shape, np.float32)
    kernel.forward(KernelContext(np), xs, {}, {}, ours, {})
    layer.forward(KernelContext(np), xs, {}, {}, theirs, {})
    np.testing.assert_array_equal(ours, theirs)
    gy = rng.standard_normal(shape, dtype=np.float32)
    gxs = [np.full(shape, np.nan, np.float32) for _ in range(inputs)]
    gxs[1] = None
    kernel.backward(KernelContext(np), gy, Saved((None,) * inputs), {}, {}, gxs, {})
    assert all(np.array_equal(gx, gy) for gx in gxs if gx is not None)
    check_layer(kernel, [rng.standard_normal((2, 3, 4)) for _ in range(inputs)], lambda ts, p: sum(ts))
