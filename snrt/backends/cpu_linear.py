"""Linear on the CPU: the forward as W x^T where that is the faster product.

The layer computes y = x W^T with NumPy's matmul(x, W.T). For a few samples and many output
features (the classifiers of AlexNet and VGG, 8 samples of 9216 features into 4096) OpenBLAS
runs that product at about half the speed it runs matmul(W, x.T), the same sums with the
weight untransposed (one thread: 35 against 24 ms, PyTorch's F.linear 25; 2048 -> 1000 at 8
samples 1.6 against 0.8). So where the outputs are at least as many as the samples, the kernel
computes y^T = W x^T into (out, N) scratch from its workspace and copies it transposed into y
(32 and 128 samples: 9216 -> 4096 55 -> 39 and 123 -> 108 ms; with fewer outputs than samples,
a CIFAR network's 10 classes, the layer's product is as fast or faster). The bias, the
backward and any other dtype or layout are the layer's.
"""

import numpy as np

from snrt.backends.cpu_common import LayerLike
from snrt.layers.base import FORWARD, FLOAT32_BYTES


class TransposedLinear(LayerLike):
    """Linear whose forward computes W x^T where `transposed` says so (module docstring)."""

    name = "blas"

    def transposed(self, in_shapes):
        """Whether the forward at `in_shapes` computes W x^T: at least as many outputs as samples."""
        return self.layer.out_features >= in_shapes[0][0]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if phase == FORWARD and self.transposed(in_shapes):
            return self.layer.out_features * in_shapes[0][0] * itemsize
        return self.layer.workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, weight = xs[0].reshape(xs[0].shape[0], -1), params["weight"]
        if not (self.transposed([x.shape]) and x.dtype == weight.dtype == y.dtype):
            return self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)
        product = ctx.scratch((weight.shape[0], x.shape[0]), x.dtype)
        np.matmul(weight, x.T, out=product)
        y[...] = product.T
        if self.layer.bias:
            y += params["bias"]
        ctx.release_scratch()
