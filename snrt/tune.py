"""`snrt tune`: how large a batch each memory policy fits in a device budget, found from the
static plans (no out-of-memory trials), the images/s the cost model predicts at each batch,
and the batch, policy and learning rate to train with.

The learning rate follows the linear scaling rule with gradual warm-up (Goyal et al. 2017,
"Accurate, Large Minibatch SGD"): k times the config's batch trains with k times its learning
rate, reached linearly over the first iterations. An optional learning-rate range test (Smith
2017, "Cyclical Learning Rates for Training Neural Networks") trains a few iterations at the
recommended batch with the rate growing exponentially and caps the scaled rate at a tenth of
the rate where the loss was lowest.
"""

import contextlib
import errno
import math
import os
from dataclasses import dataclass
from pathlib import Path

from snrt.atomic import replace_atomically, save_figure
from snrt.config import config_to_yaml, with_settings
from snrt.errors import SnrtError
from snrt.scheduler.planner import fitting_plan
from snrt.scheduler.policies import POLICIES

WARMUP_FRACTION = 0.05  # of the iterations, when the learning rate is scaled up (Goyal et al.: 5 epochs of 90)
RANGE_DECADES = (-3, 2)  # the range test sweeps the scaled rate times 10**-3 .. 10**2
SMOOTHING = 0.7  # of the range test's loss (an exponential moving average, bias-corrected)
DIVERGED = 4.0  # the range test stops once the smoothed loss exceeds this many times its lowest


@dataclass(frozen=True)
class Point:
    """One plan that fits: `policy` at `batch`, its arena and predicted iteration seconds."""

    policy: str
    batch: int
    arena_bytes: int
    predicted_s: float

    @property
    def images_per_s(self):
        return self.batch / self.predicted_s if self.predicted_s > 0 else math.inf


def sweep(graph, policy, budget, limit, on_plan=None, **plan_options):
    """The Points of `policy` that fit `budget`: batches 1, 2, 4, ... while they fit (up to
    `limit`), then the largest batch that fits, by bisection between the last power of two
    that fits and the first that does not. [] when batch 1 does not fit. `on_plan(policy,
    batch)` is told of every plan before it is made (a progress display)."""
    points = {}

    def fits(batch):
        if on_plan:
            on_plan(policy, batch)
        plan = fitting_plan(graph, batch, policy, budget, **plan_options)
        if plan is not None:
            points[batch] = Point(policy, batch, plan.arena_bytes, plan.predicted_s)
        return plan is not None

    low, high = 0, None  # low fits (0: nothing yet), high does not
    batch = 1
    while batch <= limit:
        if not fits(batch):
            high = batch
            break
        low, batch = batch, batch * 2
    if high is None:  # every power of two up to `limit` fits: try `limit` itself
        high = limit + 1
        if low < limit:
            if fits(limit):
                low = limit
            else:
                high = limit
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return [points[b] for b in sorted(points)]


def largest(points):
    """{policy: its largest batch that fits}."""
    out = {}
    for p in points:
        out[p.policy] = max(out.get(p.policy, 0), p.batch)
    return out


def recommend(points):
    """The Point with the most predicted images/s (the larger batch, then the earlier policy, on a tie)."""
    order = {name: i for i, name in enumerate(POLICIES)}
    return max(points, key=lambda p: (p.images_per_s, p.batch, -order[p.policy]))


def scaled_train(train, batch):
    """{"batch", "optimizer": {"lr"}, "schedule": {"warmup"}} for `batch`: the learning rate
    scaled linearly from `train`'s (a TrainConfig), with a warm-up of WARMUP_FRACTION of the
    iterations (at least the config's own) when it grows."""
    factor = batch / train.batch
    warmup = train.schedule.warmup
    if factor > 1:
        warmup = max(warmup, math.ceil(WARMUP_FRACTION * train.iterations))
    return {"batch": batch, "optimizer": {"lr": train.optimizer.lr * factor}, "schedule": {"warmup": warmup}}


def tuned_config(config, point, budget):
    """`config` with the batch, learning rate, warm-up and memory policy of `point` in `budget`."""
    return with_settings(config, train=scaled_train(config.train, point.batch),
                         memory={"policy": point.policy, "budget": budget})


@dataclass(frozen=True)
class RangeTest:
    """A learning-rate range test: the rate and the (smoothed) loss of each iteration, and the
    rate it suggests, a tenth of the rate at the lowest smoothed loss."""

    lrs: tuple
    losses: tuple
    smoothed: tuple

    @property
    def suggested_lr(self):
        lowest = min(range(len(self.smoothed)), key=self.smoothed.__getitem__)
        return self.lrs[lowest] / 10


def range_rates(center, iterations):
    """`iterations` learning rates growing exponentially over RANGE_DECADES around `center`."""
    low, high = RANGE_DECADES
    steps = max(iterations - 1, 1)
    return [center * 10 ** (low + (high - low) * i / steps) for i in range(iterations)]


def range_test(trainer, center, iterations, on_iteration=None):
    """Train `trainer` (a fresh snrt.Trainer) for up to `iterations` iterations with the rates
    of `range_rates(center, iterations)`, stopping once the loss diverges; the RangeTest (of
    the iterations before a signal, when one stops the trainer: `trainer.stop_reason` says).
    `on_iteration(metrics)` is told of every iteration (a progress display)."""
    from snrt.errors import DivergenceError

    rates = range_rates(center, iterations)
    lrs, losses, smoothed, average = [], [], [], 0.0

    def record(m):
        nonlocal average
        average = SMOOTHING * average + (1 - SMOOTHING) * m.loss
        lrs.append(m.lr)
        losses.append(m.loss)
        smoothed.append(average / (1 - SMOOTHING ** len(losses)))
        if smoothed[-1] > DIVERGED * min(smoothed):
            trainer.stop_reason = "the loss diverged"
        if on_iteration:
            on_iteration(m)

    try:
        trainer.fit(iterations=iterations, on_iteration=record, lr_at=lambda i: rates[i])
    except DivergenceError:  # a non-finite loss ends the test; what came before stands
        pass
    if not lrs and not trainer.stop_requested:  # stopped by a signal (stop_reason) before any: the caller's to say
        raise SnrtError(f"the learning-rate range test diverged at its first rate, {rates[0]:g}: the loss is not "
                        "finite from the start (the data or the network?)")
    return RangeTest(tuple(lrs), tuple(losses), tuple(smoothed))


def draw_range_test(test, path, title):
    """Loss against learning rate (log scale), with the suggested rate marked, to a PNG at `path`."""
    with _figure(path, title, "learning rate", "training loss") as ax:
        ax.plot(test.lrs, test.losses, marker=".", alpha=0.4, label="loss")
        ax.plot(test.lrs, test.smoothed, label="smoothed")
        ax.axvline(test.suggested_lr, color="red", linewidth=1, label=f"suggested {test.suggested_lr:.3g}")
        ax.set_xscale("log")
        ax.set_ylim(0.9 * min(test.losses), 1.5 * max(test.losses[0], test.smoothed[0]))  # not the divergence's height


def check_destination(path, overwrite=False):
    """SnrtError when a tuned config may not be written to `path`: a file is there and not to be
    replaced (`overwrite`). Checked before the sweep too, which can take minutes."""
    if Path(path).exists() and not overwrite:
        raise SnrtError(f"{path}: exists; pass --overwrite to replace it, or --out another file")


def write_config(config, path, overwrite=False):
    """Write `config` as YAML to `path` atomically; an existing file is kept unless `overwrite`."""
    path = Path(path)
    check_destination(path, overwrite)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:  # a file where a folder of the path should be
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path.parent)) from None
    replace_atomically(path, lambda partial: partial.write_text(config_to_yaml(config)))
    return path


def draw_throughput(points, path, title):
    """Predicted images/s against batch, a line per policy, to a PNG at `path`."""
    with _figure(path, title, "batch", "predicted images/s") as ax:
        for policy in POLICIES:
            mine = [p for p in points if p.policy == policy]
            if mine:
                ax.plot([p.batch for p in mine], [p.images_per_s for p in mine], marker="o", label=policy)
        ax.set_xscale("log", base=2)


@contextlib.contextmanager
def _figure(path, title, xlabel, ylabel):
    """The axes of one plot, saved as a PNG at `path` when the block ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    yield ax
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
