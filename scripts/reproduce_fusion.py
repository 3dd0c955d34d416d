"""What fusion (each BatchNorm or Add and the ReLU after it as one node, train.fuse) saves: planned
peaks of the zoo, and training time and peak measured on this CPU, fused against unfused.

Part 1, plans (exact for any device): each network below at its image size and batch, the
peak device bytes under none, liveness and superneurons planned with fuse true and false, and
how many nodes fusion folded.

Part 2, measured on this CPU: a Trainer of each network below with fuse true and one with fuse
false, built in one process on the same batch, their iterations alternated (so a drift of a
shared machine's speed slows both alike); the median seconds of an iteration, the seconds per
iteration of the steps fusion touches (BatchNorm, Add, ReLU and the fused nodes, forward and
backward, timed one by one), the measured peak (which equals the planned one), and whether the
losses agree bit for bit.

Writes results/fusion.{md,json}.

    python scripts/reproduce_fusion.py [--quick]
"""

import os
import statistics
import time

import snrt  # noqa: F401  (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
import numpy as np
from reproduce_common import (MIB, gib, machine, meta_line, parse_args, save_json, save_markdown, synthetic_config,
                              table)

from snrt.config import with_settings
from snrt.scheduler.fuse import fuse_layers
from snrt.scheduler.planner import each_plan
from snrt.train import Trainer

POLICIES = ("none", "liveness", "superneurons")
TOUCHED = ("BatchNorm", "Add", "ReLU", "BatchNormReLU", "AddReLU")  # the layers fusion folds, and its nodes
PLANNED = [("cifar_resnet110", 32, 128), ("resnet50", 224, 32), ("resnet152", 224, 32), ("densenet121", 224, 32),
           ("mobilenet_v2", 224, 32), ("efficientnet_b0", 224, 32), ("convnext_tiny", 224, 32), ("unet", 256, 16),
           ("vgg16", 224, 64), ("resnet2500", 227, 16)]
QUICK_PLANNED = [("cifar_resnet110", 32, 32), ("resnet50", 112, 8)]
MEASURED = [("cifar_resnet110", 32, 32, 12), ("resnet50", 112, 8, 8)]  # (network, size, batch, rounds)
QUICK_MEASURED = [("cifar_resnet20", 32, 16, 4)]
NOTE = ("Where superneurons (and offload) peak higher fused, the step that holds more is a convolution's "
        "backward: the fused node's input, prefetched for its backward, is on its way during the "
        "convolution's backward before it, where unfused it could arrive during ReLU's small backward. Under "
        "a budget the planner prefetches just in time instead. An AddReLU's backward holds y and gy alone "
        "where ReLU's held y, gy and its input gradient: the masked gradient is written over gy and handed "
        "to both inputs (where its step is the last to read gy, as in a chain of residual blocks).")


def planned_rows(networks):
    rows = []
    for name, size, batch in networks:
        graph = synthetic_config(name, size, batch).graph
        peaks = {fuse: {policy: plan.peak_bytes for policy, plan in each_plan(graph, batch, POLICIES, fuse=fuse)}
                 for fuse in (False, True)}
        folded = len(graph.nodes) - len(fuse_layers(graph).nodes)
        rows.append({"network": name, "image": size, "batch": batch, "nodes": len(graph.nodes), "folded": folded,
                     "unfused": peaks[False], "fused": peaks[True]})
        print(name, {p: f"{peaks[True][p] / peaks[False][p]:.3f}" for p in POLICIES}, flush=True)
    return rows


def time_touched_steps(trainer):
    """Time the trainer's forward and backward steps of the layers in TOUCHED one by one; the
    returned one-element list accumulates their seconds."""
    total = [0.0]
    graph = trainer.executor.graph

    def timed(step, action):
        if graph[step.node].layer.type_name not in TOUCHED:
            return action

        def run():
            start = time.perf_counter()
            action()
            total[0] += time.perf_counter() - start
        return run

    trainer.executor.wrap_steps(("forward", "backward", "recompute"), timed)
    return total


def measured_row(name, size, batch, rounds):
    config = synthetic_config(name, size, batch)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, *config.input.shape)).astype(np.float32)
    y = rng.integers(0, config.input.classes, batch)
    trainers = {fuse: Trainer(with_settings(config, train={"fuse": fuse})) for fuse in (False, True)}
    touched_s = {fuse: time_touched_steps(trainer) for fuse, trainer in trainers.items()}
    seconds, losses = {fuse: [] for fuse in trainers}, {fuse: [] for fuse in trainers}
    load_before = os.getloadavg()[0]
    for r in range(2 + rounds):  # two warm-up iterations each
        if r == 2:
            for total in touched_s.values():
                total[0] = 0.0
        order = list(trainers.items()) if r % 2 == 0 else list(reversed(trainers.items()))
        for fuse, trainer in order:
            metrics = trainer.step(x, y, 2 + rounds)
            losses[fuse].append(metrics.loss)
            if r >= 2:
                seconds[fuse].append(metrics.seconds)
    row = {"network": name, "image": size, "batch": batch, "rounds": rounds, "load": [load_before, os.getloadavg()[0]],
           "same_losses": losses[False] == losses[True]}
    for fuse, trainer in trainers.items():
        key = "fused" if fuse else "unfused"
        row[key] = {"median_s": statistics.median(seconds[fuse]), "seconds": seconds[fuse],
                    "touched_s": touched_s[fuse][0] / rounds,
                    "steps": len(trainer.plan.steps), "planned_peak": trainer.plan.peak_bytes,
                    "measured_peak": trainer.backend.arena.peak_bytes}
        trainer.backend.close()
    print(name, row["unfused"]["median_s"], row["fused"]["median_s"], row["same_losses"], flush=True)
    return row


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    planned = planned_rows(QUICK_PLANNED if args.quick else PLANNED)
    measured = [measured_row(*case) for case in (QUICK_MEASURED if args.quick else MEASURED)]
    save_json(args.out, "fusion", {"meta": meta, "planned": planned, "measured": measured})
    lines = ["# Fusion: a BatchNorm or an Add and its ReLU as one node", "", meta_line(meta, args.quick), "",
             "`python scripts/reproduce_fusion.py`. Each ReLU that alone reads a BatchNorm's or an Add's output "
             "is planned as part of it (snrt/scheduler/fuse.py): one step each way, the tensor between and its "
             "gradient never planned; BatchNormReLU saves only the BatchNorm's input, AddReLU its output (as the "
             "ReLU did) and masks the gradient in place.", "",
             "## Planned peak (GiB), unfused -> fused", ""]
    lines += table(["network", "image", "batch", "nodes folded", *POLICIES, "fused / unfused"], [
        [r["network"], r["image"], r["batch"], f"{r['folded']} of {r['nodes']}",
         *(f"{gib(r['unfused'][p])} -> {gib(r['fused'][p])}" for p in POLICIES),
         " / ".join(f"{r['fused'][p] / r['unfused'][p]:.2f}" for p in POLICIES)] for r in planned])
    lines += ["", "## Measured on this CPU (iterations alternated in one process)", ""]
    lines += table(["network", "image", "batch", "unfused s/iter", "fused s/iter", "fused / unfused",
                    "BatchNorm, Add and ReLU steps ms/iter", "steps", "peak MiB (measured = planned)", "same losses",
                    "load"], [
        [r["network"], r["image"], r["batch"], f"{r['unfused']['median_s']:.3f}", f"{r['fused']['median_s']:.3f}",
         f"{r['fused']['median_s'] / r['unfused']['median_s']:.3f}",
         f"{1e3 * r['unfused']['touched_s']:.1f} -> {1e3 * r['fused']['touched_s']:.1f}",
         f"{r['unfused']['steps']} -> {r['fused']['steps']}",
         f"{r['unfused']['measured_peak'] / MIB:.1f} -> {r['fused']['measured_peak'] / MIB:.1f}"
         + ("" if all(r[k]["measured_peak"] == r[k]["planned_peak"] for k in ("fused", "unfused")) else " (differs!)"),
         "yes" if r["same_losses"] else "no", f"{r['load'][0]:.2f} -> {r['load'][1]:.2f}"] for r in measured])
    lines += ["", NOTE]
    save_markdown(args.out, "fusion", lines)


if __name__ == "__main__":
    main()
