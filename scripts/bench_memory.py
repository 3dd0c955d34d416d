"""Memory policies on the model zoo, and their cost in time on this CPU.

Part 1 (plans, exact for any device): for each network at its paper image size and
configured batch, the peak device bytes and the arena under every policy, next to the floor
(resident bytes plus the largest single step's own working set: no schedule can go below
it without splitting a layer). Also checks ResNet2500 at batch 16 against a 12 GiB budget.

Part 2 (measured on this CPU, one run): seconds per training iteration of ResNet-50 and
CIFAR ResNet-110 under `none` and `superneurons`, the measured peak arena bytes against the
plan, and the fraction of copy time hidden behind compute.

Writes results/bench_memory.json and results/bench_memory.md.

    python scripts/bench_memory.py            # full
    python scripts/bench_memory.py --quick    # small batches, fewer networks
"""

import argparse
import json
import platform
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import snrt  # (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
import numpy as np
from rich.console import Console
from rich.table import Table
from timing import fit_seconds

from snrt import POLICIES
from snrt.scheduler.order import build_iteration
from snrt.scheduler.plan import PERSISTENT_ROLES
from snrt.scheduler.planner import make_plan
from snrt.scheduler.steps import largest_step_bytes
from snrt.summary import human_bytes

ROOT = Path(__file__).resolve().parent.parent

NETWORKS = [  # (config, image size, batch)
    ("resnet50", 224, 32), ("resnet152", 224, 32), ("vgg16", 224, 64), ("inceptionv4", 299, 32),
    ("densenet121", 224, 32), ("resnet2500", 227, 16),
]
QUICK_NETWORKS = [("resnet50", 224, 8), ("densenet121", 224, 8), ("resnet2500", 227, 2)]
TIMED = [("resnet50", 224, 8), ("cifar_resnet110", 32, 32)]
QUICK_TIMED = [("resnet50", 112, 4), ("cifar_resnet110", 32, 8)]
GIB = 2**30


def floor_bytes(graph, batch):
    """Resident bytes plus the largest single step's own (non-persistent) working set."""
    it = build_iteration(graph, batch)
    return _resident(it.buffers) + largest_step_bytes(it.steps, it.buffers)


def streamed_floor_bytes(graph, batch):
    """The floor when parameters and optimizer state stream: BatchNorm state (still resident)
    plus the largest single step's whole working set, the parameters and optimizer state it
    reads and writes included (for a fused update: weight, gradient, momentum, workspace)."""
    it = build_iteration(graph, batch)
    state = sum(b.nbytes for b in it.buffers if b.role == "state")

    def own(step):
        return sum(it.buffers[b].nbytes for b in set(step.reads()) | set(step.writes())
                   if it.buffers[b].role != "state")
    return state + max((own(s) for s in it.steps), default=0)


def resident_bytes(graph):
    """Bytes resident for the whole run: parameters, optimizer state, BatchNorm state."""
    return _resident(build_iteration(graph, 1).buffers)


def _resident(buffers):
    return sum(b.nbytes for b in buffers if b.role in PERSISTENT_ROLES)


def plan_rows(networks, console):
    rows = []
    for name, size, batch in networks:
        config = snrt.load_config(ROOT / "configs" / f"{name}.yaml", {"input.shape": [3, size, size]})
        floor = floor_bytes(config.graph, batch)
        row = {"network": name, "image": size, "batch": batch, "floor_bytes": floor, "policies": {}}
        for policy in POLICIES:
            start = time.perf_counter()
            plan = make_plan(config.graph, batch, policy)
            row["policies"][policy] = {"peak_bytes": plan.peak_bytes, "arena_bytes": plan.arena_bytes,
                                       "offloaded_bytes": plan.host_bytes, "predicted_s": plan.predicted_s,
                                       "plan_s": time.perf_counter() - start}
        rows.append(row)
        console.print(f"planned {name} ({len(config.graph)} layers)")
    return rows


def synthetic_config(name, size, batch, policy="none"):
    """configs/<name>.yaml at size x size and `batch` under memory `policy`, on 4 batches of
    synthetic data."""
    return snrt.load_config(ROOT / "configs" / f"{name}.yaml", {
        "input.shape": [3, size, size], "train.batch": batch, "memory.policy": policy,
        "train.data": {"type": "synthetic", "samples": 4 * batch}})


def timed_rows(networks, iterations, console):
    rows = []
    for name, size, batch in networks:
        row = {"network": name, "image": size, "batch": batch, "policies": {}}
        for policy in ("none", "superneurons"):
            trainer, seconds = fit_seconds(synthetic_config(name, size, batch, policy), iterations)
            stats = trainer.executor.copy_stats
            row["policies"][policy] = {
                "seconds_per_iteration": statistics.median(seconds),
                "predicted_peak_bytes": trainer.plan.peak_bytes,
                "measured_peak_bytes": trainer.backend.arena.peak_bytes,
                "copy_s": stats["copy_s"], "stalled_s": stats["stalled_s"],
                "hidden_copy_fraction": 1 - stats["stalled_s"] / stats["copy_s"] if stats["copy_s"] else None,
            }
            trainer.backend.close()
            console.print(f"timed {name} under {policy}")
        none, sn = row["policies"]["none"], row["policies"]["superneurons"]
        row["slowdown"] = sn["seconds_per_iteration"] / none["seconds_per_iteration"]
        rows.append(row)
    return rows


def markdown(plans, timed, budget_check, meta):
    lines = [f"# Memory policies ({meta['date']}, {meta['machine']})", "",
             "Peak device bytes per policy (GiB) and the floor: resident bytes plus the largest single "
             "step's working set. `x floor` is superneurons' arena over the floor.", "",
             "| network | image | batch | " + " | ".join(POLICIES) + " | floor | x floor |",
             "| --- | --- | --- | " + " | ".join("---" for _ in POLICIES) + " | --- | --- |"]
    for r in plans:
        peaks = " | ".join(f"{r['policies'][p]['peak_bytes'] / GIB:.2f}" for p in POLICIES)
        ratio = r["policies"]["superneurons"]["arena_bytes"] / r["floor_bytes"]
        lines.append(f"| {r['network']} | {r['image']} | {r['batch']} | {peaks} | "
                     f"{r['floor_bytes'] / GIB:.2f} | {ratio:.2f} |")
    lines += ["", f"ResNet2500 at batch {budget_check['batch']} under superneurons: arena "
              f"{budget_check['arena_bytes'] / GIB:.2f} GiB against a 12 GiB budget: "
              f"{'fits' if budget_check['fits'] else 'does not fit'}.", "",
              "Measured on this CPU (median seconds per iteration after one warm-up):", "",
              "| network | image | batch | none s/it | superneurons s/it | slowdown | copy hidden | peak none | peak superneurons (measured = planned) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in timed:
        n, s = r["policies"]["none"], r["policies"]["superneurons"]
        hidden = "-" if s["hidden_copy_fraction"] is None else f"{100 * s['hidden_copy_fraction']:.0f}%"
        same = "yes" if s["measured_peak_bytes"] == s["predicted_peak_bytes"] else "NO"
        lines.append(f"| {r['network']} | {r['image']} | {r['batch']} | {n['seconds_per_iteration']:.2f} | "
                     f"{s['seconds_per_iteration']:.2f} | {r['slowdown']:.2f}x | {hidden} | "
                     f"{human_bytes(n['measured_peak_bytes'])} | {human_bytes(s['measured_peak_bytes'])} ({same}) |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small batches and fewer networks")
    parser.add_argument("--iterations", type=int, default=3, help="timed iterations per run")
    parser.add_argument("--out", default="results", help="folder for bench_memory.json/.md")
    args = parser.parse_args()
    console = Console()
    plans = plan_rows(QUICK_NETWORKS if args.quick else NETWORKS, console)
    r2500 = snrt.load_config(ROOT / "configs" / "resnet2500.yaml")
    plan = make_plan(r2500.graph, 16, "superneurons")
    budget_check = {"batch": 16, "arena_bytes": plan.arena_bytes, "fits": plan.arena_bytes <= 12 * GIB}
    timed = timed_rows(QUICK_TIMED if args.quick else TIMED, 1 if args.quick else args.iterations, console)
    meta = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "quick": args.quick,
            "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, numpy {np.__version__}"}
    out = Path(args.out)
    out.mkdir(exist_ok=True)
    (out / "bench_memory.json").write_text(json.dumps(
        {"meta": meta, "plans": plans, "resnet2500_budget": budget_check, "timed": timed}, indent=2) + "\n")
    text = markdown(plans, timed, budget_check, meta)
    (out / "bench_memory.md").write_text(text)
    table = Table(title="superneurons against the floor")
    for h in ("network", "batch", "none", "superneurons", "floor", "x floor"):
        table.add_column(h, justify="right")
    for r in plans:
        sn = r["policies"]["superneurons"]
        table.add_row(r["network"], str(r["batch"]), human_bytes(r["policies"]["none"]["peak_bytes"]),
                      human_bytes(sn["arena_bytes"]), human_bytes(r["floor_bytes"]),
                      f"{sn['arena_bytes'] / r['floor_bytes']:.2f}")
    console.print(table)
    console.print(text.split("Measured on this CPU")[1])


if __name__ == "__main__":
    main()
