"""One harness that checks every layer the same way.

`check_layer(layer, xs, reference=...)` runs, in order:

1. shape inference: `infer_shape` equals the shape forward must fill, and aux/param specs
   are well formed;
2. forward in float32 against an independent reference (a function of torch tensors: inputs
   and parameters by name, returning the output tensor);
3. backward in float64 against central finite differences of L = sum(y * gy), along random
   directions for every differentiable input and every parameter;
4. backward in float32 against the reference's autograd gradients.

Kernels run with exactly the workspace they declare, output and gradient buffers are
pre-filled with NaN (a kernel must overwrite them), and backward only gets the inputs and
output that `saves` names (the rest are None), so an undeclared read fails loudly.
"""

import numpy as np

from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved

try:
    import torch
except ImportError:  # torch is a test dependency; reference checks need it
    torch = None


def make_params(layer, in_shapes, rng, dtype=np.float32):
    """Random parameters of the layer's specs (not the initialiser: any values will do)."""
    return {
        name: rng.uniform(-1, 1, size=spec.shape).astype(dtype)
        for name, spec in layer.param_specs(in_shapes).items()
    }


def make_state(layer, in_shapes, dtype=np.float32):
    """Persistent state filled as the specs say."""
    return {
        name: np.full(spec.shape, spec.fill, dtype=dtype)
        for name, spec in layer.state_specs(in_shapes).items()
    }


def _workspace(layer, in_shapes, phase, itemsize):
    nbytes = layer.workspace_bytes(in_shapes, phase, itemsize=itemsize)
    return np.zeros(nbytes, dtype=np.uint8) if nbytes else None


def _compute_dtype(xs):
    return next(x.dtype for x in xs if x.dtype.kind == "f")


def run_forward(layer, xs, params, state=None, training=True, recompute=False, seed=0, iteration=0):
    """Run forward into fresh NaN-filled buffers; return (y, aux)."""
    in_shapes = [x.shape for x in xs]
    dtype = _compute_dtype(xs)
    out_dtype = layer.output_dtype([x.dtype.name for x in xs])
    y = np.full(layer.infer_shape(in_shapes), np.nan, dtype=out_dtype)
    aux = {
        name: np.full(spec.shape, np.nan if spec.dtype == "compute" else 0,
                      dtype=dtype if spec.dtype == "compute" else spec.dtype)
        for name, spec in layer.aux_specs(in_shapes).items()
    }
    ctx = KernelContext(np, training=training, seed=seed, iteration=iteration, node_index=3,
                        workspace=_workspace(layer, in_shapes, FORWARD, dtype.itemsize))
    layer.forward(ctx, xs, params, state if state is not None else {}, y, aux, recompute=recompute)
    return y, aux


def differentiable(layer, n_inputs):
    """Indices of the inputs that receive a gradient."""
    if layer.differentiable_inputs is None:
        return tuple(range(n_inputs))
    return tuple(layer.differentiable_inputs)


def run_backward(layer, xs, y, aux, gy, params, training=True, seed=0, iteration=0):
    """Run backward with only the saved tensors; return (gxs, gparams)."""
    in_shapes = [x.shape for x in xs]
    dtype = _compute_dtype(xs)
    saved = Saved(
        xs=tuple(x if i in layer.saves.inputs else None for i, x in enumerate(xs)),
        y=y if layer.saves.output else None,
    )
    grads_for = differentiable(layer, len(xs))
    gxs = [np.full(x.shape, np.nan, dtype=x.dtype) if i in grads_for else None for i, x in enumerate(xs)]
    gparams = {name: np.full(p.shape, np.nan, dtype=p.dtype) for name, p in params.items()}
    ctx = KernelContext(np, training=training, seed=seed, iteration=iteration, node_index=3,
                        workspace=_workspace(layer, in_shapes, BACKWARD, dtype.itemsize))
    layer.backward(ctx, gy, saved, params, aux, gxs, gparams)
    return gxs, gparams


def _as64(arrays):
    return [x.astype(np.float64) if x.dtype.kind == "f" else x for x in arrays]


def check_finite_differences(layer, xs, params, state=None, directions=3, eps=1e-6, rtol=1e-5,
                             training=True, seed=0):
    """Backward in float64 against central differences of sum(y * gy) along random directions."""
    rng = np.random.default_rng(1234)
    xs = _as64(xs)
    params = {k: v.astype(np.float64) for k, v in params.items()}
    state64 = {k: v.astype(np.float64) for k, v in (state or {}).items()}

    def loss(xs_, params_):
        y, _ = run_forward(layer, xs_, params_, {k: v.copy() for k, v in state64.items()},
                           training=training, seed=seed)
        return float((y * gy).sum())

    y, aux = run_forward(layer, xs, params, {k: v.copy() for k, v in state64.items()},
                         training=training, seed=seed)
    gy = rng.standard_normal(y.shape)
    gxs, gparams = run_backward(layer, xs, y, aux, gy, params, training=training, seed=seed)

    targets = [("input", i, xs, gxs[i]) for i in differentiable(layer, len(xs))]
    targets += [("param", name, params, gparams[name]) for name in params]
    for kind, key, holder, analytic in targets:
        assert not np.isnan(analytic).any(), f"{kind} {key}: backward left NaN in the gradient"
        for _ in range(directions):
            v = rng.standard_normal(analytic.shape)
            plus = {"input": list(xs), "param": dict(params)}[kind]
            minus = {"input": list(xs), "param": dict(params)}[kind]
            plus[key] = holder[key] + eps * v
            minus[key] = holder[key] - eps * v
            if kind == "input":
                numeric = (loss(plus, params) - loss(minus, params)) / (2 * eps)
            else:
                numeric = (loss(xs, plus) - loss(xs, minus)) / (2 * eps)
            predicted = float((analytic * v).sum())
            scale = max(abs(numeric), abs(predicted), 1e-3)
            assert abs(numeric - predicted) <= rtol * scale + 1e-7, (
                f"{layer!r}: {kind} {key}: analytic {predicted!r} vs finite difference {numeric!r}"
            )


def check_against_reference(layer, xs, params, reference, state=None, training=True,
                            rtol=1e-4, atol=1e-5, seed=0):
    """Forward and backward in float32 against `reference(torch_xs, torch_params) -> tensor`."""
    if torch is None:
        raise RuntimeError("the reference checks need torch (pip install -e '.[test]')")
    xs = [x.astype(np.float32) if x.dtype.kind == "f" else x for x in xs]
    params = {k: v.astype(np.float32) for k, v in params.items()}
    y, aux = run_forward(layer, xs, params, state, training=training, seed=seed)
    grads_for = differentiable(layer, len(xs))
    t_xs = [torch.tensor(x, requires_grad=(i in grads_for)) for i, x in enumerate(xs)]
    t_params = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    t_y = reference(t_xs, t_params)
    np.testing.assert_allclose(y, t_y.detach().numpy(), rtol=rtol, atol=atol,
                               err_msg=f"{layer!r}: forward differs from the reference")
    gy = np.random.default_rng(7).standard_normal(y.shape).astype(np.float32)
    t_y.backward(torch.tensor(gy))
    gxs, gparams = run_backward(layer, xs, y, aux, gy, params, training=training, seed=seed)
    for i in grads_for:
        np.testing.assert_allclose(gxs[i], t_xs[i].grad.numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"{layer!r}: gradient of input {i} differs")
    for name in params:
        np.testing.assert_allclose(gparams[name], t_params[name].grad.numpy(), rtol=rtol, atol=atol,
                                   err_msg=f"{layer!r}: gradient of {name} differs")
    return y, aux


def check_layer(layer, xs, reference=None, params=None, state=None, training=True, rtol=1e-4,
                atol=1e-5, fd_rtol=1e-5, seed=0):
    """Shape inference, forward/backward against `reference`, backward against finite differences.

    `xs` are float64 (or integer) arrays with values chosen away from kinks; `params` default
    to random values of the layer's specs.
    """
    in_shapes = [x.shape for x in xs]
    if params is None:
        params = make_params(layer, in_shapes, np.random.default_rng(0), np.float64)
    for name, spec in layer.param_specs(in_shapes).items():
        assert params[name].shape == tuple(spec.shape), f"param {name} shape"
    y, _ = run_forward(layer, xs, params, None if state is None else {k: v.copy() for k, v in state.items()},
                       training=training, seed=seed)
    assert y.shape == tuple(layer.infer_shape(in_shapes))
    assert not np.isnan(y).any(), f"{layer!r}: forward left NaN in the output"
    check_finite_differences(layer, xs, params, state=state, rtol=fd_rtol, training=training, seed=seed)
    if reference is not None:
        check_against_reference(layer, xs, params, reference,
                                state=None if state is None else {k: v.astype(np.float32) for k, v in state.items()},
                                training=training, rtol=rtol, atol=atol, seed=seed)
