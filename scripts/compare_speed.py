"""Side by side: seconds per training iteration of snrt from two checkouts (before / after a
change), and optionally PyTorch, in one run.

Not a test. Rounds go over every (checkout, policy) in turn, each in a fresh Python process
that imports snrt from its checkout (its `scripts/timing.py` times `warmup` + `iterations`
iterations of `Trainer(config).step` on the Trainer's own batches), so a drift of a shared
machine's speed slows both sides alike. Prints the median seconds per iteration, the ratio
to the other checkout and to PyTorch, the first losses, and the load average before and after.

    git worktree add /tmp/before HEAD~3      # or any checkout of the code to compare with
    python scripts/compare_speed.py --before /tmp/before cifar_resnet110 32 32 --policies none superneurons
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TAG = "COMPARE_SPEED_RESULT "


def worker(root, framework, name, size, batch, policy, iterations):
    """Time one configuration with the snrt of checkout `root`; print the tagged JSON result."""
    sys.path[:0] = [root, f"{root}/scripts"]
    import timing  # noqa: E402  (that checkout's harness; it sets the BLAS threads first)
    from bench_memory import synthetic_config  # noqa: E402

    config = synthetic_config(name, size, batch, policy)
    run = (timing.time_snrt if framework == "snrt" else timing.time_torch)(config, 1, iterations)
    import snrt  # noqa: E402

    print(TAG + json.dumps({"seconds": run.seconds, "losses": run.losses, "snrt": snrt.__file__}), flush=True)


def spawn(root, framework, args, policy):
    cmd = [sys.executable, __file__, "--worker", root, framework, args.network, str(args.size), str(args.batch),
           policy, str(args.iterations)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=root)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(TAG)]
    if proc.returncode or not lines:
        raise SystemExit(f"{framework} from {root} ({policy}) failed:\n{proc.stderr[-2000:]}")
    result = json.loads(lines[-1][len(TAG):])
    if framework == "snrt" and not result["snrt"].startswith(str(Path(root).resolve())):
        raise SystemExit(f"the worker for {root} imported snrt from {result['snrt']}")
    return result


def main():
    if sys.argv[1:2] == ["--worker"]:
        root, framework, name, size, batch, policy, iterations = sys.argv[2:]
        return worker(root, framework, name, int(size), int(batch), policy, int(iterations))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the checkout to compare with (its root folder)")
    parser.add_argument("--after", default=str(ROOT), help="the checkout with the change (default: this one)")
    parser.add_argument("network", help="a config name in configs/, e.g. cifar_resnet110")
    parser.add_argument("size", type=int, help="image size")
    parser.add_argument("batch", type=int)
    parser.add_argument("--policies", nargs="+", default=["none"])
    parser.add_argument("--iterations", type=int, default=2, help="timed iterations per process, after 1 warm-up")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--no-torch", dest="torch", action="store_false", help="leave PyTorch out")
    parser.add_argument("--json", action="store_true", help="also print the medians as one tagged JSON line")
    args = parser.parse_args()
    sides = [(f"{side} {policy}", root, "snrt", policy) for side, root in (("before", args.before), ("after", args.after))
             for policy in args.policies]
    if args.torch:
        sides.insert(0, ("torch", args.after, "torch", "none"))
    seconds, losses = {label: [] for label, *_ in sides}, {}
    load_before = os.getloadavg()
    for _ in range(args.rounds):
        for label, root, framework, policy in sides:
            result = spawn(root, framework, args, policy)
            seconds[label] += result["seconds"]
            losses[label] = result["losses"][:2]
    print(f"{args.network} {args.size}x{args.size} batch {args.batch}: median seconds per iteration over "
          f"{args.rounds} round(s) x {args.iterations}; load average {load_before[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    median = {label: statistics.median(s) for label, s in seconds.items()}
    for label, m in median.items():
        versus = [f"{median['torch'] / m:.2f}x torch"] if "torch" in median and label != "torch" else []
        if label.startswith("after "):
            versus.insert(0, f"{m / median['before ' + label[6:]] - 1:+.0%} vs before")
        print(f"  {label:24s} {m:7.3f} s  {'  '.join(versus):28s} first losses {losses[label]}")
    if args.json:
        print(TAG + json.dumps({"network": args.network, "size": args.size, "batch": args.batch, "rounds": args.rounds,
                                "iterations": args.iterations, "seconds": median, "losses": losses,
                                "load_average": [load_before[0], os.getloadavg()[0]]}))


if __name__ == "__main__":
    main()
