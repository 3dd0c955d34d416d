"""The fused layers (snrt/layers/fused.py): against finite differences and PyTorch through the
harness, and bit for bit against BatchNorm then ReLU and Add then ReLU, for the layers' own
code and for the CPU's compiled kernels."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.layers.activation import ReLU
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.fused import MASK_SLICE, AddReLU, AddThenReLU, BatchNormReLU
from snrt.layers.join import Add
from snrt.layers.norm import BatchNorm
from tests.layers.harness import check_layer, make_params, make_state

# the layers' own NumPy code, and the CPU backend's kernel choice (compiled kernels)
KERNELS = pytest.mark.parametrize("kernels", [lambda layer, shapes: layer, CPU_KERNELS.kernel_for],
                                  ids=["numpy", "compiled"])


def _off_kinks(shape, seed):
    """float64 values whose BatchNorm output stays away from 0 (ReLU's kink) for finite differences."""
    x = np.random.default_rng(seed).standard_normal(shape)
    return x + np.sign(x) * 0.3


@KERNELS
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 4)])
def test_batch_norm_relu_matches_torch_and_finite_differences(shape, kernels):
    layer = BatchNormReLU(momentum=0.2)
    state = make_state(layer, [shape], np.float64)

    def reference(xs, p):
        mean, var = torch.zeros(shape[1], dtype=xs[0].dtype), torch.ones(shape[1], dtype=xs[0].dtype)
        return F.relu(F.batch_norm(xs[0], mean, var, p["weight"], p["bias"], training=True, momentum=0.2))
    params = {"weight": np.linspace(0.5, 1.5, shape[1]), "bias": np.zeros(shape[1])}  # y = 0 only where x is mean
    check_layer(kernels(layer, [shape]), [_off_kinks(shape, 0)], reference, params=params, state=state,
                rtol=1e-4, atol=1e-4)


def _ctx():
    return KernelContext(np, workspace=np.zeros(1 << 22, np.uint8))


def _parts_and_fused(kernels, fused, part, shapes, xs, params, gy, input_grads=True):
    """[output, input gradients, parameter gradients, aux, state] of `part` then ReLU, and the
    same of `fused`, each run by its kernel in `kernels` in float32."""
    results = []
    for layers in ((part, ReLU()), (fused,)):
        first = kernels(layers[0], shapes)
        state = make_state(layers[0], shapes)
        aux = {name: np.empty(spec.shape, np.float32) for name, spec in layers[0].aux_specs(shapes).items()}
        y = np.empty(shapes[0], np.float32)
        first.forward(_ctx(), xs, params, state, y, aux)
        gparams = {name: np.full(v.shape, np.nan, np.float32) for name, v in params.items()}
        gxs = [np.full(shapes[0], np.nan, np.float32) if input_grads else None for _ in xs]
        if len(layers) == 2:
            z, g = np.empty_like(y), np.empty_like(y)
            relu = kernels(layers[1], [shapes[0]])
            relu.forward(_ctx(), [y], {}, {}, z, {})
            relu.backward(_ctx(), gy, Saved((None,), z), {}, {}, [g], {})
            first.backward(_ctx(), g, Saved(tuple(xs), None), params, aux, gxs, gparams)
        else:
            z = y  # handed to the backward only where the layer saves it
            saved = Saved(tuple(x if i in fused.saves.inputs else None for i, x in enumerate(xs)),
                          z if fused.saves.output else None)
            first.backward(_ctx(), gy, saved, params, aux, gxs, gparams)
        results.append([z, *(g for g in gxs if g is not None), *gparams.values(), *aux.values(), *state.values()])
    return results


def _assert_same_bits(a, b):
    assert np.array_equal(a, b, equal_nan=True) and np.array_equal(np.signbit(a), np.signbit(b))


@KERNELS
@pytest.mark.parametrize("input_grads", [True, False])
@pytest.mark.parametrize("shape", [(8, 16, 9, 9), (5, 3)])
def test_batch_norm_relu_gives_the_bits_of_batch_norm_then_relu(shape, input_grads, kernels):
    rng = np.random.default_rng(3)
    x, gy = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
    x[0, 0] = np.nan  # propagates as it would unfused (check mode relies on NaN)
    params = make_params(BatchNorm(), [shape], rng)
    unfused, fused = _parts_and_fused(kernels, BatchNormReLU(), BatchNorm(), [shape], [x], params, gy, input_grads)
    assert len(unfused) == len(fused) == 1 + input_grads + 2 + 2 + 2
    for a, b in zip(unfused, fused):
        _assert_same_bits(a, b)


def test_the_fused_layer_saves_only_its_input_and_keeps_batch_norms_options():
    layer = BatchNormReLU(momentum=0.3, eps=1e-3, affine=True)
    assert layer.first == BatchNorm(momentum=0.3, eps=1e-3, affine=True)
    assert layer.saves.inputs == (0,) and not layer.saves.output  # x: BatchNorm's, and the mask from it
    shape = (8, 16, 10, 10)
    assert layer.param_specs([shape]) == BatchNorm().param_specs([shape])
    assert layer.aux_specs([shape]) == BatchNorm().aux_specs([shape])
    # the layers' own code computes the output again in scratch (and a scale per channel), the masked
    # gradient then over it; the CPU's compiled kernels need none
    assert 8 * 16 * 10 * 10 * 4 < layer.workspace_bytes([shape], BACKWARD) <= 8 * 16 * 10 * 10 * 4 + 256
    assert layer.workspace_bytes([shape], FORWARD) == 0
    assert CPU_KERNELS.workspace_bytes(layer, [shape], BACKWARD) == 0
    parts = [BatchNorm().cost([shape], phase).bytes + ReLU().cost([shape], phase).bytes for phase in (FORWARD, BACKWARD)]
    assert [layer.cost([shape], phase).bytes for phase in (FORWARD, BACKWARD)] < parts


# ---- Add+ReLU ------------------------------------------------------------------------------
@KERNELS
def test_add_relu_matches_torch_and_finite_differences(kernels):
    shape = (4, 3, 5, 6)
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(shape), rng.standard_normal(shape)]
    xs[1] += np.sign(xs[0] + xs[1]) * 0.3  # sums away from 0, ReLU's kink
    check_layer(kernels(AddReLU(), [shape, shape]), xs, lambda t, p: F.relu(t[0] + t[1]))


def _add_relu_cases(shape, inputs, rng):
    """Inputs, gy and a saved-output stand-in with NaN, infinities and both zeros in the sums."""
    xs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(inputs)]
    flat = [x.reshape(-1) for x in xs]
    flat[0][:6] = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-30]
    flat[1][:6] = [1.0, 1.0, 1.0, -0.0, -0.0, -1e-30]
    gy = rng.standard_normal(shape, dtype=np.float32)
    gy.reshape(-1)[6:9] = [np.nan, np.inf, -5.0]
    return xs, gy


def _unfused_add_relu(kernels, xs, gy, wanted):
    """(y, input gradients) of Add then ReLU, each by its kernel of `kernels`, in float32."""
    shapes = [x.shape for x in xs]
    add, relu = kernels(Add(), shapes), kernels(ReLU(), shapes[:1])
    z, y, g = (np.empty_like(gy) for _ in range(3))
    add.forward(_ctx(), xs, {}, {}, z, {})
    relu.forward(_ctx(), [z], {}, {}, y, {})
    relu.backward(_ctx(), gy, Saved((None,), y), {}, {}, [g], {})
    gxs = [np.full_like(gy, np.nan) if w else None for w in wanted]
    add.backward(_ctx(), g, Saved((None,) * len(xs), None), {}, {}, gxs, {})
    return y, [gx for gx in gxs if gx is not None]


def _composed(layer, shapes):
    """AddThenReLU from the CPU's compiled Add and ReLU: the composition the CUDA backend runs."""
    if isinstance(layer, AddReLU):
        return AddThenReLU(layer, CPU_KERNELS.kernel_for(Add(), shapes), CPU_KERNELS.kernel_for(ReLU(), shapes[:1]))
    return CPU_KERNELS.kernel_for(layer, shapes)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # NaN and inf on purpose
@pytest.mark.parametrize("kernels", [lambda layer, shapes: layer, CPU_KERNELS.kernel_for, _composed],
                         ids=["numpy", "compiled", "composed"])
@pytest.mark.parametrize("inputs", [2, 3])
@pytest.mark.parametrize("over_gy", [None, 0, 1, "all"], ids=["apart", "first-over-gy", "second-over-gy", "all-gy"])
@pytest.mark.parametrize("shape", [(8, 16, 15, 15), (5, 3)])  # the first over MASK_SLICE values
def test_add_relu_gives_the_bits_of_add_then_relu(shape, over_gy, inputs, kernels):
    """Forward and backward of the fused layer against the two layers': the input gradients in
    arrays of their own, or one of them gy's own array (the plan let it take over gy's buffer),
    which the kernel then writes over, or all of them gy's (a residual chain's plan)."""
    xs, gy = _add_relu_cases(shape, inputs, np.random.default_rng(4))
    y, expected = _unfused_add_relu(kernels, xs, gy, [True] * inputs)
    fused = kernels(AddReLU(), [x.shape for x in xs])
    ours = np.empty_like(y)
    fused.forward(_ctx(), xs, {}, {}, ours, {})
    _assert_same_bits(ours, y)
    given = gy.copy()
    gxs = [given if over_gy in (i, "all") else np.full_like(gy, np.nan) for i in range(inputs)]
    fused.backward(_ctx(), given, Saved((None,) * inputs, ours), {}, {}, gxs, {})
    for gx, want in zip(gxs, expected):
        _assert_same_bits(gx, want)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("kernels", [lambda layer, shapes: layer, CPU_KERNELS.kernel_for, _composed],
                         ids=["numpy", "compiled", "composed"])
def test_add_relu_writes_only_the_gradients_asked_for(kernels):
    shape = (6, 5)
    xs, gy = _add_relu_cases(shape, 2, np.random.default_rng(5))
    y, expected = _unfused_add_relu(kernels, xs, gy, [False, True])
    fused, given = kernels(AddReLU(), [shape, shape]), gy.copy()
    gx = np.full_like(gy, np.nan)
    fused.backward(_ctx(), given, Saved((None, None), y), {}, {}, [None, gx], {})
    _assert_same_bits(gx, expected[0])
    _assert_same_bits(given, gy)  # gy, not one of the gradients, is left as it was
    fused.backward(_ctx(), given, Saved((None, None), y), {}, {}, [None, None], {})
    _assert_same_bits(given, gy)


def test_add_relu_saves_its_output_and_needs_no_workspace_compiled():
    layer, shape = AddReLU(), (8, 16, 16, 16)
    assert layer.saves.output and layer.saves.inputs == ()
    assert layer.gradient_in_place and not layer.passes_gradient
    assert layer.recompute_cost == Add.recompute_cost  # a join: its output is a checkpoint
    assert layer.infer_shape([shape, shape]) == shape and layer.param_specs([shape, shape]) == {}
    # the layer's own code carves a slice's mask from its workspace when it writes over gy; the
    # CPU's compiled kernel needs none
    assert layer.workspace_bytes([shape, shape], BACKWARD) == 4 * MASK_SLICE < 8 * 16 * 16 * 16 * 4
    assert layer.workspace_bytes([(5, 3)] * 2, BACKWARD) == 4 * 15
    assert layer.workspace_bytes([shape, shape], FORWARD) == 0
    assert CPU_KERNELS.workspace_bytes(layer, [shape, shape], BACKWARD) == 0
    parts = [Add().cost([shape, shape], phase).bytes + ReLU().cost([shape], phase).bytes
             for phase in (FORWARD, BACKWARD)]
    assert [layer.cost([shape, shape], phase).bytes for phase in (FORWARD, BACKWARD)] < parts
