"""How long planning takes: make_plan of ResNet-2500 (configs/resnet2500.yaml, 8,337 nodes) at
batch 16 under every policy, then superneurons in a 12 GiB budget, in one process, and the
wall time of the whole command `snrt plan configs/resnet2500.yaml --batch 16 --budget 12GiB`.
Each round runs in a fresh process, as the command does (a second round in the same process
runs faster: the allocator's memory is warm); the best round per row is kept.
Writes results/bench_planning.{json,md}.

    python scripts/bench_planning.py [--repeats 2] [--checkout PATH]

`--checkout PATH` times the snrt of another checkout (an older commit, say) with the same
configs, to compare side by side.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
BATCH, BUDGET = 16, 12 * GIB


def one_round(checkout):
    """Plan every case once in this process with the snrt of `checkout` (None: this one);
    print [{policy, seconds, steps, buffers, peak_bytes}] as JSON."""
    if checkout:
        sys.path.insert(0, checkout)
    import snrt
    from snrt.scheduler.planner import make_plan
    from snrt.scheduler.policies import POLICIES

    if checkout and not Path(snrt.__file__).resolve().is_relative_to(Path(checkout).resolve()):
        sys.exit(f"imported {snrt.__file__}, not the snrt of {checkout}")
    graph = snrt.load_config(ROOT / "configs" / "resnet2500.yaml").graph
    rows = []
    for policy, budget in [(policy, None) for policy in POLICIES] + [("superneurons", BUDGET)]:
        start = time.perf_counter()
        plan = make_plan(graph, BATCH, policy, budget=budget)
        rows.append({"policy": policy if budget is None else f"{policy} in {budget // GIB} GiB",
                     "seconds": time.perf_counter() - start, "steps": len(plan.steps), "buffers": len(plan.buffers),
                     "peak_bytes": plan.peak_bytes})
    print(json.dumps(rows))


def main():
    if "--one-round" in sys.argv:  # a child: import nothing of this checkout's before the snrt to time
        checkout = sys.argv[sys.argv.index("--checkout") + 1] if "--checkout" in sys.argv else None
        return one_round(checkout)
    from reproduce_common import machine, meta_line, parse_args, save_json, save_markdown, table

    parser = parse_args(__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each in a fresh process; the best is kept")
    parser.add_argument("--checkout", help="time the snrt package of this checkout instead of this one")
    args = parser.parse_args()
    out = args.out or "results"
    meta = machine()
    best = {}
    for _ in range(args.repeats):
        command = [sys.executable, __file__, "--one-round", *(["--checkout", args.checkout] if args.checkout else [])]
        done = subprocess.run(command, check=True, capture_output=True, text=True)
        for row in json.loads(done.stdout):
            print(f"{row['policy']:24s} {row['seconds']:6.2f} s  {row['steps']} steps", flush=True)
            if row["policy"] not in best or row["seconds"] < best[row["policy"]]["seconds"]:
                best[row["policy"]] = row
    rows = list(best.values())
    total = sum(r["seconds"] for r in rows)
    command = ["snrt", "plan", "configs/resnet2500.yaml", "--batch", str(BATCH), "--budget", "12GiB"]
    wall = []
    for _ in range(args.repeats):  # the command as a user runs it, from the checkout timed
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", *command], check=True, capture_output=True, cwd=args.checkout or ROOT)
        wall.append(time.perf_counter() - start)
    print(f"{' '.join(command)}: {min(wall):.2f} s", flush=True)
    save_json(out, "bench_planning", {"meta": meta, "batch": BATCH, "rows": rows, "total_seconds": total,
                                      "command": " ".join(command), "command_seconds": min(wall)})
    lines = ["# Planning time: ResNet-2500 at batch 16", "", meta_line(meta, False), "",
             f"`python scripts/bench_planning.py --repeats {args.repeats}`: seconds of `make_plan` per policy, one "
             f"call each, in this order, each round in a fresh process (best of {args.repeats})"
             + (f"; the snrt of the checkout {args.checkout}" if args.checkout else "") + ".", ""]
    lines += table(["policy", "seconds", "steps", "buffers", "peak (GiB)"], [
        [r["policy"], f"{r['seconds']:.2f}", r["steps"], r["buffers"], f"{r['peak_bytes'] / GIB:.2f}"] for r in rows])
    lines += ["", f"Total: {total:.1f} s. The command `{' '.join(command)}` (it plans the detailed policy and the one "
              "it is capped by in its own process and the others' rows in a second one where a second core is "
              f"usable): {min(wall):.2f} s wall, best of {args.repeats}."]
    save_markdown(out, "bench_planning", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
