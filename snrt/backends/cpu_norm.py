"""GroupNorm and LayerNorm on the CPU: compiled kernels of two passes over the input.

The layers' NumPy code (snrt/layers/norm.py's _Normalize) makes eight to fourteen passes with
broadcasts; these kernels make two in each direction, one sample (or group) at a time while
its values are in cache:

- LayerNorm over the channels of x (N, C, K): every position's C channels are normalised, so
  the sums run per position over rows of K contiguous values (the inner loops vectorize
  along K): forward the sums of x and x^2, then y; backward the sums of gh = gy * weight and
  gh * xhat with each sample's shares of the parameter gradients, then gx. The samples are
  shared among the kernel threads (from SPLIT_VALUES values), each thread with sums of its
  own; the parameter gradients then add the samples' shares in sample order.
- GroupNorm of x viewed (N * groups, C / groups, K): each group's values are one contiguous
  block, normalised as a whole: its sums in one pass, then y = x * scale + shift per channel;
  backward, per channel, the sums of gy and gy * x, from which gx is a * gy + b * x + d per
  channel, as in the BatchNorm kernel. The blocks are shared among the kernel threads (from
  SPLIT_VALUES values); the parameter gradients then sum the blocks' sums in block order, so
  the bits do not depend on the number of threads.

Sums are float64 (var = E[x^2] - mean^2, as in the BatchNorm kernel), each in a fixed order,
so the same inputs give the same bits in every run and policy. The kernels never run the
layers' code, so they say what workspace they need: float64 sums.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import COMPILED, THREADED, LayerLike, fitting_threads, threads_for
from snrt.backends.cpu_parallel import run_split
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, numel, scratch_bytes

SUM_BYTES = 8  # float64 sums
SPLIT_VALUES = 1 << 18  # tensors of fewer values run on one thread


# ---- LayerNorm: statistics per position, over the channels -----------------------------------
@njit(**THREADED)
def layer_norm_forward(x, weight, bias, eps, mean, inv_std, y, s0, s1, sums):
    """For the samples s0 <= s < s1: y[s, c, k] = (x - mean[s, 0, k]) * inv_std[s, 0, k] *
    weight[c] + bias[c], the statistics over c (written to mean and inv_std (N, 1, K)); sums
    (2, K) float64: this thread's scratch."""
    channels, width = x.shape[1], x.shape[2]
    for s in range(s0, s1):
        sums[:] = 0.0
        for c in range(channels):
            for k in range(width):
                v = np.float64(x[s, c, k])
                sums[0, k] += v
                sums[1, k] += v * v
        for k in range(width):
            mu = sums[0, k] / channels
            mean[s, 0, k] = mu
            inv_std[s, 0, k] = 1.0 / np.sqrt(max(sums[1, k] / channels - mu * mu, 0.0) + eps)
        for c in range(channels):
            scale, shift = weight[c], bias[c]
            for k in range(width):
                y[s, c, k] = (x[s, c, k] - mean[s, 0, k]) * (inv_std[s, 0, k] * scale) + shift


@njit(**THREADED)
def layer_norm_backward(x, gy, weight, mean, inv_std, parameter_sums, gx, s0, s1, sums):
    """For the samples s0 <= s < s1, with xhat = (x - mean) inv_std and gh = gy * weight[c]:
    gx = inv_std (gh - mean_c(gh) - xhat mean_c(gh xhat)) (unless gx is empty), and the
    sample's shares of the parameter gradients, parameter_sums[s] = (sum gy xhat, sum gy) per
    channel ((N, 2, C) float64). sums (2, K) float64: this thread's scratch."""
    channels, width = x.shape[1], x.shape[2]
    for s in range(s0, s1):
        sums[:] = 0.0
        for c in range(channels):
            scale = weight[c]
            by_weight = 0.0
            by_bias = 0.0
            for k in range(width):
                xhat = (x[s, c, k] - mean[s, 0, k]) * inv_std[s, 0, k]
                g = np.float64(gy[s, c, k])
                sums[0, k] += g * scale
                sums[1, k] += g * scale * xhat
                by_weight += g * xhat
                by_bias += g
            parameter_sums[s, 0, c] = by_weight
            parameter_sums[s, 1, c] = by_bias
        if gx.size == 0:
            continue
        for c in range(channels):
            scale = weight[c]
            for k in range(width):
                istd = inv_std[s, 0, k]
                xhat = (x[s, c, k] - mean[s, 0, k]) * istd
                gx[s, c, k] = istd * (gy[s, c, k] * scale - sums[0, k] / channels - xhat * (sums[1, k] / channels))


@njit(**COMPILED)
def sample_parameter_grads(parameter_sums, gweight, gbias):
    """gweight[c] and gbias[c]: the samples' shares (parameter_sums (N, 2, C) float64) added
    in sample order."""
    for c in range(gweight.shape[0]):
        by_weight = 0.0
        by_bias = 0.0
        for s in range(parameter_sums.shape[0]):
            by_weight += parameter_sums[s, 0, c]
            by_bias += parameter_sums[s, 1, c]
        gweight[c] = by_weight
        gbias[c] = by_bias


# ---- GroupNorm: statistics per group, over its channels and positions ----------------------
@njit(**THREADED)
def group_norm_forward(x, weight, bias, eps, groups, mean, inv_std, y, a0, a1):
    """x and y viewed (N * groups, C / groups, K); per block a in [a0, a1): mean[a] and
    inv_std[a] (written, shape (A, 1, 1)), then y = x * scale + shift with scale = weight[c] *
    inv_std, shift = bias[c] - mean * scale for each channel c of the block."""
    _, per_group, width = x.shape
    count = per_group * width
    for a in range(a0, a1):
        total = 0.0
        squares = 0.0
        for cg in range(per_group):
            for k in range(width):
                v = np.float64(x[a, cg, k])
                total += v
                squares += v * v
        mu = total / count
        istd = 1.0 / np.sqrt(max(squares / count - mu * mu, 0.0) + eps)
        mean[a, 0, 0], inv_std[a, 0, 0] = mu, istd
        for cg in range(per_group):
            c = a % groups * per_group + cg
            scale = weight[c] * istd
            shift = bias[c] - mu * scale
            for k in range(width):
                y[a, cg, k] = x[a, cg, k] * scale + shift


@njit(**THREADED)
def group_norm_backward_blocks(x, gy, weight, mean, inv_std, groups, block_sums, gx, a0, a1):
    """Per block a in [a0, a1) (as in group_norm_forward) of M values, per channel c of it:
    S = sum gy and X = sum gy xhat = (sum gy x - mean S) inv_std into block_sums[a] ((A, 2,
    C / groups) float64); unless gx is empty, gx = weight[c] inv_std gy + b x + d, the
    _Normalize gradient per channel, with gh = gy weight: b = -inv_std^2 sum(gh xhat) / M,
    d = -inv_std sum(gh) / M - b mean."""
    _, per_group, width = x.shape
    count = per_group * width
    for a in range(a0, a1):
        mu, istd = np.float64(mean[a, 0, 0]), np.float64(inv_std[a, 0, 0])
        gh_sum = 0.0
        gh_xhat_sum = 0.0
        for cg in range(per_group):
            c = a % groups * per_group + cg
            total = 0.0
            products = 0.0
            for k in range(width):
                g = np.float64(gy[a, cg, k])
                total += g
                products += g * x[a, cg, k]
            by_xhat = (products - mu * total) * istd  # sum gy xhat over the channel
            block_sums[a, 0, cg], block_sums[a, 1, cg] = total, by_xhat
            gh_sum += weight[c] * total
            gh_xhat_sum += weight[c] * by_xhat
        if gx.size == 0:
            continue
        b = -istd * istd * gh_xhat_sum / count
        d = -istd * gh_sum / count - b * mu
        for cg in range(per_group):
            scale = weight[a % groups * per_group + cg] * istd
            for k in range(width):
                gx[a, cg, k] = scale * gy[a, cg, k] + b * x[a, cg, k] + d


@njit(**COMPILED)
def group_norm_parameter_grads(groups, block_sums, parameter_sums, gweight, gbias):
    """Over the blocks in order: gbias[c] = the sum of S and gweight[c] that of X = sum gy
    xhat (parameter_sums (2, C) float64)."""
    blocks, _, per_group = block_sums.shape
    parameter_sums[:] = 0.0
    for a in range(blocks):
        for cg in range(per_group):
            c = a % groups * per_group + cg
            parameter_sums[0, c] += block_sums[a, 1, cg]
            parameter_sums[1, c] += block_sums[a, 0, cg]
    for c in range(gweight.shape[0]):
        gweight[c] = parameter_sums[0, c]
        gbias[c] = parameter_sums[1, c]


class _CompiledNormalize(LayerLike):
    """A normalisation layer's kernel whose workspace is float64 sums of the shapes
    `_sums_shapes` gives."""

    def _sums_shapes(self, in_shapes, phase):
        raise NotImplementedError

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return scratch_bytes(*(numel(shape) * SUM_BYTES for shape in self._sums_shapes(in_shapes, phase)))

    def _sums(self, ctx, x, phase):
        return [ctx.scratch(shape, np.float64) for shape in self._sums_shapes([x.shape], phase)]


class CompiledLayerNorm(LayerLike):
    """LayerNorm by layer_norm_forward and layer_norm_backward on the (N, C, K) view, the
    samples shared among the kernel threads (from SPLIT_VALUES values), each thread with float64
    sums of its own; the parameter gradients then add the samples' shares in sample order
    (sample_parameter_grads), so the bits do not depend on the number of threads."""

    def _sums_shapes(self, in_shapes, phase, threads):
        samples, channels, width = self.layer._view(tuple(in_shapes[0]))
        return [(threads, 2, width)] + ([(samples, 2, channels)] if phase == BACKWARD else [])

    def _threads(self, in_shapes, phase, workspace_bytes=None):
        """The threads the samples are split among (fewer where the planned `workspace_bytes`
        was sized for fewer)."""
        shape = tuple(in_shapes[0])
        wanted = min(threads_for(numel(shape), SPLIT_VALUES), shape[0])
        if workspace_bytes is None:
            return wanted
        return min(wanted, fitting_threads(workspace_bytes, lambda t: self._bytes(in_shapes, phase, t)))

    def _bytes(self, in_shapes, phase, threads):
        return scratch_bytes(*(numel(shape) * SUM_BYTES for shape in self._sums_shapes(in_shapes, phase, threads)))

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self._bytes(in_shapes, phase, self._threads(in_shapes, phase))

    def _scratch(self, ctx, x, phase):
        """(threads, this phase's float64 sums): the threads the planned workspace allows."""
        threads = self._threads([x.shape], phase, ctx.workspace.nbytes)
        return threads, [ctx.scratch(shape, np.float64) for shape in self._sums_shapes([x.shape], phase, threads)]

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        view = self.layer._view(x.shape)
        threads, (sums,) = self._scratch(ctx, x, FORWARD)
        run_split(layer_norm_forward, 0, x.shape[0], threads, (x.reshape(view), params["weight"], params["bias"],
                                                              self.layer.eps, aux["mean"], aux["inv_std"],
                                                              y.reshape(view)), (sums,))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, view = saved.xs[0], self.layer._view(saved.xs[0].shape)
        gx = gxs[0].reshape(view) if gxs[0] is not None else x.reshape(view)[:0]  # empty: not asked for
        threads, (sums, parameter_sums) = self._scratch(ctx, x, BACKWARD)
        run_split(layer_norm_backward, 0, x.shape[0], threads, (x.reshape(view), gy.reshape(view), params["weight"],
                                                               aux["mean"], aux["inv_std"], parameter_sums, gx), (sums,))
        sample_parameter_grads(parameter_sums, gparams["weight"], gparams["bias"])
        ctx.release_scratch()


class CompiledGroupNorm(_CompiledNormalize):
    """GroupNorm by group_norm_forward, group_norm_backward_blocks (both on the kernel threads,
    each thread a share of the blocks) and group_norm_parameter_grads (one thread, the blocks in
    order), on the (N * groups, C / groups, K) view (the layer's statistics, (N * groups, 1, 1),
    are the same values)."""

    def _block_view(self, shape):
        groups = self.layer.groups
        return (shape[0] * groups, shape[1] // groups, numel(shape[2:]))

    def _sums_shapes(self, in_shapes, phase):
        blocks, per_group, _ = self._block_view(in_shapes[0])
        return [(blocks, 2, per_group), (2, in_shapes[0][1])] if phase == BACKWARD else []

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        view = self._block_view(x.shape)
        run_split(group_norm_forward, 0, view[0], threads_for(x.size, SPLIT_VALUES),
                  (x.reshape(view), params["weight"], params["bias"], self.layer.eps, self.layer.groups,
                   aux["mean"], aux["inv_std"], y.reshape(view)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        view = self._block_view(x.shape)
        block_sums, parameter_sums = self._sums(ctx, x, BACKWARD)
        gx = gxs[0].reshape(view) if gxs[0] is not None else x.reshape(view)[:0]  # empty: not asked for
        run_split(group_norm_backward_blocks, 0, view[0], threads_for(x.size, SPLIT_VALUES),
                  (x.reshape(view), gy.reshape(view), params["weight"], aux["mean"], aux["inv_std"],
                   self.layer.groups, block_sums, gx))
        group_norm_parameter_grads(self.layer.groups, block_sums, parameter_sums, gparams["weight"], gparams["bias"])
        ctx.release_scratch()
