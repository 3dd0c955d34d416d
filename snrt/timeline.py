"""Timelines of an iteration: the memory one (bytes on the device per step, stacked by role,
with the budget line; predicted from a Plan and, after a run, the measured live bytes per step
drawn on top) and the streams one (when each step runs on the compute, offload and prefetch
streams, predicted by the cost model against CUDA events), and how much copy time kernels hid.
"""

import bisect

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from snrt.atomic import save_figure  # noqa: E402
from snrt.scheduler import cost  # noqa: E402
from snrt.scheduler.fuse import planned_graph  # noqa: E402
from snrt.scheduler.plan import ROLES  # noqa: E402

GIB = 2**30
MIB = 2**20


def draw_timeline(plan, path, budget=None, measured=None, title=None):
    """Write a PNG of `plan`'s device bytes per step to `path`.

    `measured` (bytes per step, from a run) is drawn as a line over the prediction.
    """
    per_step = plan.bytes_by_role_per_step()
    steps = range(len(per_step))
    scale, unit = (GIB, "GiB") if max(plan.peak_bytes, budget or 0) >= GIB else (MIB, "MiB")
    traffic = copy_traffic(plan)
    if any(traffic.values()):
        fig, (ax, lower) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
        _draw_traffic(lower, traffic)
    else:
        fig, ax = plt.subplots(figsize=(11, 4.5))
    roles = [r for r in ROLES if any(s[r] for s in per_step)]
    ax.stackplot(steps, *[[s[r] / scale for s in per_step] for r in roles],
                 labels=[r.replace("_", " ") for r in roles], alpha=0.85, linewidth=0)
    if measured is not None:
        ax.plot(steps, [b / scale for b in measured], color="black", linewidth=1, linestyle="--",
                label="measured")
    if budget is not None:
        ax.axhline(budget / scale, color="red", linewidth=1.2, label=f"budget {budget / scale:.2f} {unit}")
    backward = next((i for i, s in enumerate(plan.steps) if s.kind == "backward"), None)
    if backward is not None:
        ax.axvline(backward, color="grey", linewidth=0.8, linestyle=":")
        ax.text(backward, ax.get_ylim()[1] * 0.97, " backward", color="grey", va="top", fontsize=8)
    (lower if any(traffic.values()) else ax).set_xlabel("step")
    ax.set_ylabel(f"device memory ({unit})")
    ax.set_title(title or f"{plan.policy}: peak {plan.peak_bytes / scale:.2f} {unit}, "
                 f"arena {plan.arena_bytes / scale:.2f} {unit}, batch {plan.batch}")
    ax.legend(loc="upper left", fontsize=8, ncol=2)
    ax.margins(x=0)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def copy_traffic(plan):
    """{(direction, what): cumulative bytes after each step}: bytes copied to the host ("out")
    and to the device ("in") so far, of activations and of parameters and optimizer state."""
    totals = {(d, w): 0 for d in ("out", "in") for w in ("activations", "parameters and optimizer state")}
    series = {key: [] for key in totals}
    for step in plan.steps:
        if step.kind in ("offload", "prefetch"):
            buffer = plan.buffers[step.buffer]
            what = "parameters and optimizer state" if buffer.role in ("parameter", "optimizer_state") else "activations"
            totals[("out" if step.kind == "offload" else "in", what)] += buffer.nbytes
        for key, total in totals.items():
            series[key].append(total)
    return {key: values for key, values in series.items() if values and values[-1]}


def _draw_traffic(ax, traffic):
    """Cumulative host<->device copies per step, one line per direction and kind of tensor."""
    top = max(values[-1] for values in traffic.values())
    scale, unit = (GIB, "GiB") if top >= GIB else (MIB, "MiB")
    styles = {"out": "--", "in": "-"}
    for (direction, what), values in traffic.items():
        ax.plot(range(len(values)), [v / scale for v in values], linestyle=styles[direction],
                label=f"{what} {'to host' if direction == 'out' else 'to device'}")
    ax.set_ylabel(f"copied so far ({unit})")
    ax.legend(loc="upper left", fontsize=8)
    ax.margins(x=0)


def copy_overlap(events):
    """How much of the copies' time ran while kernels did, from a backend's `timeline()`
    ([(kind, what, start_s, end_s)], kind "compute" or "copy"; compute intervals may nest):
    {"copy_s": total copy seconds, "overlapped_s": those inside some kernel interval,
    "hidden": their share (1.0 without copies)}."""
    compute = []  # the union of the kernels' intervals, in order
    for start, end in sorted((s, e) for kind, _, s, e in events if kind == "compute"):
        if compute and start <= compute[-1][1]:
            compute[-1] = (compute[-1][0], max(compute[-1][1], end))
        else:
            compute.append((start, end))
    ends = [end for _, end in compute]
    copy_s = overlapped = 0.0
    for kind, _, start, end in events:
        if kind != "copy":
            continue
        copy_s += end - start
        i = bisect.bisect_right(ends, start)  # the first kernel interval ending after the copy starts
        while i < len(compute) and compute[i][0] < end:
            overlapped += min(end, compute[i][1]) - max(start, compute[i][0])
            i += 1
    return {"copy_s": copy_s, "overlapped_s": overlapped, "hidden": overlapped / copy_s if copy_s else 1.0}


STREAMS = ("compute", "offload", "prefetch")


def predicted_streams(plan, graph, model, kernels=None, itemsize=4):
    """[(stream, start_s, end_s)] of `plan`'s steps (of `graph`, as built or as planned) as
    CostModel `model` times them, copies on their own streams (snrt/scheduler/cost.py's
    simulate; step times from `kernels`' measurements where it has them, stored in
    `itemsize`-byte tensors)."""
    graph = planned_graph(graph, plan)
    seconds = [cost.step_seconds(step, graph, plan.batch, model, kernels, itemsize) for step in plan.steps]
    intervals = []
    cost.simulate(plan.steps, plan.buffers, seconds, model, intervals=intervals)
    return intervals


def measured_streams(events):
    """[(stream, start_s, end_s)] of a backend's `timeline()` events ((kind, what, start, end);
    a copy's `what` starts with offload or prefetch), from the first event's start."""
    origin = min((start for _, _, start, _ in events), default=0.0)
    return [(kind if kind == "compute" else what.split()[0], start - origin, end - origin)
            for kind, what, start, end in events]


def draw_streams(predicted, measured, path, title):
    """Write a PNG of one iteration on the compute, offload and prefetch streams: for each, the
    intervals the plan predicts (upper bar) and those measured (lower bar), in seconds."""
    fig, ax = plt.subplots(figsize=(12, 3.6))
    colors = {"predicted": "tab:blue", "measured": "tab:orange"}
    for row, stream in enumerate(reversed(STREAMS)):
        for lane, (label, intervals) in enumerate((("predicted", predicted), ("measured", measured))):
            bars = [(start * 1e3, (end - start) * 1e3) for s, start, end in intervals if s == stream]
            ax.broken_barh(bars, (row + 0.5 - 0.4 * lane, 0.38), color=colors[label], linewidth=0,
                           label=label if row == 0 else None)
    ax.set_yticks([row + 0.5 for row in range(len(STREAMS))], list(reversed(STREAMS)))
    ax.set_ylim(-0.4, len(STREAMS) + 0.5)
    ax.set_xlabel("milliseconds into the iteration")
    ax.set_title(title)
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)
