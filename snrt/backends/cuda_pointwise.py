"""Pointwise convolutions as cuBLAS GEMMs: an alternative to cuDNN's engine.

A pointwise convolution (1x1 kernel, no padding, one group; any stride) of x (N, C, H, W) by
w (O, C, 1, 1) reads the strided pixels of x, xs (N, C, Ho, Wo), which are x itself at stride
1; over the P = Ho*Wo output pixels it is a matrix product per sample:

    fprop  y[n]   (O x P) = w   (O x C) @ xs[n] (C x P)   one strided batched GEMM (w's stride 0)
    dgrad  gxs[n] (C x P) = w^T (C x O) @ gy[n] (O x P)   likewise
    wgrad  gw     (O x C) = the sum over n of gy[n] (O x P) @ xs[n]^T (P x C)

With a stride, xs is gathered into the workspace first (snrt_subsample), and the data gradient
is computed there, then spread into gx with zeros between (snrt_unsubsample). The weight
gradient runs `partials` samples at a time as one batched GEMM into as many partial sums in
the workspace (sample n adds into partial n mod `partials`; beta 1 after the first round), then
snrt_sum_slices adds the partials in order; with one partial the GEMMs add into gw itself.
cuBLAS uses no atomics here, so every run computes the same bits, as a deterministic cuDNN
engine does.

cuDNN's deterministic engines ran some of these shapes at a fifth of this GPU's GEMM rate
(results/gpu_check.md), so each operation of a pointwise convolution runs on the GEMMs where
they were timed faster than the cuDNN graph's engine (cudnn_engines.faster).
"""

from dataclasses import dataclass

import numpy as np

from snrt.backends import cudnn_engines
from snrt.backends.cuda_source import best_seconds, grid_for, int64_args, on_own_pool
from snrt.layers.base import FLOAT32_BYTES, scratch_aligned

PARTIALS_CAP_BYTES = 32 << 20  # the weight gradient's partial sums, at most (fewer partials beyond)


@dataclass(frozen=True)
class PointwiseShape:
    """Sizes of a pointwise convolution: batch n, input channels c, outputs o, input h x w,
    stride sh x sw."""

    n: int
    c: int
    o: int
    h: int
    w: int
    sh: int = 1
    sw: int = 1

    @property
    def ho(self):
        return (self.h - 1) // self.sh + 1

    @property
    def wo(self):
        return (self.w - 1) // self.sw + 1

    @property
    def p(self):
        """Output pixels per sample."""
        return self.ho * self.wo

    @property
    def strided(self):
        return (self.sh, self.sw) != (1, 1)

    @property
    def gathered_bytes(self):
        """The strided pixels of x (or their gradient), N x C x P floats; none at stride 1."""
        return self.n * self.c * self.p * FLOAT32_BYTES if self.strided else 0


def pointwise_shape(spec):
    """The PointwiseShape of a ConvSpec (snrt/backends/cudnn_graphs.py) that is a pointwise
    convolution, else None."""
    n, c, h, w = spec.x
    if (spec.w[2:], spec.padding, spec.groups) != ((1, 1), (0, 0), 1):
        return None
    return PointwiseShape(n, c, spec.w[0], h, w, *spec.stride)


def weight_partials(shape, limit):
    """How many partial sums the weight gradient keeps: as many as samples, within
    PARTIALS_CAP_BYTES and what the workspace `limit` (None: none) leaves beside the gathered
    pixels, at least one (then none are kept: the GEMMs add into gw)."""
    cap = PARTIALS_CAP_BYTES if limit is None else min(limit - scratch_aligned(shape.gathered_bytes), PARTIALS_CAP_BYTES)
    return max(1, min(shape.n, cap // (shape.o * shape.c * FLOAT32_BYTES)))


class PointwiseGemm:
    """One operation ("fprop", "dgrad" or "wgrad") of a pointwise convolution by cuBLAS, with
    a built cuDNN graph's interface (CudnnGraph): `workspace_bytes`, `seconds` (timed, or
    None), `chosen` (how) and `execute(pointers, workspace_ptr)` with the same roles. The
    workspace holds the gathered pixels (strided), then the weight gradient's partial sums."""

    name = "cublas"

    def __init__(self, module, op, shape, limit):
        self.module, self.op, self.shape = module, op, shape
        self.partials = weight_partials(shape, limit) if op == "wgrad" else 1
        self.partials_at = scratch_aligned(shape.gathered_bytes)
        partial_bytes = self.partials * shape.o * shape.c * FLOAT32_BYTES if self.partials > 1 else 0
        self.workspace_bytes = self.partials_at + partial_bytes if partial_bytes else shape.gathered_bytes
        self.seconds, self.chosen = None, cudnn_engines.FIRST

    def sizes(self):
        """{role: values} of the operation's tensors."""
        s = self.shape
        x, y = s.n * s.c * s.h * s.w, s.n * s.o * s.p
        return {"fprop": {"x": x, "w": s.o * s.c, "y": y}, "dgrad": {"dy": y, "w": s.o * s.c, "dx": x},
                "wgrad": {"x": x, "dy": y, "dw": s.o * s.c}}[self.op]

    def execute(self, pointers, workspace_ptr):
        """Run on the current stream; `pointers` maps the roles to device addresses (ints)."""
        s = self.shape
        n, c, o, p = s.n, s.c, s.o, s.p
        if self.op == "dgrad":
            target = workspace_ptr if s.strided else pointers["dx"]
            self.module.gemm(True, False, c, p, o, pointers["w"], c, pointers["dy"], p, target, p,
                             batch=n, stride_b=o * p, stride_c=c * p)
            if s.strided:
                self._resample("snrt_unsubsample", workspace_ptr, pointers["dx"], n * c * s.h * s.w)
            return
        x = pointers["x"]
        if s.strided:
            self._resample("snrt_subsample", x, workspace_ptr, n * c * p)
            x = workspace_ptr
        if self.op == "fprop":
            self.module.gemm(False, False, o, p, c, pointers["w"], c, x, p, pointers["y"], p,
                             batch=n, stride_b=c * p, stride_c=o * p)
        else:
            self._weight_gradient(x, pointers["dy"], pointers["dw"], workspace_ptr + self.partials_at)

    def _resample(self, kernel, source, target, total):
        s = self.shape
        self.module.launch(kernel, grid_for(total), (np.uint64(source), np.uint64(target),
                                                     *int64_args(s.n * s.c, s.h, s.w, s.ho, s.wo, s.sh, s.sw)))

    def _weight_gradient(self, x, dy, dw, partials_ptr):
        n, c, o, p = self.shape.n, self.shape.c, self.shape.o, self.shape.p
        k, f = self.partials, FLOAT32_BYTES
        target = partials_ptr if k > 1 else dw
        for first in range(0, n, k):
            self.module.gemm(False, True, o, c, p, dy + first * o * p * f, p, x + first * c * p * f, p, target, c,
                             accumulate=first > 0, batch=min(k, n - first), stride_a=o * p, stride_b=c * p,
                             stride_c=o * c)
        if k > 1:
            self.module.launch("snrt_sum_slices", grid_for(o * c),
                               (np.uint64(partials_ptr), np.uint64(dw), *int64_args(k, o * c)))

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
