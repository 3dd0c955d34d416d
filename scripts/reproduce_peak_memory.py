"""Peak device memory by technique (SuperNeurons' main figure), from plans and confirmed by runs.

Part 1, plans (exact for any device size): AlexNet (227), VGG-16 (224), ResNet-50/101/152 (224),
Inception-v4 (299), DenseNet-121 (224) and the YAML-only zoo entries (SE-ResNet-50, MobileNetV2,
EfficientNet-B0, ConvNeXt-T at 224, U-Net at 256) at the batch sizes below; the peak device bytes
under none / liveness / recompute / offload / superneurons next to the floor (resident bytes
plus the largest single step's working set, `floor_bytes` of scripts/bench_memory.py), and
superneurons with streamed parameters next to its own floor (`streamed_floor_bytes`); and
superneurons' plan at the smallest budget it works in (just-in-time copies, idle tensors
spilled), with parameters resident and streamed, against the same floors.

Part 2, measured on this CPU: at small sizes a short Trainer run per policy (and superneurons
with streamed parameters, and at its smallest budget), whose measured arena peak (trainer.backend.arena.peak_bytes) must
equal the plan's peak_bytes.

Writes results/peak_memory.{md,json,png}.

    python scripts/reproduce_peak_memory.py [--quick]
"""

import time

from reproduce_common import (GIB, POLICIES, floor_bytes, gib, grouped_bars, machine, meta_line,
                              parse_args, save_json, save_markdown, streamed_floor_bytes, synthetic_config, table)

from snrt.config import with_settings

from snrt.models import MODELS
from snrt.scheduler.planner import BudgetError, make_plan
from snrt.train import Trainer

# (network, image size, batch): SuperNeurons' Fig. of peak memory uses batch 32 for the deep
# networks; the two shallow ones (AlexNet, VGG-16) at 64, as vDNN and SuperNeurons report them.
NETWORKS = [("alexnet", 227, 64), ("vgg16", 224, 64), ("resnet50", 224, 32), ("resnet101", 224, 32),
            ("resnet152", 224, 32), ("inceptionv4", 299, 32), ("densenet121", 224, 32),
            ("se_resnet50", 224, 32), ("mobilenet_v2", 224, 32), ("efficientnet_b0", 224, 32),
            ("convnext_tiny", 224, 32), ("unet", 256, 16)]
QUICK_NETWORKS = [("alexnet", 227, 8), ("vgg16", 224, 8), ("resnet50", 224, 8), ("densenet121", 224, 8)]
# (config, image size, batch, iterations) of the measured runs
MEASURED = [("alexnet", 67, 4, 2), ("vgg16", 32, 4, 2), ("resnet50", 64, 2, 2), ("resnet101", 64, 1, 2),
            ("resnet152", 64, 1, 2), ("inceptionv4", 75, 2, 2), ("densenet121", 64, 2, 2),
            ("cifar_resnet20", 32, 8, 2), ("cifar_resnet110", 32, 4, 2), ("se_resnet50", 64, 2, 2),
            ("mobilenet_v2", 64, 2, 2), ("efficientnet_b0", 64, 2, 2), ("convnext_tiny", 64, 2, 2),
            ("unet", 64, 2, 2)]
QUICK_MEASURED = [("cifar_resnet20", 32, 8, 2), ("resnet50", 64, 2, 2)]
STREAMED = "superneurons, streamed"  # parameters and optimizer state streamed from the host store
SMALLEST = "superneurons, smallest budget"  # at the smallest budget: just-in-time copies, idle tensors spilled


def planned(networks):
    rows = []
    for name, size, batch in networks:
        graph = MODELS[name](image_size=size) if name in MODELS else synthetic_config(name, size, batch).graph
        row = {"network": name, "image": size, "batch": batch, "layers": len(graph),
               "floor_bytes": floor_bytes(graph, batch), "streamed_floor_bytes": streamed_floor_bytes(graph, batch),
               "policies": {}}
        for policy in POLICIES:
            start = time.perf_counter()
            plan = make_plan(graph, batch, policy)
            row["policies"][policy] = {"peak_bytes": plan.peak_bytes, "arena_bytes": plan.arena_bytes,
                                       "offloaded_bytes": plan.host_bytes, "predicted_s": plan.predicted_s,
                                       "plan_s": time.perf_counter() - start}
        row["streamed_peak_bytes"] = make_plan(graph, batch, "superneurons", stream_parameters=True).peak_bytes
        for key, streamed in (("smallest", False), ("streamed_smallest", True)):
            plan = smallest_plan(graph, batch, stream_parameters=streamed)
            row[key] = {"peak_bytes": plan.peak_bytes, "arena_bytes": plan.arena_bytes,
                        "predicted_s": plan.predicted_s, "copied_bytes": sum(plan.copied_bytes())}
        print(f"planned {name} at {size}, batch {batch}: " + ", ".join(
            f"{p} {gib(v['peak_bytes'])}" for p, v in row["policies"].items()) + f" GiB; floor {gib(row['floor_bytes'])}",
            flush=True)
        rows.append(row)
    return rows


def smallest_plan(graph, batch, **options):
    """superneurons' plan at the smallest budget its BudgetError states: just-in-time copies and
    the idle tensors spilled."""
    try:
        make_plan(graph, batch, "superneurons", budget=1, **options)
    except BudgetError as error:
        return make_plan(graph, batch, "superneurons", budget=error.smallest_bytes, **options)
    raise AssertionError("a budget of one byte fits")


def smallest_trainer(config):
    """A Trainer of `config` at the smallest budget its BudgetError states."""
    try:
        Trainer(with_settings(config, memory={"budget": 1}))
    except BudgetError as error:
        return Trainer(with_settings(config, memory={"budget": error.smallest_bytes}))
    raise AssertionError("a budget of one byte fits")


def measured(cases):
    rows = []
    for name, size, batch, iterations in cases:
        for policy in (*POLICIES, STREAMED, SMALLEST):
            config = synthetic_config(name, size, batch, policy if policy in POLICIES else "superneurons")
            if policy == SMALLEST:
                trainer = smallest_trainer(config)
            else:
                trainer = Trainer(with_settings(config, memory={"stream_parameters": policy == STREAMED}))
            history = trainer.fit(iterations=iterations)
            row = {"network": name, "image": size, "batch": batch, "policy": policy, "iterations": len(history),
                   "planned_peak_bytes": trainer.plan.peak_bytes,
                   "measured_peak_bytes": trainer.backend.arena.peak_bytes,
                   "arena_bytes": trainer.plan.arena_bytes, "loss": history[-1].loss}
            row["equal"] = row["planned_peak_bytes"] == row["measured_peak_bytes"]
            trainer.backend.close()
            print(f"measured {name} {size} batch {batch} {policy}: planned {row['planned_peak_bytes']} B, "
                  f"measured {row['measured_peak_bytes']} B -> {'equal' if row['equal'] else 'DIFFERENT'}", flush=True)
            rows.append(row)
    return rows


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    plans = planned(QUICK_NETWORKS if args.quick else NETWORKS)
    runs = measured(QUICK_MEASURED if args.quick else MEASURED)
    save_json(args.out, "peak_memory", {"meta": meta, "quick": args.quick, "plans": plans, "measured": runs})

    labels = [f"{r['network']}\nb{r['batch']}" for r in plans]
    values = {p: {lab: r["policies"][p]["peak_bytes"] / GIB for lab, r in zip(labels, plans)} for p in POLICIES}
    grouped_bars(f"{args.out}/peak_memory.png", labels, list(POLICIES), values, "peak device memory (GiB, log)",
                 "Peak device memory by technique (from plans)", log=True,
                 extra={"floor": [r["floor_bytes"] / GIB for r in plans]})

    lines = ["# Peak device memory by technique", "", meta_line(meta, args.quick), "",
             "From plans (`make_plan`, exact for any device). GiB; floor = resident bytes (parameters, "
             "momentum, BatchNorm state) + the largest single step's working set; `sn / floor` is "
             "superneurons' peak over the floor; `none / sn` the saving over the naive run. `sn streamed`: "
             "superneurons with parameters and momentum streamed from the host store; its floor no longer "
             "counts them as resident: BatchNorm state + the largest single step's whole working set (the "
             "parameters and momentum it touches included; for a fused update, weight, gradient, momentum "
             "and workspace).", ""]
    lines += table(["network", "image", "batch", "layers", *POLICIES, "floor", "sn / floor", "none / sn",
                    "sn streamed", "streamed floor", "sn streamed / streamed floor"], [
        [r["network"], r["image"], r["batch"], r["layers"], *(gib(r["policies"][p]["peak_bytes"]) for p in POLICIES),
         gib(r["floor_bytes"]), f"{r['policies']['superneurons']['peak_bytes'] / r['floor_bytes']:.2f}",
         f"{r['policies']['none']['peak_bytes'] / r['policies']['superneurons']['peak_bytes']:.1f}x",
         gib(r["streamed_peak_bytes"]), gib(r["streamed_floor_bytes"]),
         f"{r['streamed_peak_bytes'] / r['streamed_floor_bytes']:.2f}"] for r in plans])
    lines += ["", "### At the smallest budget", "",
              "superneurons' plan at the smallest budget its BudgetError states (`snrt plan --budget` below "
              "that says it): prefetches just in time and the tensors idle at the fullest steps spilled to "
              "the host and back (snrt/scheduler/spill.py), with parameters resident and streamed. Peak and "
              "arena over the floor of the same kind; `copies`: bytes copied between host and device per "
              "iteration (both ways); `time`: the CPU cost model's prediction against superneurons' "
              "unbudgeted plan.", ""]
    lines += table(["network", "batch", "peak / floor", "arena / floor", "copies (GiB)", "time vs superneurons",
                    "streamed peak / streamed floor", "streamed arena / streamed floor", "streamed copies (GiB)"], [
        [r["network"], r["batch"], f"{r['smallest']['peak_bytes'] / r['floor_bytes']:.3f}",
         f"{r['smallest']['arena_bytes'] / r['floor_bytes']:.3f}", gib(r["smallest"]["copied_bytes"]),
         f"{r['smallest']['predicted_s'] / r['policies']['superneurons']['predicted_s']:.2f}x",
         f"{r['streamed_smallest']['peak_bytes'] / r['streamed_floor_bytes']:.3f}",
         f"{r['streamed_smallest']['arena_bytes'] / r['streamed_floor_bytes']:.3f}",
         gib(r["streamed_smallest"]["copied_bytes"])] for r in plans])
    lines += ["", "![peak memory](peak_memory.png)", "",
              "## Confirmed by measurement", "",
              "A short `Trainer` run per policy on this CPU (synthetic data): the arena's measured peak "
              "(`trainer.backend.arena.peak_bytes`) against the plan's `peak_bytes`, in bytes.", ""]
    lines += table(["network", "image", "batch", "policy", "iterations", "planned peak (B)", "measured peak (B)", "equal"], [
        [r["network"], r["image"], r["batch"], r["policy"], r["iterations"], r["planned_peak_bytes"],
         r["measured_peak_bytes"], "yes" if r["equal"] else "**NO**"] for r in runs])
    save_markdown(args.out, "peak_memory", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
