"""Time per training iteration and peak device memory of ResNet-50 under every memory policy
on the CUDA backend (needs a GPU and the gpu extra).

For each policy: the plan (made with the CUDA cost model, in `--precision`), two warm-up
iterations (the first compiles kernels and builds cuDNN graphs, the second is captured as a
CUDA graph unless `--no-cuda-graph`), then the median of `--iterations` timed iterations
(the compute and copy streams synchronized around each; replays of the graph where the
executor could capture it, as `cuda_graph` and `replay` in the row say), the measured peak
of live arena bytes against the plan's, the copy time (CUDA events, of the iterations run
step by step), and what cudaMemGetInfo saw beyond the arena. Then one more iteration
with every step timed by CUDA events: where the time goes (`steps`: GPU seconds per step kind
and layer type, largest first, against the iteration's wall time) and, for a plan with copies,
the share of the copy time that ran while kernels did (`copies.hidden`), each direction's
achieved bandwidth and, with `--figures DIR`, DIR/gpu_streams_POLICY.png: that iteration on
the compute, offload and prefetch streams against the plan's prediction. Writes
results/bench_gpu.json.

    python scripts/bench_gpu.py                      # ResNet-50, 224x224, batch 32
    python scripts/bench_gpu.py --precision tf32 --policies none superneurons
    python scripts/bench_gpu.py --nondeterministic --policies none   # cuDNN's other engines too
    python scripts/bench_gpu.py --no-cuda-graph --policies none superneurons   # step by step
    python scripts/bench_gpu.py --policies auto --budget 1.1GiB     # the fastest plan within a budget
    python scripts/bench_gpu.py --config configs/resnet2500.yaml --batch 16 --image-size 227 --policies superneurons
"""

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

import snrt
from snrt.backends import cuda_unavailable_reason
from snrt.init import initial_parameters, initial_state
from snrt.optim import SGD
from snrt.precision import precision_named
from snrt.runtime import prepare
from snrt.summary import human_bytes
from snrt.units import parse_bytes
from snrt.scheduler.order import ITEMSIZE
from snrt.timeline import copy_overlap, draw_streams, measured_streams, predicted_streams

ROOT = Path(__file__).resolve().parent.parent


def load(config_path, image_size):
    overrides = {"input.shape": lambda shape: [shape[0], image_size, image_size]} if image_size else None
    return snrt.load_config(config_path, overrides)


def profiled(runtime, feed, optimizer, precision, figure=None):
    """One more iteration with every compute step (kernels and updates) and copy timed by CUDA
    events: {"wall_s", "steps": [[what, GPU seconds, count], ...] by step kind and layer type,
    largest first, "copies": None without copies, else {"hidden", "copy_s", "overlapped_s",
    "offload_GBps", "prefetch_GBps"}}; with a `figure` path and copies, that iteration's
    streams against the plan's prediction there."""
    plan, backend, executor = runtime.plan, runtime.backend, runtime.executor
    backend.profile = True
    executor.wrap_steps(("forward", "recompute", "backward", "update"),
                        lambda step, action: lambda: _timed(backend, step, action))
    backend.clear_timeline()
    backend.synchronize()
    start = time.perf_counter()
    executor.run(feed, 0, seed=0, optimizer=optimizer, lr=0.01)
    backend.synchronize()
    wall = time.perf_counter() - start
    events = backend.timeline()
    steps = {}
    for kind, what, s, e in events:
        step_kind, _, node = what.partition(" ")
        if kind == "compute" and node in executor.graph.nodes:  # a step's, not one of its kernels' (nested)
            key = f"{step_kind} {type(executor.graph.nodes[node].layer).__name__}"
            seconds, count = steps.get(key, (0.0, 0))
            steps[key] = (seconds + e - s, count + 1)
    out = {"wall_s": wall, "steps": sorted(([k, s, n] for k, (s, n) in steps.items()), key=lambda r: -r[1]),
           "copies": None}
    if not plan.host_bytes:
        return out
    seconds = {kind: sum(e - s for k, what, s, e in events if k == "copy" and what.startswith(kind))
               for kind in ("offload", "prefetch")}
    nbytes = {kind: sum(plan.buffers[s.buffer].nbytes for s in plan.steps if s.kind == kind) for kind in seconds}
    if figure:
        predicted = predicted_streams(plan, executor.graph, type(backend).planning_cost_model(), backend.kernels,
                                      ITEMSIZE[precision_named(precision).storage])
        draw_streams(predicted, measured_streams(events), figure,
                     f"{plan.policy}, batch {plan.batch}: predicted (upper bars) and CUDA events (lower)")
    out["copies"] = {**copy_overlap(events), **{f"{kind}_GBps": nbytes[kind] / seconds[kind] / 1e9
                                                if seconds[kind] else None for kind in seconds}}
    return out


def _timed(backend, step, action):
    with backend.timed("compute", f"{step.kind} {step.node}"):
        action()


WARMUP = 2  # iterations not timed: the first compiles and builds, the second is captured


def run_policy(config, batch, policy, iterations, budget, precision, deterministic, figures=None, fuse=True,
               replay=True):
    graph = config.graph
    runtime = prepare(graph, batch, policy, budget, backend="cuda", precision=precision, deterministic=deterministic,
                      values={**initial_parameters(graph, 0), **initial_state(graph)}, fuse=fuse, replay=replay)
    plan, backend, executor = runtime.plan, runtime.backend, runtime.executor
    try:
        rng = np.random.default_rng(0)
        feed = {}
        for name, b in plan.inputs:
            if plan.buffers[b].dtype.startswith("int"):
                feed[name] = rng.integers(0, config.input.classes, batch)
            else:
                feed[name] = rng.standard_normal((batch, *config.input.shape)).astype(np.float32)
        optimizer = SGD(momentum=0.9)
        seconds = []
        for iteration in range(iterations + WARMUP):
            backend.synchronize()
            start = time.perf_counter()
            executor.run(feed, iteration, seed=0, optimizer=optimizer, lr=0.01)
            backend.synchronize()
            if iteration >= WARMUP:
                seconds.append(time.perf_counter() - start)
        report = backend.memory_report()
        replayed, replay = executor.replayed > 0, executor.describe_replay()
        copy_s = executor.copy_stats["copy_s"] / max(1, executor.runs - executor.replayed)  # replays time no copy
        profile = profiled(runtime, feed, optimizer, precision, figures and f"{figures}/gpu_streams_{policy}.png")
        return {
            "policy": policy, "plan_policy": plan.policy, "budget": budget, "precision": precision,
            "deterministic": deterministic, "fused": fuse, "batch": batch, "cuda_graph": replayed, "replay": replay,
            "plan_steps": len(plan.steps),
            "seconds_per_iteration": statistics.median(seconds), "images_per_s": batch / statistics.median(seconds),
            "predicted_s": plan.predicted_s,
            "planned_peak_bytes": plan.peak_bytes, "measured_peak_bytes": backend.arena.peak_bytes,
            "arena_bytes": plan.arena_bytes, "host_bytes": plan.host_bytes,
            "copy_s": copy_s, "memory": report, "kernels": backend.kernels.summary(),
            "profiled_wall_s": profile["wall_s"], "steps": profile["steps"], "copies": profile["copies"],
        }
    finally:
        runtime.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "resnet50.yaml"))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--policies", nargs="*", default=list(snrt.POLICIES))
    parser.add_argument("--precision", choices=("fp32", "tf32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--nondeterministic", action="store_true", help="admit cuDNN's non-deterministic engines")
    parser.add_argument("--no-fuse", dest="fuse", action="store_false",
                        help="plan every layer as its own node (no BatchNorm+ReLU fusion)")
    parser.add_argument("--no-cuda-graph", dest="replay", action="store_false",
                        help="run every iteration step by step (no captured CUDA graph)")
    parser.add_argument("--figures", help="folder for each copying policy's streams figure")
    parser.add_argument("--budget", type=parse_bytes, default=None,
                        help="device budget (12GiB, 1.5GB, bytes); policy auto needs one")
    parser.add_argument("--out", default=str(ROOT / "results" / "bench_gpu.json"))
    args = parser.parse_args()
    reason = cuda_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"bench_gpu needs a CUDA device: {reason}")
    from snrt.backends.cupy_backend import device_summary

    config = load(args.config, args.image_size)
    doc = {"device": device_summary(), "config": args.config, "precision": args.precision,
           "deterministic": not args.nondeterministic, "fused": args.fuse, "cuda_graph": args.replay,
           "when": datetime.now(timezone.utc).isoformat(), "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for policy in args.policies:
        row = run_policy(config, args.batch, policy, args.iterations, args.budget, args.precision,
                         not args.nondeterministic, args.figures, args.fuse, args.replay)
        doc["rows"].append(row)
        Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")  # after each policy: a cut-off run keeps its rows
        print(f"{policy:13s} {row['seconds_per_iteration'] * 1e3:9.1f} ms/iter  {row['images_per_s']:8.1f} img/s  "
              f"peak {human_bytes(row['measured_peak_bytes'])} (plan {human_bytes(row['planned_peak_bytes'])})  "
              f"untracked {human_bytes(row['memory']['untracked_bytes'])}  kernels {row['kernels']}"
              + (f"  copies {row['copies']['hidden']:.0%} hidden" if row["copies"] else ""), flush=True)
        print(f"  {row['replay']}", flush=True)
        gpu_s = sum(seconds for _, seconds, _ in row["steps"])
        print(f"  predicted {row['predicted_s'] * 1e3:.1f} ms; profiled iteration {row['profiled_wall_s'] * 1e3:.1f} ms, "
              f"{gpu_s * 1e3:.1f} ms of it in steps: "
              + ", ".join(f"{what} {seconds * 1e3:.1f} ({count})" for what, seconds, count in row["steps"][:8]),
              flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
