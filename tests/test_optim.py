"""The optimizers' compiled CPU steps (snrt/optim.py) against their array-module code, the
code CuPy runs: the same updates to float32 rounding, step after step, for every variant."""

import types

import numpy as np
import pytest

from snrt.optim import SGD, Adam

AS_CUPY = types.SimpleNamespace(**{name: getattr(np, name) for name in dir(np) if not name.startswith("_")})


@pytest.mark.parametrize("optimizer", [
    SGD(momentum=0.0), SGD(momentum=0.9, weight_decay=1e-2), SGD(momentum=0.8, nesterov=True, weight_decay=1e-3),
    Adam(weight_decay=0.0), Adam(beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=1e-2),
    Adam(weight_decay=0.05, decoupled=True)], ids=repr)
def test_the_compiled_step_is_the_array_code_step(optimizer):
    rng = np.random.default_rng(0)
    start = rng.standard_normal((6, 5)).astype(np.float32)
    runs = []
    for xp in (np, AS_CUPY):
        w = start.copy()
        states = [np.zeros_like(w) for _ in optimizer.state_names]
        workspace = np.zeros(w.nbytes, np.uint8)
        for count in range(1, 5):
            g = np.random.default_rng(count).standard_normal(w.shape).astype(np.float32)
            optimizer.update(xp, w, g, states, optimizer.weight_decay, 0.05, count, workspace)
        runs.append((w, states))
    (w, states), (w_ref, states_ref) = runs
    np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-7)
    for state, ref in zip(states, states_ref):
        np.testing.assert_allclose(state, ref, rtol=1e-5, atol=1e-7)
    assert not np.array_equal(w, start)


@pytest.mark.parametrize("optimizer", [SGD(momentum=0.9, nesterov=True, weight_decay=1e-2),
                                       Adam(weight_decay=1e-2)], ids=repr)
def test_the_array_code_updates_in_pieces_of_its_workspace_with_the_same_bits(optimizer):
    """A workspace smaller than the parameter (the plan's, at most UPDATE_PIECE_BYTES) gives
    the update of a whole-size workspace bit for bit, the last piece shorter than the rest."""
    rng = np.random.default_rng(1)
    start = rng.standard_normal((7, 9)).astype(np.float32)
    runs = []
    for workspace_floats in (start.size, 5):
        w = start.copy()
        states = [np.zeros_like(w) for _ in optimizer.state_names]
        workspace = np.zeros(workspace_floats * 4, np.uint8)
        for count in range(1, 4):
            g = np.random.default_rng(count).standard_normal(w.shape).astype(np.float32)
            optimizer.update(AS_CUPY, w, g, states, optimizer.weight_decay, 0.05, count, workspace)
        runs.append([w, *states])
    for whole, pieces in zip(*runs):
        np.testing.assert_array_equal(pieces, whole)


def test_the_array_code_without_a_workspace_says_why():
    w, g = np.ones(4, np.float32), np.ones(4, np.float32)
    with pytest.raises(ValueError, match="workspace"):
        SGD(momentum=0.0).update(AS_CUPY, w, g, [], 0.0, 0.1, 1, None)
    SGD(momentum=0.0).update(np, w, g, [], 0.0, 0.1, 1, None)  # the compiled step needs none
    np.testing.assert_array_equal(w, np.full(4, 0.9, np.float32))
