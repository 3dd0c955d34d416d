"""The largest batch per network and policy in a 12 GiB budget, and vDNN's VGG-16 at batch 256.

Part 1: for each network at its paper image size and each policy, the largest batch whose
plan's arena (`make_plan(...).arena_bytes`) fits 12 GiB, found by a search
over the batch (`largest_fitting` in reproduce_common.py; every probe is a full plan).

Part 2, vDNN's case: VGG-16 (224x224) at batch 256, which vDNN reports needs about 28 GB when every tensor
is kept: its peak under `none` against the arena of every policy, and whether it fits 12 GiB.

Writes results/largest_batch.{md,json,png}.

    python scripts/reproduce_largest_batch.py [--quick]
"""

import time

from reproduce_common import (BUDGET, POLICIES, arena_in_budget, floor_bytes, gib, grouped_bars, largest_fitting,
                              machine, meta_line, parse_args, save_json, save_markdown, table)

from snrt.models import MODELS
from snrt.scheduler.planner import BudgetError, make_plan

NETWORKS = [("alexnet", 227), ("vgg16", 224), ("resnet50", 224), ("resnet101", 224), ("resnet152", 224),
            ("inceptionv4", 299), ("densenet121", 224)]
QUICK_NETWORKS = [("alexnet", 227), ("vgg16", 224), ("resnet50", 224)]
VDNN_BATCH = 256
SPILLED = "superneurons, spilled"  # what make_plan does under the budget: idle tensors spilled too
STREAMED = "superneurons, streamed"  # and parameters and momentum streamed from the host store


def largest(networks, policies):
    rows = []
    for name, size in networks:
        graph = MODELS[name](image_size=size)
        row = {"network": name, "image": size, "policies": {}}
        for policy in policies:
            start = time.perf_counter()
            plan_as = policy if policy in POLICIES else "superneurons"
            stream, spill = policy == STREAMED, policy not in POLICIES
            batch, probes = largest_fitting(lambda b: arena_in_budget(graph, b, plan_as, BUDGET, stream, spill),
                                            BUDGET, start=(16, 32))
            row["policies"][policy] = {"batch": batch, "arena_bytes": probes.get(batch), "plans": len(probes),
                                       "plan_seconds": time.perf_counter() - start}
            print(f"{name} {policy}: largest batch {batch} ({len(probes)} plans, "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)
        row["floor_batch"], _ = largest_fitting(lambda b: floor_bytes(graph, b), BUDGET, start=(16, 32))
        rows.append(row)
    return rows


def vdnn_case():
    graph = MODELS["vgg16"](image_size=224)
    result = {}
    for policy in POLICIES:
        plan = make_plan(graph, VDNN_BATCH, policy)  # no budget: prefetches hidden behind compute
        result[policy] = {"peak_bytes": plan.peak_bytes, "arena_bytes": plan.arena_bytes,
                          "offloaded_bytes": plan.host_bytes, "predicted_s": plan.predicted_s}
        try:  # with the budget: make_plan falls back to just-in-time prefetches if it must
            fitted = make_plan(graph, VDNN_BATCH, policy, budget=BUDGET)
            result[policy].update(fits=True, budget_arena_bytes=fitted.arena_bytes,
                                  budget_offloaded_bytes=fitted.host_bytes, budget_predicted_s=fitted.predicted_s)
        except BudgetError as error:
            result[policy].update(fits=False, smallest_budget_bytes=error.smallest_bytes,
                                  largest_batch=error.largest_batch)
        print(f"VGG-16 batch {VDNN_BATCH} {policy}: {result[policy]}", flush=True)
    return result


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    vdnn = vdnn_case()
    rows = largest(QUICK_NETWORKS if args.quick else NETWORKS, (*POLICIES, SPILLED, STREAMED))
    save_json(args.out, "largest_batch", {"meta": meta, "quick": args.quick, "budget_bytes": BUDGET,
                                          "rows": rows, "vdnn_vgg16_256": vdnn})
    groups = [r["network"] for r in rows]
    values = {p: {r["network"]: r["policies"][p]["batch"] for r in rows} for p in POLICIES}
    grouped_bars(f"{args.out}/largest_batch.png", groups, list(POLICIES), values, "largest batch (log)",
                 "Largest batch that fits 12 GiB (from plans)", log=True)
    lines = ["# Largest batch in 12 GiB", "", meta_line(meta, args.quick), "",
             "The largest batch whose planned arena fits 12 GiB, per network (at its paper image size) "
             "and policy, found by `largest_fitting` (reproduce_common.py), every probe a full `make_plan`. "
             "The policies' columns are their own plans (prefetches hidden, else just in time); "
             f"`{SPILLED}` is what `make_plan(..., budget=12 GiB)` does beyond them: the tensors idle at the "
             "fullest steps spilled to the host and back (snrt/scheduler/spill.py; every freeing policy does "
             f"it under a budget); `{STREAMED}`: that with parameters and "
             "momentum streamed from the host store too (`stream_parameters`). `auto` picks the fastest plan "
             "that fits, so its largest batch is the largest of the row. `floor bound`: the largest batch "
             "whose floor (resident bytes + the largest step's working set) fits, by the same search.", ""]
    lines += table(["network", "image", *POLICIES, SPILLED, STREAMED, "floor bound", "superneurons / none",
                    "streamed / offload"], [
        [r["network"], r["image"], *(r["policies"][p]["batch"] for p in (*POLICIES, SPILLED, STREAMED)),
         r["floor_batch"], f"{r['policies']['superneurons']['batch'] / r['policies']['none']['batch']:.1f}x"
         if r["policies"]["none"]["batch"] else "-",
         f"{r['policies'][STREAMED]['batch'] / r['policies']['offload']['batch']:.2f}x"] for r in rows])
    lines += ["", "![largest batch](largest_batch.png)", "",
              f"## vDNN's case: VGG-16 at batch {VDNN_BATCH}", "",
              "Peak device bytes and arena per policy without a budget (1 GB = 10^9 B, the vDNN paper's unit; "
              "GiB = 2^30 B), then `make_plan(..., budget=12 GiB)`: the arena it plans inside the budget "
              "(copying policies fall back to just-in-time prefetches when the hidden ones do not fit, and "
              "freeing policies then spill idle tensors), or its BudgetError's smallest budget and largest "
              "batch.", ""]
    lines += table(["policy", "peak (GB)", "arena (GiB)", "offloaded (GiB)", "fits 12 GiB", "arena in budget (GiB)",
                    "predicted s/it (CPU model)", "smallest budget (GiB)", "largest batch in 12 GiB"], [
        [p, f"{v['peak_bytes'] / 1e9:.1f}", gib(v["arena_bytes"]), gib(v["offloaded_bytes"]),
         "yes" if v["fits"] else "no", gib(v["budget_arena_bytes"]) if v["fits"] else "-",
         f"{v['budget_predicted_s'] if v['fits'] else v['predicted_s']:.1f}",
         gib(v["smallest_budget_bytes"]) if not v["fits"] else "-",
         v.get("largest_batch", ">= 256")] for p, v in vdnn.items()])
    save_markdown(args.out, "largest_batch", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
