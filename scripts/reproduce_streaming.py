"""Training with a device budget smaller than the parameters: streamed parameters and
optimizer state, on the CPU.

ResNet-152 (60 M parameters: 232 MiB of weights and as much momentum) at 32x32 on synthetic
data trains for a few iterations under `none` (everything resident, the reference), under
`superneurons` (activations recomputed and offloaded; parameters resident), and under
`superneurons` with `memory.stream_parameters` in a budget below the parameters' own size.
Each run is checked: the losses and every parameter, momentum and BatchNorm statistic after
the last iteration equal the reference's bit for bit, and the measured peak device bytes
equal the planned peak. Reported: peak, host store, bytes copied per iteration, seconds per
iteration (median after the first) and the overhead against `none`.

Writes results/streaming.{md,json}.

    python scripts/reproduce_streaming.py [--quick]   # quick: ResNet-50, 2 iterations
"""

import statistics
import time

import snrt  # noqa: F401  (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
import numpy as np
from reproduce_common import gib, machine, meta_line, parse_args, save_json, save_markdown, synthetic_config, table

from snrt.config import with_settings
from snrt.summary import human_bytes
from snrt.train import Trainer

MIB = 2**20


def run(config, iterations):
    """(Trainer after `iterations`, losses, seconds per iteration)."""
    trainer = Trainer(config)
    seconds, losses = [], []
    for m in trainer.fit(iterations=iterations):
        seconds.append(m.seconds)
        losses.append(m.loss)
    return trainer, losses, seconds


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    name, iterations = ("resnet50", 2) if args.quick else ("resnet152", 4)
    base = synthetic_config(name, 32, 4)
    reference, ref_losses, ref_seconds = run(base, iterations)
    ref_arrays = reference.host_arrays()
    params = sum(b.nbytes for b in reference.plan.buffers if b.role == "parameter")
    budget = int(params * 0.75) // MIB * MIB
    cases = [("none", base),
             ("superneurons", with_settings(base, memory={"policy": "superneurons"})),
             ("superneurons, streamed", with_settings(base, memory={"policy": "superneurons",
                                                                    "stream_parameters": True, "budget": budget}))]
    rows, data = [], []
    for label, config in cases:
        print(f"{name}: {label} ...", flush=True)
        if label == "none":
            trainer, losses, seconds = reference, ref_losses, ref_seconds
        else:
            trainer, losses, seconds = run(config, iterations)
        arrays = trainer.host_arrays()
        identical = losses == ref_losses and all(np.array_equal(arrays[k], v) for k, v in ref_arrays.items())
        plan = trainer.plan
        to_host, to_device = plan.copied_bytes()
        per_iteration = statistics.median(seconds[1:] or seconds)
        stats = trainer.executor.copy_stats
        stalled = stats["stalled_s"] / iterations  # the compute stream waiting for copies, per iteration
        entry = {"case": label, "peak_bytes": plan.peak_bytes, "measured_peak_bytes": trainer.backend.arena.peak_bytes,
                 "budget_bytes": config.memory.budget, "host_bytes": plan.host_bytes,
                 "copied_to_host_bytes": to_host, "copied_to_device_bytes": to_device,
                 "seconds_per_iteration": per_iteration, "stalled_s_per_iteration": stalled,
                 "copy_s_per_iteration": stats["copy_s"] / iterations, "identical_to_none": identical,
                 "losses": losses}
        data.append(entry)
        rows.append([label, human_bytes(entry["peak_bytes"]),
                     "yes" if entry["measured_peak_bytes"] == entry["peak_bytes"] else "NO",
                     human_bytes(config.memory.budget) if config.memory.budget else "-",
                     human_bytes(plan.host_bytes), f"{human_bytes(to_host)} / {human_bytes(to_device)}",
                     f"{per_iteration:.2f}", f"{per_iteration / statistics.median(ref_seconds[1:] or ref_seconds):.2f}x",
                     f"{stats['copy_s'] / iterations:.2f} / {stalled:.2f}",
                     "yes" if identical else "NO"])
        trainer.backend.close()
    lines = [
        f"# Training in a budget smaller than the parameters ({name})", "",
        meta_line(meta, args.quick), "",
        f"{name} at 32x32, batch 4, synthetic data, {iterations} iterations, SGD with momentum. Parameters: "
        f"{human_bytes(params)} ({gib(params)} GiB), and as much momentum. The streamed run's budget is "
        f"{human_bytes(budget)}, three quarters of the parameters alone. Identical: the losses and every "
        "parameter, momentum and BatchNorm statistic after the last iteration equal `none`'s bit for bit. "
        "Seconds per iteration: the median after the first; overhead against `none`. Copying: seconds the "
        "copy threads spent copying, per iteration (they run beside the compute); waited: seconds the compute "
        "stream stood still for copies, per iteration.", "",
        *table(["case", "planned peak", "measured = planned", "budget", "host store", "copied out / in per iteration",
                "s / iteration", "vs none", "copying / waited for copies (s / iteration)", "identical"], rows),
        "", f"`python scripts/reproduce_streaming.py{' --quick' if args.quick else ''}`",
    ]
    save_markdown(args.out, "streaming", lines)
    save_json(args.out, "streaming", {"meta": meta, "network": name, "parameter_bytes": params, "budget": budget,
                                      "cases": data})


if __name__ == "__main__":
    main()
