"""Data parallel on this machine: 1 rank x N threads against N ranks x 1 thread (mpiexec), and
how much of the gradient exchange the backward pass hides.

    python scripts/bench_data_parallel.py [--config configs/cifar_resnet56.yaml] [--batch 64]
        [--iterations 12] [--ranks 2] [--buckets 25MiB,1MiB]

Each setting runs in fresh processes (`mpiexec -n R python scripts/bench_data_parallel.py
--worker ...`), trains on synthetic data and reports, from rank 0, the median images/s over the
iterations after the first two, and per iteration: the seconds spent starting and polling the
gradient exchanges during backward (MPI moves data inside these calls), the seconds the compute
waited for them (exposed: the exchange left over, and the wait for the slower rank to get there),
the seconds the same exchanges take alone, blocking (the communication), and the share of the
exchanged bytes whose exchange was already done when the plan waited for it (hidden behind the
backward pass). Writes results/data_parallel.md and .json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def worker(args):
    """One rank's run; rank 0 prints a JSON line of its measurements."""
    from snrt.config import load_config
    from snrt.parallel import world
    from snrt.threads import limit_threads
    from snrt.train import Trainer

    group = world()
    limit_threads(args.threads)
    overrides = {"train.batch": args.batch, "train.gradient_bucket": args.bucket,
                 "train.data.type": "synthetic", "train.data.samples": 1024}
    trainer = Trainer(load_config(args.config, overrides), group=group)
    stats = trainer.executor.copy_stats
    rows, seen = [], dict(stats)

    def record(m):
        change = {k: stats[k] - seen[k] for k in stats}
        seen.update(stats)
        hidden = change["exchanged_early_bytes"] / change["exchanged_bytes"] if change["exchanged_bytes"] else 0.0
        rows.append((m.seconds, m.images_per_s, change["exchange_stalled_s"], hidden, change["exchange_calls_s"]))

    trainer.fit(iterations=args.iterations, on_iteration=record)
    communication = _blocking_exchange_s(trainer, group) if group.size > 1 else 0.0
    if group.rank == 0:
        timed = rows[2:] or rows
        print(json.dumps({
            "ranks": group.size, "threads": args.threads, "bucket": args.bucket,
            "buckets": sum(s.kind == "allreduce" for s in trainer.plan.steps),
            "exchanged_bytes": trainer.plan.exchanged_bytes(),
            "images_per_s": statistics.median(r[1] for r in timed),
            "iteration_s": statistics.median(r[0] for r in timed),
            "exposed_s": statistics.median(r[2] for r in timed),
            "hidden": statistics.mean(r[3] for r in timed),
            "calls_s": statistics.median(r[4] for r in timed),
            "communication_s": communication,
            "peak_bytes": trainer.backend.arena.peak_bytes, "planned_peak_bytes": trainer.plan.peak_bytes,
        }))


def _blocking_exchange_s(trainer, group, repeats=5):
    """Median seconds of one iteration's exchanges run back to back, each waited for at once."""
    executor = trainer.executor
    starts = [s for s in trainer.plan.steps if s.kind == "allreduce"]
    arena = trainer.backend.arena
    for s in starts:  # the slots are freed after an iteration: hold them for the measurement
        arena.reserve(trainer.plan.buffers[s.gathered])
    times = []
    for _ in range(repeats):
        group.sum([0.0])  # every rank starts together
        begin = time.perf_counter()
        for s in starts:
            trainer.backend.start_exchange(group, executor.views[s.gathered]).wait()
        times.append(time.perf_counter() - begin)
    for s in starts:
        arena.release(trainer.plan.buffers[s.gathered])
    return statistics.median(times)


def run(setting, args):
    ranks, threads, bucket = setting
    mpiexec = Path(sys.executable).with_name("mpiexec")
    command = [sys.executable, __file__, "--worker", "--config", args.config, "--batch", str(args.batch),
               "--iterations", str(args.iterations), "--threads", str(threads), "--bucket", bucket]
    if ranks > 1:
        command = [str(mpiexec), "-n", str(ranks), *command]
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--config", default="configs/cifar_resnet56.yaml")
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--bucket", default="25MiB")
    parser.add_argument("--buckets", default="25MiB,1MiB", help="bucket sizes to try with several ranks")
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    load = os.getloadavg()
    settings = [(1, args.ranks, "25MiB")] + [(args.ranks, 1, b) for b in args.buckets.split(",")]
    results = []
    for setting in settings:
        print(f"running {setting[0]} rank(s) x {setting[1]} thread(s), bucket {setting[2]} ...", flush=True)
        results.append(run(setting, args))
        print(json.dumps(results[-1]), flush=True)
    write(results, args, load)


def write(results, args, load):
    base = results[0]["images_per_s"]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"
    lines = [
        "# Data parallel on this machine",
        "",
        f"`python scripts/bench_data_parallel.py --config {args.config} --batch {args.batch} "
        f"--iterations {args.iterations} --ranks {args.ranks} --buckets {args.buckets}`; {machine}; load average "
        f"before {load[0]:.2f}. Global batch {args.batch}, synthetic data; medians over iterations 3 to "
        f"{args.iterations}. Calls: seconds per iteration spent starting and polling the exchanges during "
        "the backward pass (MPI moves the data inside these calls); exposed: seconds per iteration the compute waited for gradient exchanges (what "
        "was left of them and the wait for the slower rank); communication: the same exchanges alone, each "
        "waited for at once; hidden: the share of the exchanged bytes already exchanged when the plan waited "
        "for them (done behind the backward pass).",
        "",
        "| ranks x threads | bucket | buckets | exchanged/rank | images/s | vs 1 rank | iteration | calls | exposed "
        "| communication | hidden | peak = planned |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        hidden = f"{r['hidden']:.0%}" if r["buckets"] else "-"
        lines.append(
            f"| {r['ranks']} x {r['threads']} | {r['bucket']} | {r['buckets']} | "
            f"{r['exchanged_bytes'] / 2**20:.2f} MiB | {r['images_per_s']:.1f} | {r['images_per_s'] / base:.2f}x | "
            f"{r['iteration_s']:.3f} s | {r['calls_s'] * 1e3:.2f} ms | {r['exposed_s'] * 1e3:.2f} ms | {r['communication_s'] * 1e3:.2f} ms | "
            f"{hidden} | {'yes' if r['peak_bytes'] == r['planned_peak_bytes'] else 'NO'} |")
    out = REPO / "results" / "data_parallel.md"
    out.write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"load_average": load, "results": results}, indent=2) + "\n")
    print(out.read_text())


if __name__ == "__main__":
    main()
