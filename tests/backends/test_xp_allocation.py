"""The layers that run their shared `xp` code on CUDA allocate nothing, checked on the CPU.

On the GPU the CUDA backend refuses every allocation while a kernel runs (its allocation
guard): a layer without a CUDA kernel of its own (snrt/backends/cuda_kernels.py REGISTRY) must
write only into its buffers and the planned workspace. Here each such layer's forward and
backward run on NumPy arrays of a subclass that records every array created afresh (an
operator or a function without `out=`, or a copy), through an `xp` that records every array or
scalar its functions return other than a view or their `out`: on CuPy each of those would be
an allocation from the memory pool.
"""

import numpy as np
import pytest

from snrt.backends.cuda_kernels import REGISTRY, uses_xp_code
from snrt.layers import LAYERS
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.optim import SGD, Adam
from tests.backends.test_cuda_device import LAYERS as CUDA_CASES, _inputs

CASES = [(layer, shapes) for layer, shapes in CUDA_CASES if uses_xp_code(layer)]


OWNED = {}  # id -> array: the memory the kernels are given (buffers, workspace)


def _root(array):
    while isinstance(array, np.ndarray) and array.base is not None:
        array = array.base
    return array


def _fresh(array):
    """True for a scalar, or an array whose memory is none of the buffers the kernel was given."""
    return isinstance(array, np.generic) or (isinstance(array, np.ndarray) and id(_root(array)) not in OWNED)


class Traced(np.ndarray):
    """An ndarray that records every array of its kind created in memory it was not given."""

    fresh = []

    def __array_finalize__(self, obj):
        if _fresh(self):
            Traced.fresh.append(("new array", self.shape))


BATCHED_PRODUCTS = ("matmul", "dot", "tensordot", "inner")


def _allocates_on_cupy_only(name, args):
    """What CuPy allocates where NumPy does not: a product with an operand of more than two
    dimensions runs cuBLAS's batched GEMM on a device array of matrix pointers."""
    return name in BATCHED_PRODUCTS and any(np.ndim(a) > 2 for a in args[:2])


class TracingXp:
    """numpy, recording what its functions return in memory the kernel was not given, and
    the calls that allocate on CuPy although they would not on NumPy."""

    def __getattr__(self, name):
        value = getattr(np, name)
        if not callable(value) or isinstance(value, type):
            return value

        def call(*args, **kwargs):
            if _allocates_on_cupy_only(name, args):
                Traced.fresh.append((f"xp.{name} (batched on CuPy)", tuple(np.shape(a) for a in args[:2])))
            result = value(*args, **kwargs)
            for r in result if isinstance(result, tuple) else (result,):
                if _fresh(r):
                    Traced.fresh.append((f"xp.{name}", np.shape(r)))
            return result
        return call


def _traced(array):
    if array is None:
        return None
    owned = np.array(array, copy=True)
    OWNED[id(owned)] = owned
    return owned.view(Traced)


def test_the_tracer_sees_operators_functions_without_out_and_scalars():
    a, xp = _traced(np.ones((2, 3), np.float32)), TracingXp()
    Traced.fresh = []
    b = a[:, :2]  # a view
    xp.multiply(a, 2, out=a)
    xp.sum(a, axis=1, out=b[:, 0])
    assert Traced.fresh == []
    _ = a * 2
    assert [what for what, _ in Traced.fresh] == ["new array"]
    batch, out = _traced(np.ones((2, 2, 2, 3), np.float32)), _traced(np.zeros((2, 2, 2, 3), np.float32))
    for call in (lambda: xp.einsum("ij,ij->j", a, a), lambda: xp.sum(a), lambda: xp.asarray(np.zeros(3)),
                 lambda: xp.arange(3), lambda: xp.matmul(a[:, :2], batch, out=out)):
        Traced.fresh = []
        call()
        assert Traced.fresh and Traced.fresh[-1][0].startswith("xp.")


def test_the_cases_cover_every_layer_without_a_cuda_kernel():
    covered = {layer.type_name for layer, _ in CASES}
    assert covered == (set(LAYERS) - set(REGISTRY) - {"Input"}) | {"Upsample"}  # nearest


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("layer,in_shapes", CASES, ids=[f"{l.type_name}{i}" for i, (l, _) in enumerate(CASES)])
def test_shared_xp_code_allocates_nothing(layer, in_shapes, training):
    rng = np.random.default_rng(0)
    xs = [_traced(x) for x in _inputs(layer, in_shapes, rng)]
    params = {k: _traced(rng.uniform(0.5, 1.5, s.shape).astype(np.float32))
              for k, s in layer.param_specs(in_shapes).items()}
    state = {k: _traced(np.full(s.shape, s.fill, np.float32)) for k, s in layer.state_specs(in_shapes).items()}
    aux = {k: _traced(np.zeros(s.shape, np.float32 if s.dtype == "compute" else s.dtype))
           for k, s in layer.aux_specs(in_shapes).items()}
    y = _traced(np.zeros(layer.infer_shape(in_shapes), layer.output_dtype([x.dtype.name for x in xs])))
    wanted = range(len(xs)) if layer.differentiable_inputs is None else layer.differentiable_inputs
    gxs = [_traced(np.zeros(x.shape, np.float32)) if i in wanted else None for i, x in enumerate(xs)]
    gparams = {k: _traced(np.zeros_like(v)) for k, v in params.items()}
    gy = _traced(rng.standard_normal(y.shape).astype(np.float32))
    saved = Saved(tuple(x if i in layer.saves.inputs else None for i, x in enumerate(xs)),
                  y if layer.saves.output else None)
    xp = TracingXp()

    def context(phase):
        nbytes = layer.workspace_bytes(in_shapes, phase)
        return KernelContext(xp, training=training, seed=1, iteration=2, node_index=3,
                             workspace=_traced(np.zeros(nbytes, np.uint8)) if nbytes else None)

    Traced.fresh = []
    layer.forward(context(FORWARD), xs, params, state, y, aux)
    forward = Traced.fresh
    Traced.fresh = []
    layer.backward(context(BACKWARD), gy, saved, params, aux, gxs, gparams)
    assert (forward, Traced.fresh) == ([], []), "allocations in forward, backward"


@pytest.mark.parametrize("optimizer", [
    SGD(momentum=0.9, nesterov=True, weight_decay=0.1, clip_value=0.5, clip_norm=1.0),
    SGD(momentum=0.0, weight_decay=0.1),
    Adam(weight_decay=0.1, clip_value=0.5, clip_norm=1.0),
    Adam(weight_decay=0.1, decoupled=True),
], ids=["sgd-nesterov", "sgd-plain", "adam", "adamw"])
def test_optimizer_updates_allocate_nothing(optimizer):
    rng = np.random.default_rng(3)
    w, g = (_traced(rng.standard_normal((4, 5)).astype(np.float32)) for _ in range(2))
    states = tuple(_traced(np.zeros((4, 5), np.float32)) for _ in optimizer.state_names)
    workspace = _traced(np.zeros(w.nbytes, np.uint8))
    Traced.fresh = []
    optimizer.update(TracingXp(), w, g, states, 0.1, 0.01, 3, workspace, grad_scale=0.5)
    assert Traced.fresh == []
