"""Optimizers and learning-rate schedules. Updates work in place on arena views."""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SGD:
    """SGD with momentum, Nesterov and L2 weight decay, as PyTorch defines it:
    g' = g + wd w;  m = mu m + g';  step = g' + mu m (Nesterov) or m;  w -= lr step."""

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0

    def update(self, xp, w, g, m, decay, lr, workspace):
        """Update `w` in place from gradient `g` (overwritten) and momentum `m` (or None).

        `workspace` is a uint8 buffer of at least w.nbytes, used as one temporary.
        """
        tmp = workspace[: w.nbytes].view(w.dtype).reshape(w.shape)
        if decay and self.weight_decay:
            xp.multiply(w, self.weight_decay, out=tmp)
            g += tmp
        step = g
        if m is not None and self.momentum:
            m *= self.momentum
            m += g
            if self.nesterov:
                xp.multiply(m, self.momentum, out=tmp)
                g += tmp
            else:
                step = m
        xp.multiply(step, lr, out=tmp)
        w -= tmp


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
