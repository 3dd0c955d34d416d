"""Shared helpers of the scripts/reproduce_*.py scripts: paths, machine info, the integer search
used for "deepest network" and "largest batch", result files and grouped bar plots."""

import argparse
import json
import os
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "scripts"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))  # this checkout's snrt, and bench_memory's floor_bytes

import timing  # noqa: E402  (before numpy: it sets the BLAS threads)
import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402,F401
import numpy as np  # noqa: E402

from bench_memory import floor_bytes, resident_bytes, streamed_floor_bytes, synthetic_config  # noqa: E402,F401  (one definition each)
from snrt import POLICIES  # noqa: E402,F401
from snrt.scheduler.planner import plan_within  # noqa: E402

GIB = 2**30
MIB = 2**20
BUDGET = 12 * GIB  # the K40c / Titan X of the SuperNeurons and vDNN papers
RESULTS = ROOT / "results"


class _Parser(argparse.ArgumentParser):
    """Fills in --out: results/ for a full run, results/quick/ for a quick one (so a quick run
    never overwrites the committed full-mode results)."""

    def parse_args(self, *args, **kwargs):
        parsed = super().parse_args(*args, **kwargs)
        if parsed.out is None:
            parsed.out = str(RESULTS / "quick" if parsed.quick else RESULTS)
        Path(parsed.out).mkdir(parents=True, exist_ok=True)
        return parsed


def parse_args(doc):
    """--quick and --out, the options every reproduce script takes."""
    parser = _Parser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a short run (smaller sizes, fewer cases)")
    parser.add_argument("--out", default=None, help="folder for the tables and plots "
                        "(default results/, or results/quick/ with --quick)")
    return parser


def machine():
    """Where and with what the numbers were produced."""
    info = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or "cpu", "cpu_model": timing.cpu_model(), "cores": os.cpu_count(),
            "python": platform.python_version(), "numpy": np.__version__,
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
    try:
        import torch
        info["torch"] = torch.__version__
    except ImportError:
        info["torch"] = None
    return info


def gib(nbytes):
    return f"{nbytes / GIB:.2f}"


def arena_in_budget(graph, batch, policy, budget=BUDGET, stream_parameters=False, spill=True, precision="fp32"):
    """The arena of the plan `make_plan(graph, batch, policy, budget=budget, stream_parameters=...,
    precision=...)`
    ends with (or, superneurons, grows from), without its error (`plan_within`): over the
    budget, a copying policy falls back to just-in-time prefetches and a freeing one spills
    idle tensors (unless `spill` is False: the policy's own plans), so a value > budget means
    make_plan would raise BudgetError.
    """
    return plan_within(graph, batch, policy, budget, spill, stream_parameters=stream_parameters,
                       precision=precision).arena_bytes


def largest_fitting(size_of, budget, start=(1, 2), limit=1 << 16, log=None):
    """The largest integer n >= 1 with size_of(n) <= budget (0 if none), for a size that grows
    with n and is close to affine (an arena against the batch or the block count).

    Frugal, and never far past the answer (a probe far above it is a huge plan): while no
    probe is too big, aim just past where the line through the widest pair of fitting probes
    crosses the budget, overshooting by 1, 2, 4, ... on each miss; then, inside the bracket,
    a secant step and a probe of its neighbour (an affine size is pinned down by these), and
    a bisection step whenever that did not halve the bracket. Returns (n, {n: size} of every
    probe).
    """
    seen = {}

    def probe(n):
        if n not in seen:
            seen[n] = size_of(n)
            if log:
                log(f"  n={n}: {seen[n] / GIB:.2f} GiB {'fits' if seen[n] <= budget else 'too big'}")
        return seen[n] <= budget

    def crossing(a, b):
        """Where the line through the probes at a < b reaches the budget (None if it does not rise)."""
        if seen[b] <= seen[a]:
            return None
        return int(a + (budget - seen[a]) * (b - a) / (seen[b] - seen[a]))

    lo, hi = 0, limit + 1  # size_of(lo) fits (0: nothing known), size_of(hi) does not
    for n in sorted(set(start)):
        if probe(n):
            lo = max(lo, n)
        else:
            hi = min(hi, n)
            break
    overshoot = 1
    while hi > limit and lo < limit:  # nothing too big yet: step up just past the predicted answer
        fitting = sorted(seen)
        guess = crossing(fitting[0], fitting[-1]) if len(fitting) > 1 else None
        n = min(limit, max(lo + overshoot, (guess or 2 * lo) + overshoot))
        if probe(n):
            lo, overshoot = n, 2 * overshoot
        else:
            hi = n
    while hi - lo > 1:
        width = hi - lo
        if lo in seen:
            n = crossing(lo, hi)
            n = (lo + hi) // 2 if n is None else n
        else:
            n = (lo + hi) // 2
        n = min(max(n, lo + 1), hi - 1)
        if probe(n):
            lo = n
            if lo + 1 < hi and probe(lo + 1):
                lo += 1
            else:
                hi = min(hi, lo + 1)
        else:
            hi = n
            if hi - 1 > lo and not probe(hi - 1):
                hi -= 1
            else:
                lo = max(lo, hi - 1)
        if hi - lo > 1 and hi - lo > width // 2:  # the secant did not halve it: bisect once
            n = (lo + hi) // 2
            if probe(n):
                lo = n
            else:
                hi = n
    return lo, seen


def save_json(out, name, data):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(data, indent=2, default=str) + "\n")


def save_markdown(out, name, lines):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def table(header, rows):
    """Markdown table lines."""
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + \
           ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def meta_line(meta, quick):
    cpu = f"{meta['cpu_model']}, " if meta.get("cpu_model") else ""
    return (f"Generated {meta['date']} on {meta['platform']} ({cpu}{meta['cores']} cores), Python {meta['python']}, "
            f"NumPy {meta['numpy']}, PyTorch {meta['torch']}; mode: {'quick' if quick else 'full'}"
            + (f"; load average {meta['load_average'][0]:.2f} when it started." if meta.get("load_average") else "."))


def grouped_bars(path, groups, series, values, ylabel, title, hline=None, log=False, extra=None):
    """A grouped bar plot: values[series][group] (None: no bar); `extra` {label: [per group]} as markers."""
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(groups) * (len(series) + 1) / 3), 4.8))
    width = 0.8 / len(series)
    x = np.arange(len(groups))
    for i, s in enumerate(series):
        ys = [values[s][g] if values[s].get(g) is not None else 0 for g in groups]
        ax.bar(x + (i - (len(series) - 1) / 2) * width, ys, width, label=s)
    for label, ys in (extra or {}).items():  # a black line across each group
        ax.hlines(ys, x - 0.42, x + 0.42, color="black", linewidth=1.6, zorder=3, label=label)
    if hline is not None:
        ax.axhline(hline[0], color="red", linewidth=1, linestyle="--", label=hline[1])
    ax.set_xticks(x, groups, rotation=15)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
