import numpy as np
import pytest
import torch

from snrt.errors import ShapeError
from snrt.layers.loss import SoftmaxCrossEntropy
from tests.layers.harness import check_layer, run_forward


def logits_and_labels(n=5, k=7, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, k)) * 3, rng.integers(0, k, size=n).astype(np.int64)


def test_softmax_cross_entropy():
    x, labels = logits_and_labels()
    check_layer(
        SoftmaxCrossEntropy(), [x, labels],
        lambda t, p: torch.nn.functional.cross_entropy(t[0], t[1], reduction="none"),
    )


def test_loss_is_stable_for_huge_logits():
    x = np.array([[1e4, 0.0, -1e4]], dtype=np.float32)
    y, aux = run_forward(SoftmaxCrossEntropy(), [x, np.array([1])], {})
    assert y[0] == pytest.approx(1e4)
    np.testing.assert_allclose(aux["probs"], [[1.0, 0.0, 0.0]])


def test_loss_shapes():
    with pytest.raises(ShapeError, match="Flatten"):
        SoftmaxCrossEntropy().infer_shape([(2, 10, 1, 1), (2,)])
    with pytest.raises(ShapeError, match="one integer per sample"):
        SoftmaxCrossEntropy().infer_shape([(2, 10), (3,)])


@pytest.mark.parametrize("spatial", [(4, 5), (6,), (1, 1)])
def test_per_pixel_softmax_cross_entropy_is_the_mean_over_positions(spatial):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 4, *spatial)) * 2
    labels = rng.integers(0, 4, size=(3, *spatial)).astype(np.int64)
    dims = tuple(range(1, 1 + len(spatial)))
    check_layer(
        SoftmaxCrossEntropy(), [x, labels],
        lambda t, p: torch.nn.functional.cross_entropy(t[0], t[1], reduction="none").mean(dim=dims),
    )


def test_per_pixel_loss_shapes():
    layer = SoftmaxCrossEntropy()
    assert layer.infer_shape([(2, 3, 8, 8), (2, 8, 8)]) == (2,)
    with pytest.raises(ShapeError, match="need labels of \\[8, 8\\] per sample"):
        layer.infer_shape([(2, 3, 8, 8), (2, 8, 4)])


@pytest.mark.parametrize("weight", [0, -1, float("inf"), "1", True])
def test_loss_weight_must_be_a_positive_number(weight):
    with pytest.raises(ValueError, match="option 'weight'"):
        SoftmaxCrossEntropy(weight=weight)
