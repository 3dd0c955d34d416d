"""Softmax cross-entropy loss with accuracy."""

import math
from dataclasses import dataclass

from snrt.errors import ShapeError
from snrt.layers.base import FLOAT32_BYTES, AuxSpec, Cost, Layer, Saves, numel, scratch_bytes
from snrt.layers.registry import register


@register
@dataclass(frozen=True)
class SoftmaxCrossEntropy(Layer):
    """Inputs: logits (N, K) and integer labels (N,), or, for per-pixel labels (segmentation),
    logits (N, K, *S) and labels (N, *S). Output: per-sample loss (N,).

    Per position p (one for (N, K) logits): l_np = logsumexp_k(x_n[:, p]) - x_n[label_np, p];
    the sample's loss is the mean over its P positions. Aux `probs` = softmax over the class
    axis (x's shape). The training loss is the batch mean times `weight`, summed over the
    network's loss layers (auxiliary heads, deep supervision), so the executor seeds
    gy = weight/N; backward: gx = (probs - onehot(label)) * gy[n] / P. Reads the labels and
    `probs`. The last loss layer of the network gives the accuracy (of every position).
    """

    type_name = "SoftmaxCrossEntropy"
    keeps_fp32 = True  # the loss and the probabilities it saves
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
        if len(logits) == 2:
            if len(labels) > 1 and labels[:1] == logits[:1]:
                raise ShapeError(f"the labels give a class per position ({list(labels[1:])} per sample) but the logits "
                                 f"are {list(logits[1:])} per sample; a per-pixel head keeps the positions, "
                                 f"[classes, {', '.join(map(str, labels[1:]))}] (e.g. a 1x1 Conv2d)")
            if labels != logits[:1]:
                raise ShapeError(f"labels must be one integer per sample, got {list(labels[1:])} per sample")
        elif len(logits) < 2 or labels != logits[:1] + logits[2:]:
            hint = "; add a Flatten" if len(labels) == 1 else ""
            raise ShapeError(f"logits of {list(logits[1:])} per sample need labels of {list(logits[2:])} per sample "
                             f"(one class per position), got {list(labels[1:])}{hint}")
        return logits[:1]

    def aux_specs(self, in_shapes):
        return {"probs": AuxSpec(tuple(in_shapes[0]))}

    @staticmethod
    def _positions(shape):
        return numel(shape[2:])

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        n, p = in_shapes[0][0], self._positions(in_shapes[0])
        if phase != "forward":
            return 0
        return scratch_bytes(n * p * itemsize, n * p * itemsize) if p > 1 else scratch_bytes(n * itemsize)

    def cost(self, in_shapes, phase):
        size = numel(in_shapes[0])
        return Cost(5 * size, 3 * size * FLOAT32_BYTES)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        xp = ctx.xp
        logits, labels = xs
        n, k, p = logits.shape[0], logits.shape[1], self._positions(logits.shape)
        x3, probs = logits.reshape(n, k, p), aux["probs"].reshape(n, k, p)
        index = labels.reshape(n, 1, p)
        peak = ctx.scratch((n, 1, p), logits.dtype)
        loss = y.reshape(n, 1, 1) if p == 1 else ctx.scratch((n, 1, p), logits.dtype)
        xp.max(x3, axis=1, keepdims=True, out=peak)
        xp.subtract(x3, peak, out=probs)
        loss[...] = xp.take_along_axis(probs, index, axis=1)
        xp.negative(loss, out=loss)  # -(x[label] - max)
        xp.exp(probs, out=probs)
        xp.sum(probs, axis=1, keepdims=True, out=peak)  # reuse: sums of exp
        probs /= peak
        xp.log(peak, out=peak)
        loss += peak
        if p > 1:
            xp.mean(loss.reshape(n, p), axis=1, out=y)
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        xp = ctx.xp
        n, k, p = gx.shape[0], gx.shape[1], self._positions(gx.shape)
        g3, index = gx.reshape(n, k, p), saved.xs[1].reshape(n, 1, p)
        g3[...] = aux["probs"].reshape(n, k, p)
        xp.put_along_axis(g3, index, xp.take_along_axis(g3, index, axis=1) - 1, axis=1)
        g3 *= (gy if p == 1 else gy / p)[:, None, None]
