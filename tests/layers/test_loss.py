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
