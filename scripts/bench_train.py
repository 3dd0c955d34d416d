"""Time whole training iterations of snrt's CPU backend next to PyTorch CPU on the same machine.

Not a test. For each model (CIFAR ResNet-164 at 32x32, batch 32; ResNet-50 at 224x224,
batch 8) it runs `--warmup` untimed and then `--iterations` timed training iterations
(forward, backward, SGD update with momentum 0.9 and the config's weight decay) of

- snrt: `snrt.train.Trainer(config).step(x, y, total)` on the NumPy backend;
- PyTorch: `snrt.torch_reference.TorchNet` built from the same snrt graph and the Trainer's
  initial parameters and BatchNorm state (`snrt.init.initial_parameters` /
  `initial_state` with the config's seed, exactly what the Trainer writes into its arena),
  trained with `torch.optim.SGD` (same lr, momentum, Nesterov flag, and weight decay on the
  same parameters as snrt: BatchNorm and bias parameters are not decayed),

on the same synthetic batches (`snrt.data.Batches(...).get(i)` of the Trainer's synthetic
training set: batch i is identical in both runs), timed by the harness of scripts/timing.py. Both frameworks use every core: numpy's
BLAS via OPENBLAS_NUM_THREADS / OMP_NUM_THREADS / MKL_NUM_THREADS (set before numpy loads,
unless already set), torch via `torch.set_num_threads(os.cpu_count())`. The first
iteration's loss of both is recorded as a check that they train the same network on the
same data (it agrees to about 1e-5).

images/s is batch / wall seconds of one whole iteration (`Trainer.step` for snrt, which also
reads back the loss; zero_grad + forward + backward + SGD step + `loss.item()` for torch);
the table shows the mean (total images / total seconds), the slowest, the median and the
fastest timed iteration, the median over the iterations whose process kept at least 90 % of
the cores busy (CPU seconds per wall second: other processes on a shared machine drop it,
and two spinning BLAS/OpenMP threads then slow down far more than by half), and snrt's
full-core median as a multiple of torch's ("vs torch"; n/a when a side has no such
iteration). The Trainer's own timing of `executor.run` alone is kept in the JSON as
`executor_seconds`.

Memory, and why every (model, framework) pair runs in its own subprocess:
- snrt "plan" is `trainer.plan.peak_bytes`, the bytes the static plan predicts on the
  device at its busiest step; "arena" is `trainer.backend.arena.peak_bytes`, the live bytes
  the arena measured while the executor reserved and released buffers (both include
  parameters, gradients, momentum and workspaces; neither counts NumPy temporaries that
  kernels allocate outside the arena, nor the Python/NumPy/data baseline).
- "RSS" numbers come from `resource.getrusage(RUSAGE_SELF).ru_maxrss`, the process's
  high-water mark of resident memory, read before the model is built (the batches are
  already precomputed), before the first (warm-up) iteration and after the last one. "RSS growth" for torch is
  max RSS after the iterations minus max RSS before the warm-up: the memory torch's
  allocator (glibc malloc/mmap) had to get from the OS for activations, gradients, momentum
  buffers and convolution workspaces on top of the built model and the data. For snrt the
  same difference is reported, plus the growth from before the Trainer was built (its arena
  is np.zeros, so its pages become resident only as the iterations first touch them).
  ru_maxrss only ever grows, so a process that has already run snrt's 3+ GiB arena would
  hide whatever torch needs below that; running each pair in a fresh subprocess gives each
  framework a clean high-water mark, and also keeps OpenBLAS's and torch's OpenMP thread
  pools from competing for the two cores. The subprocesses run one after the other.

    python scripts/bench_train.py [--models cifar_resnet164 resnet50] [--iterations 5] [--rounds 1]
        [--warmup 1] [--frameworks snrt torch] [--out results/bench_train.json] [--quick]

`--quick` is a smoke run: batch 8 (CIFAR) and 2 (ResNet-50), 2 iterations, 1 warm-up,
and (unless --out is given) writes results/bench_train_quick.json. `--rounds R` repeats the
whole sweep R times with fresh processes (frameworks interleaved) and pools the timed
iterations, which spreads the noise of other processes on a shared machine over both
frameworks; the "cores busy" column (process CPU seconds per wall second) shows how much of
the machine a run actually got. Full mode takes about two minutes per round on 2 idle cores.
"""

import timing  # first: it sets the BLAS thread counts before numpy loads

import argparse
import datetime
import hashlib
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys

import numpy as np
from timing import CORES, ROOT

# name: (config file, batch, quick batch)
MODELS = {
    "cifar_resnet164": ("configs/cifar_resnet164.yaml", 32, 8),
    "resnet50": ("configs/resnet50.yaml", 8, 2),
}
FRAMEWORKS = ("snrt", "torch")
MiB = 2**20
FULL_CORES = 0.9  # an iteration "had the machine" when its process kept >= 90 % of the cores busy


def load(model, batch):
    import snrt

    path, _, _ = MODELS[model]
    return snrt.load_config(ROOT / path, {"train.batch": batch,
                                          "train.data": {"type": "synthetic", "samples": 4 * batch}})


def summarize(seconds, batch):
    rates = [batch / s for s in seconds]
    return {"seconds": seconds, "images_per_s": rates, "images_per_s_mean": batch * len(seconds) / sum(seconds),
            "images_per_s_min": min(rates), "images_per_s_median": statistics.median(rates),
            "images_per_s_max": max(rates), "seconds_median": statistics.median(seconds)}


def contention(cpu, seconds, load_before, load_after, batch):
    """CPU seconds per wall second of the timed iterations (all threads of this process; about
    the core count when nothing else competes, lower when other processes take cores), the
    1-minute load average before and after them (it includes this process), and the median
    img/s over the iterations that kept (nearly) every core busy, `FULL_CORES` of them."""
    full = [batch / s for s, c in zip(seconds, cpu) if c / s >= FULL_CORES * CORES]
    return {"cpu_seconds": cpu, "cores_busy": sum(cpu) / sum(seconds),
            "images_per_s_median_full_cores": statistics.median(full) if full else None,
            "iterations_full_cores": len(full),
            "loadavg_1min_before": load_before, "loadavg_1min_after": load_after}


def measured(run, batch):
    """The fields of a row both frameworks have, from a timing.Run."""
    return {**summarize(run.seconds, batch),
            **contention(run.cpu_seconds, run.seconds, run.loadavg_before, run.loadavg_after, batch),
            "build_s": run.build_s, "losses": run.losses,
            "rss_max_start_bytes": run.rss_max_start, "rss_max_before_iterations_bytes": run.rss_max_before,
            "rss_max_after_bytes": run.rss_max_after,
            "rss_growth_iterations_bytes": run.rss_max_after - run.rss_max_before,
            "rss_growth_total_bytes": run.rss_max_after - run.rss_max_start}


# ---- workers (one per subprocess) ---------------------------------------------------------
def run_snrt(model, batch, warmup, iterations):
    run = timing.time_snrt(load(model, batch), warmup, iterations, label=f"snrt {model}")
    trainer = run.subject
    return {**measured(run, batch), "executor_seconds": run.inner_seconds,  # Trainer's own timing: executor.run only
            "plan_peak_bytes": int(trainer.plan.peak_bytes), "plan_arena_bytes": int(trainer.plan.arena_bytes),
            "arena_peak_bytes": int(trainer.backend.arena.peak_bytes)}


def run_torch(model, batch, warmup, iterations):
    import torch

    run = timing.time_torch(load(model, batch), warmup, iterations, label=f"torch {model}")
    return {**measured(run, batch), "threads": torch.get_num_threads()}


WORKERS = {"snrt": run_snrt, "torch": run_torch}


# ---- the driver ---------------------------------------------------------------------------
def spawn(framework, model, batch, args):
    print(f"{framework} {model} batch {batch}: {args.warmup} warm-up + {args.iterations} timed iterations",
          file=sys.stderr, flush=True)
    return timing.spawn(__file__, framework, model=model, batch=batch, warmup=args.warmup,
                        iterations=args.iterations)


def pool_rounds(results, batch):
    """One row from the workers' results of every round: timed iterations pooled, memory maxima."""
    failed = [r for r in results if "error" in r]
    if failed:
        return failed[0]
    if len(results) == 1:
        return results[0]
    row = dict(results[0])
    seconds = [s for r in results for s in r["seconds"]]
    cpu = [c for r in results for c in r["cpu_seconds"]]
    row.update(summarize(seconds, batch))
    row.update(contention(cpu, seconds, results[0]["loadavg_1min_before"], results[-1]["loadavg_1min_after"], batch))
    row["rounds"] = results
    for key in [k for k in row if k.startswith(("rss_", "arena_peak"))]:
        row[key] = max(r[key] for r in results)
    if "executor_seconds" in row:
        row["executor_seconds"] = [s for r in results for s in r["executor_seconds"]]
    return row


def machine_info():
    import torch

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "machine": platform.machine(), "processor": platform.processor(),
        "python": platform.python_version(), "cpu_count": CORES,
        "numpy": np.__version__, "torch": torch.__version__, "torch_threads": CORES,
        "blas_threads_env": {v: os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
    }
    try:
        blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        info["numpy_blas"] = f"{blas.get('name')} {blas.get('version', '')}".strip()
    except Exception:  # older numpy: no mode="dicts"
        info["numpy_blas"] = "unknown"
    try:  # which snrt was measured: the checkout's commit and its uncommitted changes to snrt/
        git = ["git", "-C", str(ROOT)]
        info["git_commit"] = subprocess.run(git + ["rev-parse", "HEAD"], capture_output=True, text=True,
                                            check=True).stdout.strip()
        info["git_dirty_snrt"] = subprocess.run(git + ["status", "--porcelain", "--", "snrt"], capture_output=True,
                                                text=True, check=True).stdout.splitlines()
    except (OSError, subprocess.CalledProcessError):
        pass
    digest = hashlib.sha256()  # the measured sources exactly, uncommitted edits included
    for path in sorted((ROOT / "snrt").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    info["snrt_sources_sha256"] = digest.hexdigest()
    try:
        import threadpoolctl

        info["threadpools"] = [{k: pool.get(k) for k in ("user_api", "internal_api", "num_threads", "version")}
                               for pool in threadpoolctl.threadpool_info()]
    except ImportError:  # optional: report the BLAS name only
        pass
    info["cpu_model"] = timing.cpu_model()
    return info


def fmt_mib(nbytes):
    return f"{nbytes / MiB:,.0f}" if nbytes is not None else "-"


def print_table(rows, meta):
    from rich.console import Console
    from rich.table import Table

    rounds = f" x {meta['rounds']} rounds" if meta["rounds"] > 1 else ""
    table = Table(title=f"Training iterations on {meta['cpu_count']} CPU cores "
                        f"({meta['iterations']} timed after {meta['warmup']} warm-up{rounds}; numpy BLAS "
                        f"{meta['numpy_blas']}, torch {meta['torch']})")
    for column in ("model", "batch", "framework", "img/s mean", "min", "median", "max", "median, all cores",
                   "vs torch", "plan peak MiB", "arena peak MiB", "max RSS MiB", "RSS growth MiB", "cores busy",
                   "loss it0"):
        table.add_column(column, justify="left" if column in ("model", "framework") else "right",
                         no_wrap=column in ("model", "framework", "median, all cores"))
    torch_rows = {r["model"]: r for r in rows if r["framework"] == "torch" and "error" not in r}
    for r in rows:
        if "error" in r:
            table.add_row(r["model"], str(r["batch"]), r["framework"], f"[red]{r['error']}[/red]",
                          *["-"] * 11)
            continue
        ratio, other = "", torch_rows.get(r["model"])
        if r["framework"] != "torch" and other:
            key = "images_per_s_median_full_cores"  # compare undisturbed iterations only
            ratio = f"{r[key] / other[key]:.2f}x" if r[key] is not None and other[key] is not None else "n/a"
        full = r["images_per_s_median_full_cores"]
        full = f"{full:.2f} ({r['iterations_full_cores']}/{len(r['seconds'])})" if full is not None else "-"
        table.add_row(r["model"], str(r["batch"]), r["framework"], f"{r['images_per_s_mean']:.2f}",
                      f"{r['images_per_s_min']:.2f}", f"{r['images_per_s_median']:.2f}",
                      f"{r['images_per_s_max']:.2f}", full, ratio,
                      fmt_mib(r.get("plan_peak_bytes")), fmt_mib(r.get("arena_peak_bytes")),
                      fmt_mib(r["rss_max_after_bytes"]), fmt_mib(r["rss_growth_iterations_bytes"]),
                      f"{r['cores_busy']:.2f}", f"{r['losses'][0]:.5f}")
    console = Console()
    console.width = max(console.width, 200)  # not a terminal: rich assumes 80 columns
    console.print(table)
    print("plan/arena peak: snrt's device arena (predicted / measured). max RSS: the process's resident "
          "high-water mark (one fresh process per row). RSS growth: max RSS after the iterations minus "
          "before the warm-up (for torch: what its allocator took from the OS for the iterations). cores busy: "
          "process CPU seconds per wall second over the timed iterations; well below the core count means "
          f"other processes competed for the cores and the img/s are pessimistic. all cores: median over the "
          f"iterations that kept >= {FULL_CORES:.0%} of the cores busy (how many of them); vs torch compares "
          "those medians (n/a where a side has none: run again, or with more --rounds, on a quieter machine).")


def main(argv=None):
    if timing.serve(WORKERS, argv):
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS),
                        help="models to run (default: all)")
    parser.add_argument("--frameworks", nargs="+", choices=FRAMEWORKS, default=list(FRAMEWORKS),
                        help="frameworks to run (default: snrt torch)")
    parser.add_argument("--iterations", type=int, default=None, help="timed iterations (default 5; 2 with --quick)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed warm-up iterations first (default 1)")
    parser.add_argument("--out", default=None, help="JSON output (default results/bench_train.json, "
                                                    "results/bench_train_quick.json with --quick)")
    parser.add_argument("--quick", action="store_true", help="smoke run: smaller batches, 2 iterations")
    parser.add_argument("--rounds", type=int, default=1,
                        help="repeat the whole sweep (fresh processes, frameworks interleaved) and pool "
                             "the timed iterations of all rounds (default 1); helps on a shared machine")
    args = parser.parse_args(argv)
    if args.iterations is None:
        args.iterations = 2 if args.quick else 5
    if args.iterations < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("need --iterations >= 1, --warmup >= 0 and --rounds >= 1")

    meta = {**machine_info(), "iterations": args.iterations, "warmup": args.warmup, "rounds": args.rounds,
            "quick": args.quick}
    print(f"{meta['platform']}, {CORES} cores, numpy {meta['numpy']} ({meta['numpy_blas']}), "
          f"torch {meta['torch']}", file=sys.stderr)
    runs = {}  # (model, framework) -> [worker result per round]
    for round_ in range(args.rounds):
        if args.rounds > 1:
            print(f"round {round_ + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for model in args.models:
            batch = MODELS[model][2] if args.quick else MODELS[model][1]
            for framework in args.frameworks:
                runs.setdefault((model, framework), []).append(spawn(framework, model, batch, args))
    rows = []
    for (model, framework), results in runs.items():
        config_path, batch, quick_batch = MODELS[model]
        batch = quick_batch if args.quick else batch
        rows.append({"model": model, "config": config_path, "batch": batch, "framework": framework,
                     **pool_rounds(results, batch)})
    print_table(rows, meta)
    out = pathlib.Path(args.out or ("results/bench_train_quick.json" if args.quick else "results/bench_train.json"))
    if not out.is_absolute():
        out = ROOT / out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
