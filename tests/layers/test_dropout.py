import numpy as np
import pytest

from snrt.backends.cpu_dropout import CompiledDropout
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.dropout import Dropout, Dropout2d
from snrt.layers.random import MASK32, mix32, seed_hash
from tests.layers.harness import check_layer, run_backward, run_forward


def x_of(shape=(64, 50), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_dropout_gradients_match_finite_differences():
    check_layer(Dropout(p=0.3), [np.random.default_rng(0).standard_normal((4, 3, 5, 5))])


def test_mask_rate_and_scale():
    x = np.ones((200, 500), dtype=np.float32)
    y, _ = run_forward(Dropout(p=0.3), [x], {})
    kept = y != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y[kept], 1 / 0.7, rtol=1e-6)


def test_mask_is_reproducible_and_changes_with_iteration_and_seed():
    layer, x = Dropout(p=0.5), x_of()
    y1, _ = run_forward(layer, [x], {}, iteration=4)
    y2, _ = run_forward(layer, [x], {}, iteration=4, recompute=True)
    np.testing.assert_array_equal(y1, y2)
    y3, _ = run_forward(layer, [x], {}, iteration=5)
    y4, _ = run_forward(layer, [x], {}, iteration=4, seed=1)
    assert (y1 != y3).mean() > 0.3 and (y1 != y4).mean() > 0.3


def test_every_bit_of_the_seed_changes_the_mask():
    """Seeds that differ only above their low 32 bits draw other masks; a seed below 2^32 keeps
    the key it always had (its hash is mix32's, so its runs reproduce)."""
    layer, x = Dropout(p=0.5), x_of()
    masks = [run_forward(layer, [x], {}, iteration=4, seed=seed)[0] != 0 for seed in (5, 5 + 2**32, 5 + 2**40, 5 + 2**64)]
    for i, one in enumerate(masks):
        for other in masks[i + 1:]:
            assert (one != other).mean() > 0.3
    assert all(seed_hash(s) == mix32(s) for s in (0, 1, 12345, MASK32))


def test_backward_uses_the_forward_mask():
    layer, x = Dropout(p=0.5), x_of()
    y, aux = run_forward(layer, [x], {}, iteration=2)
    (gx,), _ = run_backward(layer, [x], y, aux, np.ones_like(x), {}, iteration=2)
    np.testing.assert_array_equal(gx != 0, y != 0)


def test_eval_mode_is_identity():
    x = x_of()
    y, _ = run_forward(Dropout(p=0.5), [x], {}, training=False)
    np.testing.assert_array_equal(y, x)


@pytest.mark.parametrize("p", [-0.1, 1.0, "half"])
def test_rejects_bad_p(p):
    with pytest.raises(ValueError, match="'p'"):
        Dropout(p=p)


def test_dropout2d_drops_whole_feature_maps_at_rate_p_and_backward_reuses_the_mask():
    from snrt.layers.dropout import Dropout2d

    layer = Dropout2d(p=0.3)
    x = np.ones((40, 50, 3, 4), dtype=np.float32)
    y, aux = run_forward(layer, [x], {}, iteration=3)
    maps = y.reshape(40, 50, -1)
    kept = maps[:, :, 0] != 0
    assert np.all((maps != 0) == kept[:, :, None])  # a map is kept or dropped as a whole
    np.testing.assert_allclose(maps[kept], 1 / 0.7, rtol=1e-6)
    assert abs(kept.mean() - 0.7) < 0.03
    (gx,), _ = run_backward(layer, [x], y, aux, np.ones_like(x), {}, iteration=3)
    np.testing.assert_array_equal(gx, y)
    again, _ = run_forward(layer, [x], {}, iteration=3, recompute=True)
    np.testing.assert_array_equal(again, y)
    other, _ = run_forward(layer, [x], {}, iteration=4)
    assert (other != y).any()
    check_layer(Dropout2d(p=0.4), [np.random.default_rng(1).standard_normal((3, 4, 2, 2))])
    eval_y, _ = run_forward(layer, [x_of((2, 3, 4, 4))], {}, training=False)
    np.testing.assert_array_equal(eval_y, x_of((2, 3, 4, 4)))


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # the layer's own 0 * inf
@pytest.mark.parametrize("layer, shape", [(Dropout(p=0.3), (3, 7, 5, 11)), (Dropout(p=0.9), (2, 70000)),
                                          (Dropout2d(p=0.5), (4, 6, 3, 5)), (Dropout2d(p=0.2), (2, 3, 1, 1))],
                         ids=repr)
def test_the_compiled_kernel_gives_the_layers_bits(layer, shape):
    """The CPU backend's Dropout kernel: the layer's mask and products bit for bit, forward,
    recomputed and backward, over keys (seed, iteration, node), on one thread and several
    (2 x 70000 values split), a NaN and an infinity in x staying NaN where dropped (the bits
    compared, so NaN against NaN too)."""
    kernel = CPU_KERNELS.kernel_for(layer, [shape])
    assert isinstance(kernel, CompiledDropout) and kernel.workspace_bytes([shape], FORWARD) == 0
    x = x_of(shape, seed=3)
    x.flat[0], x.flat[1] = np.nan, np.inf
    gy = x_of(shape, seed=4)
    def context(for_layer, **key):
        workspace = np.empty(max(for_layer.workspace_bytes([shape], phase), 1), np.uint8)
        return KernelContext(np, workspace=workspace, **key)

    for seed, iteration, node in ((0, 0, 0), (7, 3, 12), (2**31 - 1, 10**6, 999)):
        key = dict(seed=seed, iteration=iteration, node_index=node)
        for phase, recompute in ((FORWARD, False), (FORWARD, True), (BACKWARD, False)):
            want, got = np.full_like(x, 5.0), np.full_like(x, 7.0)
            for runner, out in ((layer, want), (kernel, got)):
                if phase == FORWARD:
                    runner.forward(context(runner, **key), [x], {}, {}, out, {}, recompute=recompute)
                else:
                    runner.backward(context(runner, **key), gy, Saved((None,), None), {}, {}, [out], {})
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
            assert 0 < (got == 0).sum() < got.size
