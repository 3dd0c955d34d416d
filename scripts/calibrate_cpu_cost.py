"""Fit the CPU cost model's rates (snrt.scheduler.cost.CPU) to kernel times measured here.

Trains each network below for a few iterations under policy `none` on the NumPy backend,
timing every compute step (the executor's forward, backward and update handlers, wrapped),
and fits

    seconds = flops / flops_per_s + bytes / memory_bytes_per_s + step_overhead_s

over all timed steps by least squares with non-negative terms (each step's flops and bytes
from `layer.cost`, an update's bytes from `cost.update_bytes`). Prints and writes the fit,
the error per layer type, and the predicted against measured iteration time under the
current model and under the fitted one (results/cost_calibration.{json,md}).

    python scripts/calibrate_cpu_cost.py [--iterations 3]

The constants of `snrt.scheduler.cost.CPU` are a fit's output on the project's 2-core
reference machine, rounded; a plan is a function of its inputs only, so they are constants,
not measured at run time. The CPU backend's plans (kernels=CPU_KERNELS) also take each dense
convolution's step time from its chosen kernel's measurement, which a machine makes once and
keeps with the choice (snrt/backends/cpu_choice.py): the last column of the iteration table.
"""

import argparse
import itertools
import statistics
import time
from dataclasses import replace

import snrt  # noqa: F401  (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
import numpy as np
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, synthetic_config, table

from snrt.scheduler import cost as cost_models
from snrt.train import Trainer

# (config, image size, batch): the networks the speed and timeline figures train
NETWORKS = [("cifar_resnet110", 32, 16), ("resnet50", 224, 8), ("vgg16", 112, 4), ("densenet121", 112, 4)]
TIMED_KINDS = ("forward", "backward", "update")


def timed_run(name, size, batch, iterations):
    """[(step, seconds)] of the last iteration's compute steps, the graph, the plan, and the
    median wall seconds of the iterations after the first."""
    trainer = Trainer(synthetic_config(name, size, batch))
    executor = trainer.executor
    record = []

    def timed(step, action):
        def run():
            start = time.perf_counter()
            action()
            record.append((step, time.perf_counter() - start))
        return run

    executor.wrap_steps(TIMED_KINDS, timed)
    walls = []

    def clock(metrics):  # after every iteration: its seconds; the record restarts for the next
        walls.append(metrics.seconds)
        if len(walls) < iterations:
            record.clear()

    trainer.fit(iterations=iterations, on_iteration=clock)
    trainer.backend.close()
    return list(record), executor.graph, trainer.plan, statistics.median(walls[1:] or walls)


def features(step, graph, batch):
    """(flops, bytes, 1) of one compute step, as the cost model sees it."""
    c = cost_models.step_cost(step, graph, batch)
    return (c.flops, c.bytes, 1.0)


def fit(rows, seconds):
    """Non-negative least squares over three terms, by trying every subset of them."""
    best = None
    for keep in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (3, 2, 1)):
        coef, *_ = np.linalg.lstsq(rows[:, keep], seconds, rcond=None)
        if (coef < 0).any():
            continue
        residual = float(np.sum((rows[:, keep] @ coef - seconds) ** 2))
        if best is None or residual < best[0]:
            full = np.zeros(3)
            full[list(keep)] = coef
            best = (residual, full)
    flops_s, bytes_s, overhead = best[1]
    return cost_models.CostModel(flops_per_s=1 / flops_s if flops_s else float("inf"),
                                 memory_bytes_per_s=1 / bytes_s if bytes_s else float("inf"),
                                 copy_bytes_per_s=cost_models.CPU.copy_bytes_per_s, step_overhead_s=overhead)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=3, help="iterations per network (the first warms up)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    meta = machine()
    runs = []
    for name, size, batch in NETWORKS:
        record, graph, plan, wall = timed_run(name, size, batch, args.iterations)
        runs.append((name, size, batch, record, graph, plan, wall))
        print(f"{name} {size} b{batch}: {len(record)} steps timed, {wall:.2f} s per iteration", flush=True)
    rows = np.array([features(s, g, b) for _, _, b, rec, g, _, _ in runs for s, _ in rec], dtype=np.float64)
    seconds = np.array([t for *_, rec, _, _, _ in runs for _, t in rec])
    fitted = fit(rows, seconds)
    fitted = replace(fitted, flops_per_s=float(fitted.flops_per_s), memory_bytes_per_s=float(fitted.memory_bytes_per_s),
                     step_overhead_s=float(fitted.step_overhead_s))
    print(f"fitted: {fitted}", flush=True)

    by_type = {}
    for name, size, batch, rec, graph, plan, wall in runs:
        for step, t in rec:
            kind = graph[step.node].layer.type_name if step.kind != "update" else "update"
            c = cost_models.step_cost(step, graph, batch)
            entry = by_type.setdefault(f"{kind} {step.kind if step.kind != 'update' else ''}".strip(), [0.0, 0.0, 0.0])
            entry[0] += t
            entry[1] += cost_models.CPU.kernel_s(c)
            entry[2] += fitted.kernel_s(c)
    iterations = []
    for name, size, batch, rec, graph, plan, wall in runs:
        predicted = {label: cost_models.simulate(plan.steps, plan.buffers, [cost_models.step_seconds(s, graph, batch, m)
                                                                            for s in plan.steps], m)[0]
                     for label, m in (("current", cost_models.CPU), ("fitted", fitted))}
        iterations.append({"network": name, "image": size, "batch": batch, "measured_s": wall,
                           "timed_steps_s": sum(t for _, t in rec), "current_s": predicted["current"],
                           "fitted_s": predicted["fitted"], "plan_s": plan.predicted_s})
    result = {"meta": meta, "networks": NETWORKS, "iterations_per_network": args.iterations,
              "current": vars(cost_models.CPU), "fitted": vars(fitted), "by_layer": by_type, "per_network": iterations}
    save_json(args.out, "cost_calibration", result)
    lines = ["# CPU cost model calibration", "", meta_line(meta, False), "",
             "`seconds = flops / flops_per_s + bytes / memory_bytes_per_s + step_overhead_s`, fitted by "
             f"non-negative least squares to every forward, backward and update step of the last of {args.iterations} "
             "iterations of each network under policy none (`python scripts/calibrate_cpu_cost.py`).", ""]
    lines += table(["model", "flops/s", "memory bytes/s", "step overhead (us)"], [
        [label, f"{m.flops_per_s / 1e9:.1f} G", f"{m.memory_bytes_per_s / 1e9:.2f} G", f"{m.step_overhead_s * 1e6:.0f}"]
        for label, m in (("current (snrt.scheduler.cost.CPU)", cost_models.CPU), ("fitted here", fitted))])
    lines += ["", "Iteration seconds: measured (median wall time of a whole iteration after the first), the timed "
              "compute steps' sum, the prediction of each model from the layers' FLOPs and bytes alone, and the "
              "run's plan's own prediction: the current model, but each dense convolution's step the time its "
              "chosen kernel was measured to take (snrt/backends/cpu_choice.py, scaled to the batch).", ""]
    lines += table(["network", "image", "batch", "measured s", "steps s", "current model s", "fitted model s",
                    "plan s (measured convolutions)"], [
        [r["network"], r["image"], r["batch"], f"{r['measured_s']:.2f}", f"{r['timed_steps_s']:.2f}",
         f"{r['current_s']:.2f}", f"{r['fitted_s']:.2f}", f"{r['plan_s']:.2f}"] for r in iterations])
    lines += ["", "Per layer type, summed over all networks (seconds):", ""]
    lines += table(["layer", "measured", "current model", "fitted model", "fitted / measured"], [
        [k, f"{v[0]:.2f}", f"{v[1]:.2f}", f"{v[2]:.2f}", f"{v[2] / v[0]:.2f}"]
        for k, v in sorted(by_type.items(), key=lambda kv: -kv[1][0])])
    save_markdown(args.out, "cost_calibration", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
