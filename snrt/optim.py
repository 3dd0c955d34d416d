"""Optimizers and learning-rate schedules. Updates work in place on arena views.

An optimizer names the buffers it keeps per parameter (`state_names`: the planner gives each
parameter one buffer per name, zero at the start, saved in checkpoints as "node:param:name")
and updates one parameter at a time, as soon as its gradient is complete (the plan's fused
per-layer update): `update(xp, w, g, states, weight_decay, lr, count, workspace)` with `g`
the gradient (overwritten), `states` the parameter's buffers in `state_names` order,
`weight_decay` and `lr` the parameter's own (`settings` applies the parameter groups),
`count` the 1-based number of updates so far (Adam's bias correction) and `workspace` a uint8
buffer (the plan's; None where the kernel choice runs the compiled steps) through whose size
the array code works in pieces (snrt.layers.base.LayerKernels.update_workspace_bytes). Every
array is contiguous, as arena views are.

On the CPU (NumPy arrays, contiguous as arena views are) each update is one compiled pass over
the parameter, its gradient and its state (`sgd_step`, `adam_step`), where the NumPy code
makes five to twelve. The CUDA backend runs the same passes as CUDA kernels
(snrt_sgd_step and snrt_adam_step in snrt/backends/cuda_source.py, gradient scaling and
clipping included), given `fused_name` and `fused_scalars`; other array modules run the
NumPy-style code.
"""

import fnmatch
import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from snrt.backends.cpu_common import COMPILED


@njit(**COMPILED)
def sgd_step(w, g, m, weight_decay, momentum, nesterov, lr):
    """SGD's update of flat w in one pass (m empty: no momentum; nesterov a flag, 0 or 1);
    g is only read."""
    for i in range(w.size):
        gi = g[i] + weight_decay * w[i]
        step = gi
        if m.size:
            m[i] = momentum * m[i] + gi
            step = gi + momentum * m[i] if nesterov else m[i]
        w[i] -= lr * step


@njit(**COMPILED)
def adam_step(w, g, m, v, coefficients):
    """Adam's (AdamW's when decoupled) update of flat w in one pass. `coefficients` (w's
    dtype, so that no value is widened): decay (wd, or AdamW's lr * wd), beta1, 1 - beta1,
    beta2, 1 - beta2, eps, lr / (1 - beta1^t), 1 / sqrt(1 - beta2^t), decoupled (0 or 1)."""
    decay, beta1, rest1, beta2, rest2, eps, step_size, correction2, decoupled = coefficients
    for i in range(w.size):
        gi = g[i]
        if decoupled:
            w[i] *= 1 - decay
        else:
            gi += decay * w[i]
        m[i] = beta1 * m[i] + rest1 * gi
        v[i] = beta2 * v[i] + rest2 * gi * gi
        w[i] -= step_size * (m[i] / (np.sqrt(v[i]) * correction2 + eps))


def _compiled(xp, *arrays):
    """Whether the compiled steps apply: NumPy arrays, every one contiguous (a flat view)."""
    return xp is np and all(a.flags.c_contiguous for a in arrays)


def _in_pieces(workspace, w, g, states):
    """(w, g, states, temporary) of each piece of the flat arrays that fits `workspace`."""
    if workspace is None:
        raise ValueError("the optimizer's array code needs the update's workspace; this plan's kernel choice "
                         "reserved none (its updates are compiled)")
    size = max(1, min(w.size, workspace.nbytes // w.itemsize))
    arrays = [a.reshape(-1) for a in (w, g, *states)]
    for start in range(0, w.size, size):
        w_piece, g_piece, *state_pieces = (a[start:start + size] for a in arrays)
        yield w_piece, g_piece, state_pieces, workspace[: w_piece.nbytes].view(w.dtype)


class Optimizer:
    """Base: `update` scales the gradient by `grad_scale` (clipping by the global norm), clips
    it to [-clip_value, clip_value] when clip_value > 0 (as torch.nn.utils.clip_grad_value_
    before the step), then applies the subclass's `apply`. `groups` (config.ParamGroup) give
    parameters their own weight decay and learning rate.

    Clipping by the global norm (clip_norm > 0, as torch.nn.utils.clip_grad_norm_): every
    gradient is scaled by min(1, clip_norm / (norm + 1e-6)), norm the L2 norm of all parameter
    gradients together. No update may run before the last gradient is complete, so such an
    optimizer `defers_updates`: the plan puts every update after the whole backward pass and
    keeps all parameter gradients alive until then (the plan's peak counts them), and the
    executor sums the squares of each layer's gradients as its backward step writes them.
    """

    clip_value = 0.0
    clip_norm = 0.0
    groups = ()

    @property
    def defers_updates(self):
        """True when no update may run before the whole backward pass is done."""
        return self.clip_norm > 0

    @property
    def plan_options(self):
        """What the planner must know of this optimizer (make_plan's and prepare's keywords):
        the buffers it keeps per parameter and whether its updates wait for the backward pass."""
        return {"optimizer_states": self.state_names, "deferred_updates": self.defers_updates}

    def grad_scale(self, squares):
        """The factor of every gradient given the sum of all their squares (1 without clip_norm)."""
        if not self.clip_norm:
            return 1.0
        scale = self.clip_norm / (math.sqrt(squares) + 1e-6)
        return 1.0 if scale >= 1.0 else scale  # a NaN norm gives NaN gradients, as torch's does

    def settings(self, name, decay):
        """(weight decay, learning-rate factor) of parameter `name` ("node:param"): the first
        group whose patterns match it, else the optimizer's; `decay` False (the layer's
        default for biases and norm scales) means no weight decay unless a group sets one."""
        default = self.weight_decay if decay else 0.0
        for group in self.groups:
            if any(fnmatch.fnmatchcase(name, pattern) for pattern in group.params):
                return (default if group.weight_decay is None else group.weight_decay), group.lr_scale
        return default, 1.0

    def update(self, xp, w, g, states, weight_decay, lr, count, workspace, grad_scale=1.0):
        if grad_scale != 1.0:
            g *= grad_scale
        if self.clip_value:
            xp.clip(g, -self.clip_value, self.clip_value, out=g)
        self.apply(xp, w, g, states, weight_decay, lr, count, workspace)


@dataclass(frozen=True)
class SGD(Optimizer):
    """SGD with momentum, Nesterov and L2 weight decay, as PyTorch defines it:
    g' = g + wd w;  m = mu m + g';  step = g' + mu m (Nesterov) or m;  w -= lr step."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_value: float = 0.0
    clip_norm: float = 0.0
    groups: tuple = ()

    fused_name = "sgd"  # of the one-pass update: sgd_step here, snrt_sgd_step on CUDA

    @property
    def state_names(self):
        return ("momentum",) if self.momentum else ()

    def fused_scalars(self, weight_decay, lr, count):
        """The one-pass update's scalars after its arrays: weight decay, momentum, Nesterov
        (0 or 1) and the learning rate."""
        return weight_decay, self.momentum, float(self.nesterov), lr

    def apply(self, xp, w, g, states, weight_decay, lr, count, workspace):
        if _compiled(xp, w, g, *states):
            m = states[0].reshape(-1) if states else w.reshape(-1)[:0]
            sgd_step(w.reshape(-1), g.reshape(-1), m, *self.fused_scalars(weight_decay, lr, count))
            return
        for piece in _in_pieces(workspace, w, g, states):
            self._apply_arrays(xp, *piece, weight_decay, lr)

    def _apply_arrays(self, xp, w, g, states, tmp, weight_decay, lr):
        """The update of one piece in array code, `tmp` a temporary of its size."""
        if weight_decay:
            xp.multiply(w, weight_decay, out=tmp)
            g += tmp
        direction = g
        if states:
            (m,) = states
            m *= self.momentum
            m += g
            if self.nesterov:
                xp.multiply(m, self.momentum, out=tmp)
                g += tmp
            else:
                direction = m
        xp.multiply(direction, lr, out=tmp)
        w -= tmp


@dataclass(frozen=True)
class Adam(Optimizer):
    """Adam, and AdamW with `decoupled` weight decay, as PyTorch defines them:
    Adam g' = g + wd w (AdamW instead w -= lr wd w first);  m = b1 m + (1 - b1) g';
    v = b2 v + (1 - b2) g'^2;  w -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)."""

    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False
    clip_value: float = 0.0
    clip_norm: float = 0.0
    groups: tuple = ()

    state_names = ("exp_avg", "exp_avg_sq")
    fused_name = "adam"  # of the one-pass update: adam_step here, snrt_adam_step on CUDA

    def fused_scalars(self, weight_decay, lr, count):
        """The one-pass update's scalars after its arrays: adam_step's coefficients."""
        return (lr * weight_decay if self.decoupled else weight_decay, self.beta1, 1 - self.beta1, self.beta2,
                1 - self.beta2, self.eps, lr / (1 - self.beta1 ** count), 1 / math.sqrt(1 - self.beta2 ** count),
                float(self.decoupled))

    def apply(self, xp, w, g, states, weight_decay, lr, count, workspace):
        m, v = states
        if _compiled(xp, w, g, m, v):
            coefficients = np.array(self.fused_scalars(weight_decay, lr, count), w.dtype)
            adam_step(w.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), coefficients)
            return
        for piece in _in_pieces(workspace, w, g, states):
            self._apply_arrays(xp, *piece, weight_decay, lr, count)

    def _apply_arrays(self, xp, w, g, states, tmp, weight_decay, lr, count):
        """The update of one piece in array code, `tmp` a temporary of its size."""
        m, v = states
        if weight_decay:
            if self.decoupled:
                w *= 1 - lr * weight_decay
            else:
                xp.multiply(w, weight_decay, out=tmp)
                g += tmp
        m *= self.beta1
        xp.multiply(g, 1 - self.beta1, out=tmp)
        m += tmp
        v *= self.beta2
        xp.multiply(g, g, out=tmp)
        tmp *= 1 - self.beta2
        v += tmp
        xp.sqrt(v, out=tmp)  # denominator: sqrt(v) / sqrt(1 - b2^t) + eps
        tmp *= 1 / math.sqrt(1 - self.beta2 ** count)
        tmp += self.eps
        xp.divide(m, tmp, out=tmp)
        tmp *= lr / (1 - self.beta1 ** count)
        w -= tmp


def make_optimizer(config):
    """The optimizer of OptimizerConfig `config` (train.optimizer)."""
    if config.type == "sgd":
        return SGD(momentum=config.momentum, nesterov=config.nesterov, weight_decay=config.weight_decay,
                   clip_value=config.clip_value, clip_norm=config.clip_norm, groups=tuple(config.groups))
    return Adam(beta1=config.beta1, beta2=config.beta2, eps=config.eps, weight_decay=config.weight_decay,
                decoupled=config.type == "adamw", clip_value=config.clip_value, clip_norm=config.clip_norm,
                groups=tuple(config.groups))


def learning_rate(schedule, base_lr, iteration, total):
    """The learning rate at `iteration` (0-based) of `total` under ScheduleConfig `schedule`."""
    if iteration < schedule.warmup:
        return base_lr * (iteration + 1) / schedule.warmup
    if schedule.type == "step":
        return base_lr * schedule.gamma ** sum(1 for m in schedule.milestones if iteration >= m)
    if schedule.type == "cosine":
        span = max(total - schedule.warmup, 1)
        progress = min((iteration - schedule.warmup) / span, 1.0)
        return schedule.min_lr + (base_lr - schedule.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
    return base_lr
