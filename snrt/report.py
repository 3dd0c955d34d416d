"""Pictures of a run: loss, accuracy, images/s and data wait against iteration, from a run
folder's metrics.jsonl (one JSON line per iteration) and summary.json (the held-out result).

`snrt train` writes RUN/metrics.png at the end of a run and when it is stopped; `snrt report
RUN [RUN ...]` redraws it, one run or several side by side, and prints a short table.
"""

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display needed
import matplotlib.pyplot as plt  # noqa: E402

from snrt.atomic import save_figure  # noqa: E402
from snrt.errors import SnrtError  # noqa: E402
from snrt.runfolder import METRICS  # noqa: E402
from snrt.units import is_count  # noqa: E402

SUMMARY = "summary.json"
PANELS = (("loss", "training loss", 1.0), ("accuracy", "accuracy", 1.0), ("images_per_s", "images/s", 1.0),
          ("data_wait_s", "data wait (ms)", 1e3))  # (metric, axis label, scale)


@dataclass
class Run:
    """One run folder's metrics (a list of dicts, one per iteration) and summary (a dict; empty
    while the run has not finished)."""

    name: str
    metrics: list
    summary: dict


def load_run(folder):
    """The Run in `folder`; SnrtError naming the file and line when it is not a run folder or a
    line of its metrics is not a metrics record. A last line without its newline that is not
    JSON is what a run killed while it wrote the line leaves: the iterations before it are drawn."""
    folder = Path(folder)
    path = folder / METRICS
    if not path.is_file():
        raise SnrtError(f"{folder}: not a run folder: no {METRICS} (snrt train writes one per run)")
    text = _text(path)
    lines = text.splitlines()
    metrics = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines) and not text.endswith("\n"):
                break
            raise SnrtError(f"{path}: line {number} is not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not is_count(record.get("iteration"), 0) or _number(
                record["iteration"]) is None or _number(record.get("loss")) is None:
            raise SnrtError(f"{path}: line {number} is not a metrics record (expected an object with "
                            "'iteration' and 'loss', numbers)")
        metrics.append(record)
    if not metrics:
        raise SnrtError(f"{path}: no iterations yet")
    summary = {}
    if (folder / SUMMARY).is_file():
        try:
            summary = json.loads(_text(folder / SUMMARY))
        except json.JSONDecodeError as e:
            raise SnrtError(f"{folder / SUMMARY}: not JSON ({e.msg})") from None
    return Run(display_name(folder.name or folder), metrics, summary if isinstance(summary, dict) else {})


def display_name(path):
    """`path` as text a picture can show: bytes of it that are not UTF-8 (a Latin-1 folder name)
    become U+FFFD, where matplotlib refuses to draw the string."""
    return os.fsencode(path).decode(errors="replace")


def _text(path):
    """The text of the file `path`; SnrtError when it is not UTF-8 (a damaged file)."""
    try:
        return path.read_text()
    except UnicodeDecodeError as e:
        raise SnrtError(f"{path}: not a text file ({e.reason} at byte {e.start})") from None


def draw_metrics(runs, path, title=None):
    """Write a PNG of `runs` (Runs) to `path`: one panel per metric of PANELS against iteration,
    a line per run, the held-out accuracy of a finished run as a marker at its last iteration."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for ax, (key, label, scale) in zip(axes.flat, PANELS):
        for run in runs:
            values = [(m["iteration"], _number(m.get(key))) for m in run.metrics]
            points = [(i, value * scale) for i, value in values if value is not None and math.isfinite(value)]
            if points:
                ax.plot(*zip(*points), linewidth=1, label=run.name)
            during = [(m["iteration"], value) for m in run.metrics
                      if (value := _number(m.get("heldout_accuracy"))) is not None] if key == "accuracy" else []
            if during:  # train.eval_every's evaluations
                ax.plot(*zip(*during), marker="o", markersize=4, linestyle="--", linewidth=1,
                        color=ax.lines[-1].get_color() if points else None, label=f"{run.name}: held-out")
            heldout = _number(run.summary.get("heldout_accuracy"))
            if key == "accuracy" and heldout is not None:
                ax.plot([run.metrics[-1]["iteration"]], [heldout], marker="*", markersize=11, linestyle="none",
                        color=ax.lines[-1].get_color() if points else None, label=f"{run.name}: held-out, end")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("iteration")
    if axes[0][1].get_legend_handles_labels()[0]:  # runs without accuracy draw nothing there to name
        axes[0][1].legend(fontsize=8)
    fig.suptitle(title or ", ".join(r.name for r in runs))
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def report_rows(runs):
    """One row per run: name, iterations, final loss, held-out accuracy, mean images/s (the first
    iteration left out: it includes one-off costs), mean data wait, measured peak bytes."""
    rows = []
    for run in runs:
        timed = run.metrics[1:] or run.metrics
        rows.append({"run": run.name, "iterations": run.metrics[-1]["iteration"] + 1,
                     "final_loss": _number(run.metrics[-1]["loss"]),
                     "heldout_accuracy": _number(run.summary.get("heldout_accuracy")),  # null when it was not finite
                     "images_per_s": _mean(m.get("images_per_s") for m in timed),
                     "data_wait_s": _mean(m.get("data_wait_s") for m in timed),
                     "peak_device_bytes": _number(run.metrics[-1].get("peak_device_bytes"))})
    return rows


def _mean(values):
    values = [v for v in map(_number, values) if v is not None]
    return sum(values) / len(values) if values else None


def _number(value):
    """`value`, or None when it is not a number a float holds (a string, a bool, an int of 400
    digits: what a hand-edited or damaged file may hold)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        float(value)
    except OverflowError:
        return None
    return value
