"""The budget-optimal plans of `auto` against the fixed policies, at the same budget.

For each network, cost model and budget (from the smallest arena any policy needs up to the
arena of `liveness`), the table gives the fastest fixed policy that fits and its predicted
iteration time, and the plan `auto` chooses, which may be one grown from a policy's plan by
snrt/scheduler/optimal.py (named "optimal(<policy>)"): its arena, its predicted time and the
speed-up. Plans are exact on any device; the times are the cost model's predictions (CPU: the
calibrated model of this machine; CUDA: the model of a PCIe GPU, never measured here).

Writes results/budget_optimal.{md,json}.

    python scripts/reproduce_budget_optimal.py [--quick]
"""

import time

from reproduce_common import MIB, machine, meta_line, parse_args, save_json, save_markdown, synthetic_config, table

from snrt import POLICIES
from snrt.scheduler import cost
from snrt.scheduler.planner import each_plan, make_plan

FULL = [("resnet50", 128, 32), ("vgg16", 128, 32), ("densenet121", 128, 16), ("inceptionv4", 149, 16)]
QUICK = [("resnet50", 64, 8)]
FRACTIONS = (0.0, 0.1, 0.25, 0.5)
MODELS = {"cpu": cost.CPU, "cuda": cost.CUDA}


def rows_for(name, size, batch, model_name):
    """One row per budget fraction for configs/<name>.yaml at `size`, `batch`."""
    graph = synthetic_config(name, size, batch).graph
    model = MODELS[model_name]
    plans = dict(each_plan(graph, batch, POLICIES, cost_model=model))
    low = min(p.arena_bytes for p in plans.values())
    high = plans["liveness"].arena_bytes
    rows = []
    for fraction in FRACTIONS:
        budget = int(low + fraction * (high - low))
        fixed = min((p for p in plans.values() if p.arena_bytes <= budget), key=lambda p: p.predicted_s)
        start = time.perf_counter()
        chosen = make_plan(graph, batch, "auto", budget=budget, cost_model=model)
        seconds = time.perf_counter() - start
        rows.append({"network": name, "size": size, "batch": batch, "cost_model": model_name,
                     "budget_bytes": budget, "fraction": fraction,
                     "best_fixed": fixed.policy, "best_fixed_s": fixed.predicted_s,
                     "best_fixed_arena_bytes": fixed.arena_bytes,
                     "auto": chosen.policy, "auto_s": chosen.predicted_s, "auto_arena_bytes": chosen.arena_bytes,
                     "speedup": fixed.predicted_s / chosen.predicted_s, "planning_s": seconds})
        print(f"{name} {model_name} budget {budget / MIB:.1f} MiB: {fixed.policy} {fixed.predicted_s * 1e3:.1f} ms, "
              f"{chosen.policy} {chosen.predicted_s * 1e3:.1f} ms", flush=True)
    return rows


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    rows = [row for name, size, batch in (QUICK if args.quick else FULL) for model in MODELS
            for row in rows_for(name, size, batch, model)]
    save_json(args.out, "budget_optimal", {"meta": meta, "rows": rows})
    body = [[f"{r['network']} {r['size']}px b{r['batch']}", r["cost_model"], f"{r['fraction']:.0%}",
             f"{r['budget_bytes'] / MIB:.1f}", f"{r['best_fixed']} ({r['best_fixed_arena_bytes'] / MIB:.1f} MiB)",
             f"{r['best_fixed_s'] * 1e3:.1f}", f"{r['auto']} ({r['auto_arena_bytes'] / MIB:.1f} MiB)",
             f"{r['auto_s'] * 1e3:.1f}", f"{r['speedup']:.2f}x", f"{r['planning_s']:.1f}"] for r in rows]
    lines = ["# Budget-optimal plans against the fixed policies", "", meta_line(meta, args.quick), "",
             "Budget: the smallest arena of any policy plus the given fraction of the way to `liveness`'s arena. "
             "Fixed: the fastest of none/liveness/recompute/offload/superneurons (each with just-in-time prefetch "
             "too) whose arena fits. auto: the plan `snrt plan --policy auto` chooses; `optimal(P)` is grown from "
             "policy P's plan by keeping on the device the replayed segments and offloaded tensors that save the "
             "most predicted time in the room the budget leaves (snrt/scheduler/optimal.py). Times are the cost "
             "model's predictions per iteration (CUDA: a PCIe GPU's model, not measured); plans are exact.", "",
             *table(["network", "cost model", "budget point", "budget (MiB)", "fastest fixed policy that fits",
                     "its time (ms)", "auto's plan", "its time (ms)", "speed-up", "auto planning (s)"], body),
             "", f"`python scripts/reproduce_budget_optimal.py{' --quick' if args.quick else ''}`"]
    save_markdown(args.out, "budget_optimal", lines)


if __name__ == "__main__":
    main()
