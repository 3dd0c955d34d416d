"""Pointwise convolutions as cuBLAS GEMMs: a candidate timed against cuDNN's engine.

A pointwise convolution (1x1 kernel, stride 1, no padding or dilation, one group) of x
(N, C, H, W) by w (O, C, 1, 1) is a matrix product per sample over its P = H*W pixels:

    fprop  y[n]  (O x P) = w   (O x C) @ x[n]  (C x P)    one strided batched GEMM (w's stride 0)
    dgrad  gx[n] (C x P) = w^T (C x O) @ gy[n] (O x P)    likewise
    wgrad  gw    (O x C) = the sum over n of gy[n] (O x P) @ x[n]^T (P x C)

The weight gradient runs `partials` samples at a time as one batched GEMM into as many partial
sums in the workspace (sample n adds into partial n mod `partials`; beta 1 after the first
round), then snrt_sum_slices adds the partials in order. With one partial the GEMMs add into
gw itself and need no workspace. cuBLAS uses no atomics here, so every run computes the same
bits, as a deterministic cuDNN engine does.

cuDNN's deterministic engines ran some of these shapes at a fifth of this GPU's GEMM rate
(results/gpu_check.md), so each operation of a pointwise convolution runs on the GEMMs where
they were timed faster than the cuDNN graph's engine (cudnn_engines.faster).
"""

from dataclasses import dataclass

import numpy as np

from snrt.backends import cudnn_engines
from snrt.backends.cuda_source import best_seconds, grid_for, int64_args, on_own_pool
from snrt.layers.base import FLOAT32_BYTES

PARTIALS_CAP_BYTES = 32 << 20  # the weight gradient's partial sums, at most (fewer partials beyond)


@dataclass(frozen=True)
class PointwiseShape:
    """Sizes of a pointwise convolution: batch n, input channels c, outputs o, pixels p."""

    n: int
    c: int
    o: int
    p: int


def pointwise_shape(spec):
    """The PointwiseShape of a ConvSpec (snrt/backends/cudnn_graphs.py) that is a pointwise
    convolution, else None."""
    n, c, h, w = spec.x
    if (spec.w[2:], spec.padding, spec.stride, spec.dilation, spec.groups) != ((1, 1), (0, 0), (1, 1), (1, 1), 1):
        return None
    return PointwiseShape(n, c, spec.w[0], h * w)


def weight_partials(shape, limit):
    """How many partial sums the weight gradient keeps: as many as samples, within
    PARTIALS_CAP_BYTES and the workspace `limit` (None: none), at least one (then none are
    kept: the GEMMs add into gw)."""
    cap = PARTIALS_CAP_BYTES if limit is None else min(limit, PARTIALS_CAP_BYTES)
    return max(1, min(shape.n, cap // (shape.o * shape.c * FLOAT32_BYTES)))


class PointwiseGemm:
    """One operation ("fprop", "dgrad" or "wgrad") of a pointwise convolution by cuBLAS, with
    a built cuDNN graph's interface (CudnnGraph): `workspace_bytes`, `seconds` (timed, or
    None), `chosen` (how) and `execute(pointers, workspace_ptr)` with the same roles."""

    name = "cublas"

    def __init__(self, module, op, shape, limit):
        self.module, self.op, self.shape = module, op, shape
        self.partials = weight_partials(shape, limit) if op == "wgrad" else 1
        self.workspace_bytes = self.partials * shape.o * shape.c * FLOAT32_BYTES if self.partials > 1 else 0
        self.seconds, self.chosen = None, cudnn_engines.FIRST

    def sizes(self):
        """{role: values} of the operation's tensors."""
        n, c, o, p = self.shape.n, self.shape.c, self.shape.o, self.shape.p
        return {"fprop": {"x": n * c * p, "w": o * c, "y": n * o * p},
                "dgrad": {"dy": n * o * p, "w": o * c, "dx": n * c * p},
                "wgrad": {"x": n * c * p, "dy": n * o * p, "dw": o * c}}[self.op]

    def execute(self, pointers, workspace_ptr):
        """Run on the current stream; `pointers` maps the roles to device addresses (ints)."""
        n, c, o, p = self.shape.n, self.shape.c, self.shape.o, self.shape.p
        gemm = self.module.gemm
        if self.op == "fprop":
            gemm(False, False, o, p, c, pointers["w"], c, pointers["x"], p, pointers["y"], p,
                 batch=n, stride_b=c * p, stride_c=o * p)
        elif self.op == "dgrad":
            gemm(True, False, c, p, o, pointers["w"], c, pointers["dy"], p, pointers["dx"], p,
                 batch=n, stride_b=o * p, stride_c=c * p)
        else:
            self._weight_gradient(pointers["x"], pointers["dy"], pointers["dw"], workspace_ptr)

    def _weight_gradient(self, x, dy, dw, workspace_ptr):
        n, c, o, p = self.shape.n, self.shape.c, self.shape.o, self.shape.p
        k, f = self.partials, FLOAT32_BYTES
        target = workspace_ptr if k > 1 else dw
        for first in range(0, n, k):
            self.module.gemm(False, True, o, c, p, dy + first * o * p * f, p, x + first * c * p * f, p, target, c,
                             accumulate=first > 0, batch=min(k, n - first), stride_a=o * p, stride_b=c * p,
                             stride_c=o * c)
        if k > 1:
            self.module.launch("snrt_sum_slices", grid_for(o * c),
                               (np.uint64(workspace_ptr), np.uint64(dw), *int64_args(k, o * c)))

    def time(self):
        """The best seconds of the operation on temporary device buffers (every value 0.5),
        or None when the device has no memory to spare for them."""
        return on_own_pool(self._time_on)

    def _time_on(self, cupy, stream):
        held = {role: cupy.full(values, 0.5, np.float32) for role, values in self.sizes().items()}
        workspace = cupy.empty(self.workspace_bytes, np.uint8) if self.workspace_bytes else None
        pointers = {role: array.data.ptr for role, array in held.items()}
        return best_seconds(stream, lambda: self.execute(pointers, workspace.data.ptr if workspace is not None else 0),
                            cudnn_engines.ROUNDS)


__all__ = ["PARTIALS_CAP_BYTES", "PointwiseGemm", "PointwiseShape", "pointwise_shape", "weight_partials"]
