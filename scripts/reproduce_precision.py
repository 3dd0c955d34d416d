"""What 2-byte storage saves: the planned peak of every zoo network in bf16 against fp32, and the
largest batch that fits 12 GiB.

Part 1: every network of configs/ at its file's batch and image size, under superneurons with
parameters and optimizer state streamed (resident fp32 masters and optimizer state do not
shrink, so they are streamed in both columns alike): the planned peak in fp32 and in bf16, and
their ratio.

Part 2: ResNet-50 and VGG-16 at 224x224 under superneurons, parameters resident: the largest batch
whose plan fits 12 GiB (just-in-time copies and spilled idle tensors where the own plan does
not fit, as make_plan does), in fp32 and in bf16 (`largest_fitting`, every probe a full plan).

Plans only (the CPU backend runs bf16 with fp32 staging, the last column of part 1; the CUDA
backend does not run it yet; on the CPU the staging outweighs the saving at a one-step peak).
Writes results/precision.{md,json,png}.

    python scripts/reproduce_precision.py [--quick]
"""

import time

from reproduce_common import (BUDGET, ROOT, arena_in_budget, gib, grouped_bars, largest_fitting, machine, meta_line,
                              parse_args, save_json, save_markdown, table)

import snrt
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.models import MODELS
from snrt.scheduler.planner import make_plan

PRECISIONS = ("fp32", "bf16")
LARGEST = [("resnet50", 224), ("vgg16", 224)]
QUICK_NETWORKS = ("lenet", "cifar_resnet20", "resnet50", "vgg16")


def peaks(names):
    """Part 1's rows."""
    rows = []
    for name in names:
        config = snrt.load_config(ROOT / "configs" / f"{name}.yaml")
        row = {"network": name, "batch": config.train.batch, "image": list(config.input.shape[1:])}
        for precision in PRECISIONS:
            start = time.perf_counter()
            plan = make_plan(config.graph, config.train.batch, "superneurons", stream_parameters=True,
                             precision=precision)
            row[precision] = plan.peak_bytes
            row[f"{precision}_fp32_at_peak"] = plan.peak_by_dtype().get("float32", 0)
            row[f"{precision}_peak_step"] = peak_step(plan)
            print(f"{name:18s} {precision}: peak {gib(plan.peak_bytes)} GiB ({time.perf_counter() - start:.1f} s)",
                  flush=True)
        row["ratio"] = row["bf16"] / row["fp32"]
        row["bf16_cpu"] = make_plan(config.graph, config.train.batch, "superneurons", stream_parameters=True,
                                    precision="bf16", kernels=CPU_KERNELS).peak_bytes
        rows.append(row)
    return rows


def peak_step(plan):
    """'kind node' of the plan's first step at its peak (a copy names its buffer)."""
    step = plan.steps[plan.device_bytes.index(plan.peak_bytes)]
    node = getattr(step, "node", None)
    return f"{step.kind} {node if node is not None else plan.buffers[step.buffer].name}"


def largest_batches(networks):
    """Part 2's rows."""
    rows = []
    for name, size in networks:
        graph = MODELS[name](image_size=size)
        row = {"network": name, "image": size}
        for precision in PRECISIONS:
            row[precision], _ = largest_fitting(
                lambda b: arena_in_budget(graph, b, "superneurons", BUDGET, precision=precision), BUDGET)
            print(f"{name} {precision}: largest batch in 12 GiB {row[precision]}", flush=True)
        row["ratio"] = row["bf16"] / row["fp32"]
        rows.append(row)
    return rows


def main():
    args = parse_args(__doc__).parse_args()
    names = QUICK_NETWORKS if args.quick else sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    meta = machine()
    peak_rows = peaks(names)
    batch_rows = largest_batches(LARGEST[:1] if args.quick else LARGEST)
    worst = max(peak_rows, key=lambda r: r["ratio"])
    save_json(args.out, "precision", {"meta": meta, "peaks": peak_rows, "largest_batch": batch_rows})
    grouped_bars(f"{args.out}/precision.png", [r["network"] for r in peak_rows], PRECISIONS,
                 {p: {r["network"]: r[p] / 2**20 for r in peak_rows} for p in PRECISIONS}, "planned peak (MiB)",
                 "planned peak under superneurons, parameters streamed: fp32 and bf16 storage", log=True)
    lines = ["# Half the bytes: planned peak and largest batch in bf16 against fp32", "",
             meta_line(meta, args.quick), "",
             "`python scripts/reproduce_precision.py" + (" --quick" if args.quick else "") + "`: plans. bf16 stores activations, their gradients and saved tensors in 2 bytes; "
             "parameters, optimizer state and normalization statistics stay fp32, the loss and softmax too.", "",
             "## Planned peak, superneurons, parameters streamed, each network at its file's batch", "",
             *table(["network", "batch", "fp32 peak (GiB)", "bf16 peak (GiB)", "bf16 / fp32",
                     "of the bf16 peak, in fp32 (GiB)", "bf16 peak step", "bf16 peak, CPU backend (GiB)"],
                    [[r["network"], r["batch"], gib(r["fp32"]), gib(r["bf16"]), f"{r['ratio']:.3f}",
                      gib(r["bf16_fp32_at_peak"]), r["bf16_peak_step"], gib(r["bf16_cpu"])] for r in peak_rows]),
             "", f"Largest ratio: {worst['ratio']:.3f}, {worst['network']} (target: at most 0.55), whose bf16 plan peaks at "
             f"its {worst['bf16_peak_step']} step with {gib(worst['bf16_fp32_at_peak'])} GiB in fp32. *Of the bf16 peak, "
             "in fp32* is "
             "what does not shrink at the bf16 plan's peak step: parameters, their gradients and optimizer state "
             "(fp32 masters, on the device while their layer's update runs), statistics and the loss. The planner's "
             "default kernel choice (used above, and by the largest batches below) computes on 2-byte tensors "
             "directly, as cuDNN's bf16 graphs do; the CPU backend's kernels compute in fp32 on copies staged in "
             "each step's workspace (snrt/layers/staging.py), which its plans reserve: the last column, larger than the "
             "fp32 peak where one step's working set is the peak (staging holds each array of the step twice). On "
             "the CPU bf16 is for training and testing what a GPU will run, not for memory.", "",
             "## Largest batch in 12 GiB, superneurons, parameters resident", "",
             *table(["network", "image", "fp32", "bf16", "bf16 / fp32"],
                    [[r["network"], r["image"], r["fp32"], r["bf16"], f"{r['ratio']:.2f}x"] for r in batch_rows]),
             "", "Target: at least 1.8x.", "", "![planned peak](precision.png)"]
    save_markdown(args.out, "precision", lines)


if __name__ == "__main__":
    main()
