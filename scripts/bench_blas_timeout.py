"""How long OpenBLAS's threads should spin after a GEMM: snrt `none` training iterations with
each OPENBLAS_THREAD_TIMEOUT (threads spin 2**N cycles, then sleep), processes taking turns.

Not a test. snrt sets 16 when it is imported before numpy (snrt/__init__.py); this measures
that choice against OpenBLAS's own default (28) and against sleeping at once (4) on a network
whose convolutions are mostly snrt's threaded direct kernels (CIFAR ResNet-110) and one whose
convolutions are mostly OpenBLAS GEMMs (ResNet-50). Writes results/blas_timeout.{json,md}.

    python scripts/bench_blas_timeout.py [--rounds 4] [--timeouts 4 16 28]
"""

import argparse
import os
import statistics
import sys

import timing  # noqa: I001  (before numpy: it sets the BLAS threads)
from bench_memory import synthetic_config
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, table

CASES = [("cifar_resnet110", 32, 32), ("resnet50", 112, 8)]
ITERATIONS = 3  # timed, after one warm-up, per process


def worker(network, size, batch):
    """Seconds of each timed iteration, in this process (its OPENBLAS_THREAD_TIMEOUT)."""
    run = timing.time_snrt(synthetic_config(network, size, batch, "none"), 1, ITERATIONS)
    return {"seconds": run.seconds, "timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="processes per (network, timeout)")
    parser.add_argument("--timeouts", type=int, nargs="+", default=[4, 16, 28])
    args = parser.parse_args()
    meta = machine()
    rows = []
    for network, size, batch in CASES:
        seconds = {timeout: [] for timeout in args.timeouts}
        for _ in range(args.rounds):
            for timeout in args.timeouts:
                os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(timeout)  # read by the worker's numpy
                result = timing.spawn(__file__, "iterations", network=network, size=size, batch=batch)
                if "error" in result:
                    sys.exit(f"{network} at timeout {timeout}: {result['error']}")
                seconds[timeout] += result["seconds"]
        row = {"network": network, "size": size, "batch": batch,
               "median_s": {str(t): statistics.median(s) for t, s in seconds.items()},
               "min_s": {str(t): min(s) for t, s in seconds.items()}}
        print(network, {t: f"{m:.3f}" for t, m in row["median_s"].items()}, flush=True)
        rows.append(row)
    meta["load_average_after"] = list(os.getloadavg())
    save_json(RESULTS, "blas_timeout", {"meta": meta, "rounds": args.rounds, "rows": rows})
    timeouts = [str(t) for t in args.timeouts]
    save_markdown(RESULTS, "blas_timeout", [
        "# OpenBLAS's spin after a GEMM: seconds per training iteration", "",
        meta_line(meta, False), "",
        f"`python scripts/bench_blas_timeout.py --rounds {args.rounds} --timeouts {' '.join(timeouts)}`: "
        f"OPENBLAS_THREAD_TIMEOUT=N lets OpenBLAS's threads spin 2**N cycles after a GEMM before they sleep "
        f"(OpenBLAS's default 28, about 0.1 s; snrt sets 16). Median (and least) seconds of one iteration of "
        f"snrt `none` over {args.rounds} processes per value, each {ITERATIONS} iterations after a warm-up, the "
        f"values taking turns; load average {meta['load_average_after'][0]:.2f} at the end.", "",
        *table(["network", "image", "batch", *(f"2**{t} cycles" for t in timeouts)],
               [[r["network"], r["size"], r["batch"],
                 *(f"{r['median_s'][t]:.3f} ({r['min_s'][t]:.3f})" for t in timeouts)] for r in rows])])


if __name__ == "__main__":
    if not timing.serve({"iterations": worker}):
        main()
