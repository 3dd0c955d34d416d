"""How long planning takes: make_plan of ResNet-2500 (configs/resnet2500.yaml, 8,337 nodes) at
batch 16 under every policy, then superneurons in a 12 GiB budget, then a 10,094-layer ResNet
(stage 3 of 3,320 blocks instead of 788) with parameters streamed, superneurons in 12 GiB, then
superneurons for ResNet-50 and CIFAR ResNet-110 at their files' batches (plans the offsets
greedy packs: ResNet-2500's have too many buffers for it), in one process; and the wall time of the commands `snrt plan configs/resnet2500.yaml --batch 16
--budget 12GiB` and the same for the 10,094-layer network with `--stream-parameters`.
Each round runs in a fresh process, as the command does (a second round in the same process
runs faster: the allocator's memory is warm); the best round per row is kept.
Writes results/bench_planning.{json,md}.

    python scripts/bench_planning.py [--repeats 2] [--against PATH]

`--against PATH` also times the snrt of another checkout (an older commit, say) with the same
configs, its rounds interleaved with this checkout's, so both columns share the machine's load.
"""

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30
BATCH, BUDGET = 16, 12 * GIB
# networks of the zoo whose plans have few enough buffers for the offsets greedy
# (snrt/scheduler/offsets.py), at their files' batches
ZOO = (("resnet50", 32), ("cifar_resnet110", 128))
DEEP_REPEAT = 3319  # stage 3's identity blocks: 3,320 blocks in all, 3 * (6 + 32 + 3320 + 6) + 2 = 10,094 layers


def deep_config(folder):
    """configs/resnet2500.yaml with stage 3 of 3,320 blocks, written into `folder`; its path."""
    text = (ROOT / "configs" / "resnet2500.yaml").read_text()
    assert "repeat: 787" in text, "configs/resnet2500.yaml no longer has stage 3 as 'repeat: 787'"
    path = Path(folder) / "resnet10094.yaml"
    path.write_text(text.replace("repeat: 787", f"repeat: {DEEP_REPEAT}").replace("name: resnet2500",
                                                                                  "name: resnet10094"))
    return path


def commit_of(checkout):
    """The short commit id `checkout` (a folder in a git work tree) is at."""
    done = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True)
    return done.stdout.strip() or str(checkout)


def one_round(checkout, deep):
    """Plan every case once in this process with the snrt of `checkout` (None: this one);
    print [{case, seconds, steps, buffers, peak_bytes, predicted_s}] as JSON."""
    if checkout:
        sys.path.insert(0, checkout)
    import snrt
    from snrt.scheduler.planner import make_plan
    from snrt.scheduler.policies import POLICIES

    if checkout and not Path(snrt.__file__).resolve().is_relative_to(Path(checkout).resolve()):
        sys.exit(f"imported {snrt.__file__}, not the snrt of {checkout}")
    graph = snrt.load_config(ROOT / "configs" / "resnet2500.yaml").graph
    cases = [(policy, graph, BATCH, policy, None, False) for policy in POLICIES]
    cases.append(("superneurons in 12 GiB", graph, BATCH, "superneurons", BUDGET, False))
    cases.append(("10,094 layers, streamed: superneurons in 12 GiB", snrt.load_config(deep).graph, BATCH,
                  "superneurons", BUDGET, True))
    for name, batch in ZOO:
        cases.append((f"{name} batch {batch}: superneurons", snrt.load_config(ROOT / "configs" / f"{name}.yaml").graph,
                      batch, "superneurons", None, False))
    rows = []
    for case, g, batch, policy, budget, streamed in cases:
        start = time.perf_counter()
        plan = make_plan(g, batch, policy, budget=budget, stream_parameters=streamed)
        rows.append({"case": case, "seconds": time.perf_counter() - start, "steps": len(plan.steps),
                     "buffers": len(plan.buffers), "peak_bytes": plan.peak_bytes, "predicted_s": plan.predicted_s})
        del plan
    print(json.dumps(rows))


def commands(deep):
    """The `snrt plan` commands timed whole: (label, arguments)."""
    return [("configs/resnet2500.yaml", ["plan", "configs/resnet2500.yaml", "--batch", str(BATCH), "--budget",
                                         "12GiB"]),
            ("10,094 layers", ["plan", str(deep), "--batch", str(BATCH), "--budget", "12GiB", "--stream-parameters"])]


def main():
    if "--one-round" in sys.argv:  # a child: import nothing of this checkout's before the snrt to time
        checkout = sys.argv[sys.argv.index("--checkout") + 1] if "--checkout" in sys.argv else None
        return one_round(checkout, sys.argv[sys.argv.index("--deep") + 1])
    from reproduce_common import machine, meta_line, parse_args, save_json, save_markdown, table

    parser = parse_args(__doc__)
    parser.add_argument("--repeats", type=int, default=2, help="rounds, each in a fresh process; the best is kept")
    parser.add_argument("--against", help="also time the snrt package of this checkout, interleaved")
    args = parser.parse_args()
    meta = machine()
    checkouts = {"this": None, **({"against": str(Path(args.against).resolve())} if args.against else {})}
    best, wall = {}, {}
    with tempfile.TemporaryDirectory() as folder:
        deep = deep_config(folder)
        for _ in range(args.repeats):
            for label, checkout in checkouts.items():
                command = [sys.executable, __file__, "--one-round", "--deep", str(deep),
                           *(["--checkout", checkout] if checkout else [])]
                done = subprocess.run(command, check=True, capture_output=True, text=True)
                for row in json.loads(done.stdout):
                    print(f"{label:8s} {row['case']:48s} {row['seconds']:6.2f} s  {row['steps']} steps", flush=True)
                    key = (row["case"], label)
                    if key not in best or row["seconds"] < best[key]["seconds"]:
                        best[key] = row
            for name, arguments in commands(deep):  # the commands as a user runs them, from each checkout
                for label, checkout in checkouts.items():
                    start = time.perf_counter()
                    subprocess.run([sys.executable, "-m", "snrt", *arguments], check=True, capture_output=True,
                                   cwd=checkout or ROOT)
                    seconds = time.perf_counter() - start
                    print(f"{label:8s} snrt {' '.join(arguments)}: {seconds:.2f} s", flush=True)
                    wall[name, label] = min(wall.get((name, label), seconds), seconds)
    cases = list(dict.fromkeys(case for case, _ in best))
    rows = [{**best[case, "this"],
             **({"against_seconds": best[case, "against"]["seconds"],
                 "against_predicted_s": best[case, "against"]["predicted_s"]} if args.against else {})}
            for case in cases]
    command_rows = [{"command": "snrt " + " ".join(arguments).replace(str(deep), "resnet10094.yaml"),
                     "seconds": wall[name, "this"],
                     **({"against_seconds": wall[name, "against"]} if args.against else {})}
                    for name, arguments in commands(deep)]
    other = commit_of(args.against) if args.against else None
    save_json(args.out, "bench_planning", {"meta": meta, "batch": BATCH, "commit": commit_of(ROOT), "against": other,
                                           "rows": rows,
                                           "commands": command_rows})
    against = [f"{other} (s)"] if other else []
    lines = ["# Planning time: ResNet-2500 and a 10,094-layer ResNet at batch 16, two zoo networks at their files' "
             "batches", "", meta_line(meta, False), "",
             f"`python scripts/bench_planning.py --repeats {args.repeats}"
             + (f" --against <a checkout of {other}>`" if other else "`")
             + f": seconds of `make_plan` per case, one call each, in this order, each round in a fresh process "
             f"(best of {args.repeats})" + ("; the other checkout's columns come from its rounds, interleaved "
                                            "with these" if args.against else "")
             + "; predicted: the plan's iteration time by the CPU cost model (what the plan is worth).", ""]
    predicted_against = [f"{other} predicted (s)"] if other else []
    lines += table(["case", "seconds", *against, "predicted (s)", *predicted_against, "steps", "buffers",
                    "peak (GiB)"], [
        [r["case"], f"{r['seconds']:.2f}", *([f"{r['against_seconds']:.2f}"] if args.against else []),
         f"{r['predicted_s']:.2f}", *([f"{r['against_predicted_s']:.2f}"] if args.against else []), r["steps"],
         r["buffers"], f"{r['peak_bytes'] / GIB:.2f}"] for r in rows])
    lines += ["", "The commands, wall time (each plans the detailed policy and the one it is capped by in its own "
              "process, and the other rows, heaviest first, in whichever of it and a second process is free "
              "where a second core is usable; best of "
              f"{args.repeats}; resnet10094.yaml is configs/resnet2500.yaml with stage 3 of 3,320 blocks):", ""]
    lines += table(["command", "seconds", *against], [
        [f"`{r['command']}`", f"{r['seconds']:.2f}", *([f"{r['against_seconds']:.2f}"] if args.against else [])]
        for r in command_rows])
    save_markdown(args.out, "bench_planning", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
