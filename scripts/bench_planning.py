"""How long planning takes: make_plan of ResNet-2500 (configs/resnet2500.yaml, 8,337 nodes) at
batch 16 under every policy, then superneurons in a 12 GiB budget: the plans `snrt plan
configs/resnet2500.yaml --batch 16 --budget 12GiB` makes, in one process. Best of `--repeats`
rounds per policy (the first round builds the iteration the others reuse, as `snrt plan` does).
Writes results/bench_planning.{json,md}.

    python scripts/bench_planning.py [--repeats 2]
"""

import time
from pathlib import Path

from reproduce_common import GIB, machine, meta_line, parse_args, save_json, save_markdown, table

import snrt
from snrt.scheduler.planner import make_plan
from snrt.scheduler.policies import POLICIES

ROOT = Path(__file__).resolve().parent.parent
BATCH, BUDGET = 16, 12 * GIB


def main():
    parser = parse_args(__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="rounds over the policies; the best time is kept")
    args = parser.parse_args()
    out = args.out or "results"
    meta = machine()
    graph = snrt.load_config(ROOT / "configs" / "resnet2500.yaml").graph
    cases = [(policy, None) for policy in POLICIES] + [("superneurons", BUDGET)]
    best = {}
    for _ in range(args.repeats):
        for policy, budget in cases:
            start = time.perf_counter()
            plan = make_plan(graph, BATCH, policy, budget=budget)
            seconds = time.perf_counter() - start
            key = policy if budget is None else f"{policy} in {budget // GIB} GiB"
            row = best.setdefault(key, {"policy": key, "seconds": seconds, "steps": len(plan.steps),
                                        "buffers": len(plan.buffers), "peak_bytes": plan.peak_bytes})
            row["seconds"] = min(row["seconds"], seconds)
            print(f"{key:24s} {seconds:6.2f} s  {len(plan.steps)} steps", flush=True)
    rows = list(best.values())
    total = sum(r["seconds"] for r in rows)
    save_json(out, "bench_planning", {"meta": meta, "batch": BATCH, "rows": rows, "total_seconds": total})
    lines = ["# Planning time: ResNet-2500 at batch 16", "", meta_line(meta, False), "",
             f"`python scripts/bench_planning.py --repeats {args.repeats}`: seconds of `make_plan` per policy "
             f"(best of {args.repeats}), the plans `snrt plan configs/resnet2500.yaml --batch 16 --budget 12GiB` "
             "makes, in one process.", ""]
    lines += table(["policy", "seconds", "steps", "buffers", "peak (GiB)"], [
        [r["policy"], f"{r['seconds']:.2f}", r["steps"], r["buffers"], f"{r['peak_bytes'] / GIB:.2f}"] for r in rows])
    lines += ["", f"Total: {total:.1f} s."]
    save_markdown(out, "bench_planning", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
