"""Softmax cross-entropy loss with accuracy."""

import math
from dataclasses import dataclass

from snrt.errors import ShapeError
from snrt.layers.base import FLOAT32_BYTES, AuxSpec, Cost, Layer, Saves, numel, scratch_bytes
from snrt.layers.registry import register


@register
@dataclass(frozen=True)
class SoftmaxCrossEntropy(Layer):
    """Inputs: logits (N, K) and integer labels (N,). Output: per-sample loss (N,).

    loss_n = logsumexp(x_n) - x_n[label_n]; aux `probs` = softmax(x) (N, K).
    The training loss is the mean times `weight`, summed over the network's loss layers
    (auxiliary heads, deep supervision), so the executor seeds gy = weight/N; backward:
    gx = (probs - onehot(label)) * gy[:, None]. Reads the labels and `probs`. The last loss
    layer of the network gives the accuracy.
    """

    type_name = "SoftmaxCrossEntropy"
    min_inputs = 2
    max_inputs = 2
    saves = Saves(inputs=(1,))
    differentiable_inputs = (0,)
    weight: float = 1.0

    def __post_init__(self):
        ok = isinstance(self.weight, (int, float)) and not isinstance(self.weight, bool)
        if not ok or not math.isfinite(self.weight) or self.weight <= 0:
            raise ValueError(f"option 'weight' must be a finite number > 0, got {self.weight!r}")

    def infer_shape(self, in_shapes):
        logits, labels = (tuple(s) for s in in_shapes)
        if len(logits) != 2:
            raise ShapeError(f"logits must be (N, classes), got {list(logits[1:])} per sample; add a Flatten")
        if labels != logits[:1]:
            raise ShapeError(f"labels must be one integer per sample, got {list(labels[1:])} per sample")
        return logits[:1]

    def aux_specs(self, in_shapes):
        return {"probs": AuxSpec(tuple(in_shapes[0]))}

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        n = in_shapes[0][0]
        return scratch_bytes(n * itemsize) if phase == "forward" else 0

    def cost(self, in_shapes, phase):
        size = numel(in_shapes[0])
        return Cost(5 * size, 3 * size * FLOAT32_BYTES)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp = ctx.xp
        logits, labels = xs
        probs = aux["probs"]
        row_max = ctx.scratch((logits.shape[0],), logits.dtype)
        xp.max(logits, axis=1, out=row_max)
        xp.subtract(logits, row_max[:, None], out=probs)
        rows = xp.arange(logits.shape[0])
        y[...] = -probs[rows, labels]  # -(x[label] - max)
        xp.exp(probs, out=probs)
        xp.sum(probs, axis=1, out=row_max)  # reuse: row sums of exp
        probs /= row_max[:, None]
        xp.log(row_max, out=row_max)
        y += row_max
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        labels = saved.xs[1]
        gx[...] = aux["probs"]
        gx[ctx.xp.arange(gx.shape[0]), labels] -= 1
        gx *= gy[:, None]
