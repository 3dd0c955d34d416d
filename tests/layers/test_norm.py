import numpy as np
import pytest
import torch
import torch.nn.functional as F

from snrt.errors import ShapeError
from snrt.layers.base import BACKWARD, FORWARD
from snrt.backends.cpu_kernels import CPU_KERNELS, CompiledBatchNorm
from snrt.backends.cpu_norm import CompiledGroupNorm, CompiledLayerNorm
from snrt.layers.norm import LRN, BatchNorm, GroupNorm, LayerNorm
from tests.layers.harness import check_layer, make_params, make_state, run_backward, run_forward


def _running_stats(channels, seed=5):
    rng = np.random.default_rng(seed)
    return {"running_mean": rng.standard_normal(channels), "running_var": rng.uniform(0.5, 2.0, channels)}


def _torch_batch_norm(layer, state, training):
    def reference(xs, p):
        mean = torch.tensor(state["running_mean"], dtype=xs[0].dtype)
        var = torch.tensor(state["running_var"], dtype=xs[0].dtype)
        return F.batch_norm(xs[0], mean, var, p.get("weight"), p.get("bias"), training=training,
                            momentum=layer.momentum, eps=layer.eps)
    return reference


# the layer's own NumPy code, and the CPU backend's compiled kernel for it
KERNELS = pytest.mark.parametrize("kernel", [lambda layer: layer, CompiledBatchNorm], ids=["numpy", "compiled"])


@KERNELS
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 4), (1, 2, 3, 3)])
def test_batch_norm_training(shape, kernel):
    layer = kernel(BatchNorm(momentum=0.2, eps=1e-3))
    x = np.random.default_rng(0).standard_normal(shape) * 2 + 1.5
    state = _running_stats(shape[1])
    check_layer(layer, [x], _torch_batch_norm(layer, state, True), state=state, rtol=1e-4, atol=1e-4)


@KERNELS
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (6, 4)])
def test_batch_norm_without_affine_part(shape, training, kernel):
    layer = kernel(BatchNorm(affine=False, momentum=0.2))
    assert layer.param_specs([shape]) == {}
    x = np.random.default_rng(7).standard_normal(shape) * 2 - 1
    state = _running_stats(shape[1])
    check_layer(layer, [x], _torch_batch_norm(layer, state, training), state=state, training=training,
                rtol=1e-4, atol=1e-4)


@KERNELS
@pytest.mark.parametrize("shape", [(3, 3, 4, 5), (5, 4), (1, 2, 1, 1)])
def test_batch_norm_eval(shape, kernel):
    layer = kernel(BatchNorm())
    x = np.random.default_rng(1).standard_normal(shape)
    state = _running_stats(shape[1])
    check_layer(layer, [x], _torch_batch_norm(layer, state, False), state=state, training=False)


@KERNELS
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (7, 5)])
def test_batch_norm_running_statistics_match_torch(shape, kernel):
    layer = kernel(BatchNorm(momentum=0.3))
    rng = np.random.default_rng(2)
    x = (rng.standard_normal(shape) * 3 - 2).astype(np.float32)
    params = make_params(layer, [shape], rng)
    state = {k: v.astype(np.float32) for k, v in _running_stats(shape[1]).items()}
    t_mean, t_var = (torch.tensor(state[k]) for k in ("running_mean", "running_var"))
    expected = F.batch_norm(torch.tensor(x), t_mean, t_var, torch.tensor(params["weight"]),
                            torch.tensor(params["bias"]), training=True, momentum=0.3, eps=layer.eps)
    y, aux = run_forward(layer, [x], params, state)
    np.testing.assert_allclose(y, expected.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(state["running_mean"], t_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["running_var"], t_var.numpy(), rtol=1e-5, atol=1e-6)
    axes = (0, 2, 3) if len(shape) == 4 else (0,)
    np.testing.assert_allclose(aux["mean"], x.mean(axis=axes, dtype=np.float64), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(aux["inv_std"], 1 / np.sqrt(x.var(axis=axes, dtype=np.float64) + layer.eps),
                               rtol=1e-5)


@KERNELS
def test_batch_norm_recompute_leaves_running_statistics_and_repeats_the_output(kernel):
    layer = kernel(BatchNorm())
    shape = (4, 3, 5, 5)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(shape).astype(np.float32)
    params = make_params(layer, [shape], rng)
    state = make_state(layer, [shape])
    y, aux = run_forward(layer, [x], params, state)
    after_first = {k: v.copy() for k, v in state.items()}
    assert not np.array_equal(after_first["running_mean"], np.zeros(3))
    y_again, aux_again = run_forward(layer, [x], params, state, recompute=True)
    for name in state:
        np.testing.assert_array_equal(state[name], after_first[name])
    np.testing.assert_array_equal(y_again, y)
    for name in aux:
        np.testing.assert_array_equal(aux_again[name], aux[name])


@KERNELS
def test_batch_norm_eval_forward_leaves_running_statistics(kernel):
    layer = kernel(BatchNorm())
    state = {k: v.astype(np.float32) for k, v in _running_stats(3).items()}
    before = {k: v.copy() for k, v in state.items()}
    x = np.random.default_rng(4).standard_normal((2, 3, 2, 2)).astype(np.float32)
    run_forward(layer, [x], make_params(layer, [x.shape], np.random.default_rng(0)), state, training=False)
    for name in state:
        np.testing.assert_array_equal(state[name], before[name])


@KERNELS
def test_batch_norm_backward_without_input_gradient(kernel):
    layer = kernel(BatchNorm())
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 2, 4, 4))
    params = make_params(layer, [x.shape], rng, np.float64)
    y, aux = run_forward(layer, [x], params, make_state(layer, [x.shape], np.float64))
    gy = rng.standard_normal(y.shape)
    full_gxs, full_gparams = run_backward(layer, [x], y, aux, gy, params)
    gparams = {name: np.full(p.shape, np.nan) for name, p in params.items()}
    from snrt.layers.base import KernelContext, Saved
    layer.backward(KernelContext(np), gy, Saved(xs=(x,)), params, aux, [None], gparams)
    for name in gparams:
        np.testing.assert_allclose(gparams[name], full_gparams[name], rtol=1e-12)


@KERNELS
def test_batch_norm_training_needs_two_values_per_channel(kernel):
    layer = kernel(BatchNorm())
    x = np.ones((1, 3), dtype=np.float32)
    params = make_params(layer, [x.shape], np.random.default_rng(0))
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        run_forward(layer, [x], params, make_state(layer, [x.shape]))
    run_forward(layer, [x], params, make_state(layer, [x.shape]), training=False)  # eval is fine


def test_batch_norm_specs():
    layer = BatchNorm()
    shape = [(8, 16, 4, 4)]
    params = layer.param_specs(shape)
    assert params["weight"].shape == (16,) and params["weight"].init == "ones" and not params["weight"].decay
    assert params["bias"].shape == (16,) and params["bias"].init == "zeros" and not params["bias"].decay
    state = layer.state_specs(shape)
    assert state["running_mean"].fill == 0.0 and state["running_var"].fill == 1.0
    assert state["running_var"].shape == (16,)
    aux = layer.aux_specs(shape)
    assert set(aux) == {"mean", "inv_std"} and aux["mean"].shape == (16,) and aux["inv_std"].dtype == "compute"
    assert layer.saves.inputs == (0,) and not layer.saves.output
    assert layer.recompute_cost == "cheap"
    assert layer.infer_shape(shape) == shape[0]
    assert layer.infer_shape([(8, 16)]) == (8, 16) and layer.param_specs([(8, 16)])["weight"].shape == (16,)
    assert layer.workspace_bytes(shape, FORWARD) == 0 and layer.workspace_bytes(shape, BACKWARD) == 0
    assert layer.cost(shape, BACKWARD).flops > layer.cost(shape, FORWARD).flops > 0


@pytest.mark.parametrize("shape", [(8, 16, 4), (8,), (2, 3, 4, 5, 6)])
def test_batch_norm_shape_errors(shape):
    with pytest.raises(ShapeError, match="NCHW or \\(N, C\\)"):
        BatchNorm().infer_shape([shape])


@pytest.mark.parametrize("options, name", [
    (dict(momentum=-0.1), "momentum"),
    (dict(momentum=1.5), "momentum"),
    (dict(momentum="0.1"), "momentum"),
    (dict(momentum=True), "momentum"),
    (dict(eps=0), "eps"),
    (dict(eps=-1e-5), "eps"),
    (dict(eps=None), "eps"),
    (dict(affine="no"), "affine"),
    (dict(zero_init=1), "zero_init"),
    (dict(zero_init=True, affine=False), "zero_init"),
])
def test_batch_norm_option_validation(options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        BatchNorm(**options)


@pytest.mark.parametrize("size, alpha, beta, k, shape", [
    (5, 1e-4, 0.75, 1.0, (2, 7, 3, 4)),  # the defaults
    (5, 0.5, 0.75, 1.0, (2, 7, 3, 4)),  # alpha large enough for the normalisation to matter
    (3, 0.8, 0.5, 2.0, (2, 6, 4, 3)),
    (3, 0.6, 0.75, 1.0, (1, 2, 3, 3)),  # window wider than the channels
    (4, 0.5, 1.0, 1.5, (2, 5, 3, 3)),  # even size: window off-centre
    (1, 0.5, 0.75, 1.0, (2, 3, 2, 2)),
    (5, 0.5, 0.75, 1.0, (2, 8, 5)),  # (N, C, L)
])
def test_lrn(size, alpha, beta, k, shape):
    layer = LRN(size=size, alpha=alpha, beta=beta, k=k)
    x = np.random.default_rng(7).standard_normal(shape) * 1.5
    check_layer(layer, [x], lambda xs, p: F.local_response_norm(xs[0], size, alpha, beta, k))


def test_lrn_facts():
    layer = LRN()
    shape = [(2, 8, 6, 6)]
    assert (layer.size, layer.alpha, layer.beta, layer.k) == (5, 1e-4, 0.75, 1.0)
    assert layer.saves.inputs == (0,) and layer.saves.output
    assert layer.recompute_cost == "cheap"
    assert layer.param_specs(shape) == {} and layer.state_specs(shape) == {} and layer.aux_specs(shape) == {}
    assert layer.infer_shape(shape) == shape[0]
    full = 2 * 8 * 6 * 6 * 4
    assert layer.workspace_bytes(shape, FORWARD) == full
    assert layer.workspace_bytes(shape, BACKWARD) == -(-full // 64) * 64 + full
    assert layer.cost(shape, BACKWARD).flops > layer.cost(shape, FORWARD).flops > 0


def test_lrn_shape_errors():
    with pytest.raises(ShapeError, match="spatial"):
        LRN().infer_shape([(4, 8)])


@pytest.mark.parametrize("options, name", [
    (dict(size=0), "size"),
    (dict(size=2.0), "size"),
    (dict(size=True), "size"),
    (dict(alpha=-1.0), "alpha"),
    (dict(beta=-0.5), "beta"),
    (dict(beta="0.75"), "beta"),
    (dict(k=0), "k"),
])
def test_lrn_option_validation(options, name):
    with pytest.raises(ValueError, match=f"option '{name}'"):
        LRN(**options)


@pytest.mark.parametrize("kernel", [lambda layer: layer, CompiledGroupNorm], ids=["numpy", "compiled"])
@pytest.mark.parametrize("groups, shape", [(1, (2, 6, 3, 4)), (3, (2, 6, 3, 4)), (6, (3, 6, 2, 2)), (2, (4, 6))])
def test_group_norm_matches_pytorch(groups, shape, kernel):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 2 + 1
    params = {"weight": rng.uniform(0.5, 1.5, shape[1]), "bias": rng.standard_normal(shape[1])}
    check_layer(kernel(GroupNorm(groups=groups)), [x], lambda xs, p: torch.nn.functional.group_norm(
        xs[0], groups, p["weight"], p["bias"], 1e-5), params=params)


@pytest.mark.parametrize("kernel", [lambda layer: layer, CompiledLayerNorm], ids=["numpy", "compiled"])
@pytest.mark.parametrize("shape", [(2, 5, 3, 4), (4, 7)])
def test_layer_norm_over_channels_matches_pytorch(shape, kernel):
    from snrt.torch_reference import OPS

    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape) * 3 - 1
    params = {"weight": rng.uniform(0.5, 1.5, shape[1]), "bias": rng.standard_normal(shape[1])}
    layer = LayerNorm()
    check_layer(kernel(layer), [x], lambda xs, p: OPS["LayerNorm"](layer, xs, p, {}, True), params=params)


def test_the_cpu_runs_group_and_layer_norm_compiled():
    assert isinstance(CPU_KERNELS.kernel_for(GroupNorm(groups=4), [(2, 8, 3, 3)]), CompiledGroupNorm)
    assert isinstance(CPU_KERNELS.kernel_for(LayerNorm(), [(2, 8, 3, 3)]), CompiledLayerNorm)


def test_group_and_layer_norm_options_and_shapes():
    from snrt.errors import ShapeError
    from snrt.layers.norm import GroupNorm, LayerNorm

    with pytest.raises(ShapeError, match="do not split into 4 groups"):
        GroupNorm(groups=4).infer_shape([(2, 6, 3, 3)])
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="option 'groups'"):
            GroupNorm(groups=bad)
    with pytest.raises(ValueError, match="option 'eps'"):
        LayerNorm(eps=0)
