"""Useful GFLOP/s of whole training iterations on this CPU, against its SGEMM rate.

Not a test. The machine's SGEMM rate is the best of `--repeats` NumPy float32 products of
n x n matrices (n = 1024 and 2048, every core, the faster kept). A network's useful FLOPs are
its layers' forward and backward FLOPs as snrt's cost model counts them (2 per multiply-add,
`layer.cost`; no recomputation, no update), the same for snrt and PyTorch. Seconds per
iteration are compare_speed.py's: snrt (`none`, fp32, synthetic data) and PyTorch (the same
graph, NCHW) in fresh processes taking turns, the median over `--rounds`. Writes
results/cpu_gflops.{json,md}.

    python scripts/bench_gflops.py [--rounds 3]
"""

import timing  # noqa: F401, I001  (first: it sets the BLAS threads before numpy loads)

import argparse
import statistics
import time
from argparse import Namespace

import numpy as np
from compare_speed import ROOT, spawn
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, table

import snrt
from snrt.layers.base import BACKWARD, FORWARD

CASES = [("resnet50", 224, 8), ("resnet50", 112, 8), ("cifar_resnet110", 32, 32)]


def sgemm_rate(repeats):
    """Best float32 GEMM GFLOP/s of NumPy's BLAS over n = 1024 and 2048."""
    best = 0.0
    rng = np.random.default_rng(0)
    for n in (1024, 2048):
        a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
        out = a @ b
        for _ in range(repeats):
            start = time.perf_counter()
            np.matmul(a, b, out=out)
            best = max(best, 2 * n**3 / (time.perf_counter() - start) / 1e9)
    return best


def useful_flops(name, size, batch):
    """Forward and backward FLOPs of one training iteration of configs/<name>.yaml."""
    graph = snrt.load_config(ROOT / "configs" / f"{name}.yaml", {"input.shape": [3, size, size]}).graph
    return sum(node.layer.cost(graph.in_shapes(node.name, batch), phase).flops
               for node in graph.nodes.values() for phase in (FORWARD, BACKWARD))


def seconds(name, size, batch, rounds, iterations):
    """{"snrt": s, "torch": s}: median seconds per iteration over rounds taking turns."""
    args = Namespace(network=name, size=size, batch=batch, iterations=iterations)
    runs = {"snrt": [], "torch": []}
    for _ in range(rounds):
        for framework in runs:
            runs[framework] += spawn(str(ROOT), framework, args, "none")["seconds"]
    return {framework: statistics.median(s) for framework, s in runs.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=2, help="timed iterations per process, after 1 warm-up")
    parser.add_argument("--repeats", type=int, default=10, help="timed SGEMMs per size")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    meta = machine()
    rate = sgemm_rate(args.repeats)
    print(f"SGEMM on {timing.cpu_model()}: {rate:.1f} GFLOP/s", flush=True)
    rows = []
    for name, size, batch in CASES:
        flops = useful_flops(name, size, batch)
        timed = seconds(name, size, batch, args.rounds, args.iterations)
        row = {"network": name, "size": size, "batch": batch, "gflop": flops / 1e9, "seconds": timed,
               "gflops": {k: flops / s / 1e9 for k, s in timed.items()}}
        row["share_of_sgemm"] = {k: g / rate for k, g in row["gflops"].items()}
        rows.append(row)
        print(f"{name} {size} b{batch}: {flops / 1e9:.1f} GFLOP; snrt {timed['snrt']:.3f} s "
              f"({row['share_of_sgemm']['snrt']:.0%} of SGEMM), torch {timed['torch']:.3f} s "
              f"({row['share_of_sgemm']['torch']:.0%})", flush=True)
    meta.update({"rounds": args.rounds, "iterations": args.iterations, "sgemm_gflops": rate})
    save_json(args.out, "cpu_gflops", {"meta": meta, "rows": rows})
    lines = ["# Useful GFLOP/s of training iterations on this CPU", "", meta_line(meta, quick=False), "",
             f"`python scripts/bench_gflops.py --rounds {args.rounds}`. SGEMM (NumPy's BLAS, float32, n = 1024 "
             f"and 2048, every core, best of {args.repeats}): **{rate:.1f} GFLOP/s**. Useful FLOPs: the layers' "
             "forward and backward FLOPs as snrt's cost model counts them (2 per multiply-add), the same for both "
             "frameworks; seconds: the median per iteration, policy none, fp32, each framework in fresh processes "
             "taking turns (scripts/compare_speed.py).", ""]
    lines += table(["network", "image", "batch", "GFLOP per iteration", "snrt s", "snrt GFLOP/s", "share of SGEMM",
                    "PyTorch s", "PyTorch GFLOP/s", "share of SGEMM"],
                   [[r["network"], r["size"], r["batch"], f"{r['gflop']:.1f}", f"{r['seconds']['snrt']:.3f}",
                     f"{r['gflops']['snrt']:.1f}", f"{r['share_of_sgemm']['snrt']:.0%}", f"{r['seconds']['torch']:.3f}",
                     f"{r['gflops']['torch']:.1f}", f"{r['share_of_sgemm']['torch']:.0%}"] for r in rows])
    save_markdown(args.out, "cpu_gflops", lines)


if __name__ == "__main__":
    main()
