"""The deepest trainable ImageNet ResNet in a 12 GiB budget, per policy (SuperNeurons' ResNet2500).

Bottleneck ResNets at 227x227 scaled like the SuperNeurons paper's ResNet2500: stages
(6, 32, k, 6) with k, the stage-3 block count, searched (`largest_fitting` in
reproduce_common.py) for the largest k whose plan's arena (`make_plan(..., budget=12 GiB)`,
see `arena_in_budget`) fits 12 GiB; depth = 3 * (6 + 32 + k + 6) + 2. ResNet2500 itself
(k = 788) is always planned and reported with its arena, and the deepest network's resident
bytes (parameters, momentum, BatchNorm state) beside its arena. Then, with parameters and
momentum streamed from the host store (`stream_parameters`), the arena of k = 788, 1372 and
3320 (10,094 layers) under offload and superneurons, and the host store each needs.

Writes results/deepest_resnet.{md,json,png}.

    python scripts/reproduce_deepest_resnet.py [--quick]   # quick: liveness and superneurons, batch 16

Quick mode takes about 3 minutes, full mode about 15 (a superneurons plan near k = 1,400 takes
half a minute or more, and its just-in-time fallback as long again).
"""

import time

from reproduce_common import (BUDGET, POLICIES, arena_in_budget, gib, grouped_bars, largest_fitting, machine,
                              meta_line, parse_args, resident_bytes, save_json, save_markdown, table)

from snrt.models import resnet
from snrt.scheduler.planner import make_plan

IMAGE = 227
FIXED = (6, 32, 6)  # stages 1, 2 and 4 of ResNet2500
K2500 = 788
SMALL_K = 100  # the second starting probe of the search (cheap to plan)
STREAMED_K = (788, 1372, 3320)  # ResNet2500, the deepest resident plan above, and 10,094 layers
# Chen et al.'s case: a 1,000-layer ResNet; here bottleneck stages (3, 4, 323, 3) = 1,001 layers
CHEN_STAGES, CHEN_IMAGE, CHEN_BATCH = (3, 4, 323, 3), 224, 32


def stages(k):
    return (FIXED[0], FIXED[1], k, FIXED[2])


def depth(k):
    return 3 * sum(stages(k)) + 2


def arena(k, batch, policy, timings):
    start = time.perf_counter()
    arena_bytes = arena_in_budget(resnet(stages=stages(k), image_size=IMAGE), batch, policy, BUDGET)
    timings.append(time.perf_counter() - start)
    return arena_bytes


def streamed_rows(batch=16):
    """The plans of STREAMED_K under offload and superneurons with streamed parameters."""
    rows = []
    for k in STREAMED_K:
        graph = resnet(stages=stages(k), image_size=IMAGE)
        for policy in ("offload", "superneurons"):
            start = time.perf_counter()
            plan = make_plan(graph, batch, policy, budget=BUDGET, stream_parameters=True)
            seconds = time.perf_counter() - start
            rows.append({"k": k, "depth": depth(k), "policy": policy, "arena_bytes": plan.arena_bytes,
                         "resident_bytes": sum(b.nbytes for b in plan.buffers if b.resident),
                         "host_bytes": plan.host_bytes, "copied_bytes": sum(plan.copied_bytes()),
                         "plan_seconds": seconds})
            print(f"streamed k={k} ({depth(k)} layers) {policy}: arena {gib(plan.arena_bytes)} GiB, host "
                  f"{gib(plan.host_bytes)} GiB, {seconds:.0f} s", flush=True)
    return rows


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    batches = (16,) if args.quick else (16, 32)
    policies = ("liveness", "superneurons") if args.quick else POLICIES
    rows = []
    for batch in batches:
        for policy in policies:
            timings = []
            print(f"batch {batch}, {policy}:", flush=True)
            k, probes = largest_fitting(lambda n: arena(n, batch, policy, timings), BUDGET,
                                        start=(SMALL_K, K2500), log=lambda s: print(s, flush=True))
            resnet2500 = probes[K2500] if K2500 in probes else arena(K2500, batch, policy, timings)
            rows.append({"batch": batch, "policy": policy, "k": k, "stages": stages(k) if k else None,
                         "depth": depth(k) if k else None, "arena_bytes": probes.get(k),
                         "resident_bytes": resident_bytes(resnet(stages=stages(k), image_size=IMAGE)) if k else None,
                         "resnet2500_arena_bytes": resnet2500, "resnet2500_fits": resnet2500 <= BUDGET,
                         "probes": {str(n): b for n, b in sorted(probes.items())},
                         "plans": len(timings), "plan_seconds": sum(timings)})
            print(f"  -> k={k}, depth {rows[-1]['depth']}, {len(timings)} plans in {sum(timings):.0f} s", flush=True)
    streamed = [] if args.quick else streamed_rows()
    chen = {"stages": CHEN_STAGES, "depth": 3 * sum(CHEN_STAGES) + 2, "image": CHEN_IMAGE, "batch": CHEN_BATCH,
            "policies": {}}
    graph = resnet(stages=CHEN_STAGES, image_size=CHEN_IMAGE)
    for policy in (("none", "recompute", "superneurons") if args.quick else POLICIES):
        plan = make_plan(graph, CHEN_BATCH, policy)
        chen["policies"][policy] = {"peak_bytes": plan.peak_bytes, "arena_bytes": plan.arena_bytes,
                                    "offloaded_bytes": plan.host_bytes}
        print(f"ResNet-{chen['depth']} batch {CHEN_BATCH} {policy}: peak {plan.peak_bytes / 1e9:.1f} GB", flush=True)
    save_json(args.out, "deepest_resnet", {"meta": meta, "quick": args.quick, "budget_bytes": BUDGET,
                                           "image": IMAGE, "rows": rows, "streamed": streamed,
                                           "chen_1000_layer": chen})

    groups = list(policies)
    series = [f"batch {b}" for b in batches]
    values = {f"batch {r['batch']}": {} for r in rows}
    for r in rows:
        values[f"batch {r['batch']}"][r["policy"]] = r["depth"] or 0
    grouped_bars(f"{args.out}/deepest_resnet.png", groups, series, values, "layers (3 x blocks + 2)",
                 "Deepest bottleneck ResNet (6, 32, k, 6) at 227x227 in 12 GiB", hline=(depth(K2500), "ResNet2500"))
    lines = ["# Deepest trainable ResNet in 12 GiB", "", meta_line(meta, args.quick), "",
             f"Bottleneck ResNet at {IMAGE}x{IMAGE}, stages (6, 32, k, 6); the largest k whose planned arena "
             f"fits 12 GiB ({BUDGET} B; for offload and superneurons with just-in-time prefetches where the hidden ones do not fit, then for every freeing policy with idle tensors spilled, as `make_plan(..., budget=)` does), found by `largest_fitting` (reproduce_common.py; every probe is a full "
             "`make_plan`); depth = 3 x blocks + 2; resident = parameters, momentum and BatchNorm state, on the "
             f"device for the whole run. ResNet2500 is k = {K2500} ({depth(K2500):,} layers).", ""]
    lines += table(["batch", "policy", "largest k", "stages", "depth", "arena at k (GiB)", "of which resident (GiB)",
                    "ResNet2500 arena (GiB)", "ResNet2500 fits", "plans", "planning s"], [
        [r["batch"], r["policy"], r["k"] or "none fits", r["stages"] or "-", r["depth"] or "-",
         gib(r["arena_bytes"]) if r["arena_bytes"] else "-", gib(r["resident_bytes"]) if r["resident_bytes"] else "-",
         gib(r["resnet2500_arena_bytes"]),
         "yes" if r["resnet2500_fits"] else "no", r["plans"], f"{r['plan_seconds']:.0f}"] for r in rows])
    lines += ["", "![deepest ResNet](deepest_resnet.png)", ""]
    if streamed:
        lines += ["## With streamed parameters", "",
                  "The same networks at batch 16 with `stream_parameters`: parameters and momentum live in the host "
                  "store and come to the device only while a step uses them, so resident bytes are BatchNorm "
                  "statistics alone and the arena stops growing with depth. What bounds depth then is the host store "
                  "(every parameter, its momentum and every offloaded checkpoint: it grows linearly with depth) and "
                  "planning time.", ""]
        lines += table(["k", "depth", "policy", "arena (GiB)", "resident (GiB)", "fits 12 GiB", "host store (GiB)",
                        "copied per iteration (GiB)", "planning s"], [
            [r["k"], f"{r['depth']:,}", r["policy"], gib(r["arena_bytes"]), gib(r["resident_bytes"]),
             "yes" if r["arena_bytes"] <= BUDGET else "no", gib(r["host_bytes"]), gib(r["copied_bytes"]),
             f"{r['plan_seconds']:.0f}"] for r in streamed])
        lines += [""]
    lines += [
              f"## Chen et al.'s case: a {chen['depth']}-layer ResNet", "",
              f"Bottleneck stages {CHEN_STAGES} at {CHEN_IMAGE}x{CHEN_IMAGE}, batch {CHEN_BATCH}: planned peak "
              "device bytes per policy (GB = 10^9 B, as the paper writes it).", ""]
    lines += table(["policy", "peak (GB)", "arena (GB)", "offloaded (GB)"], [
        [p, f"{v['peak_bytes'] / 1e9:.1f}", f"{v['arena_bytes'] / 1e9:.1f}", f"{v['offloaded_bytes'] / 1e9:.1f}"]
        for p, v in chen["policies"].items()])
    save_markdown(args.out, "deepest_resnet", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
