"""The executor's own cost per plan step: every kernel, copy and optimizer update replaced by
one that does nothing, so what is left is the loop, its bookkeeping and the arena's
reservations. Plans are the real ones (CIFAR ResNet-110 and ResNet-50 under `none` and
`superneurons`).

    python scripts/bench_executor.py          # writes results/bench_executor.{md,json}
"""

import timing  # noqa: I001  (first: it sets the BLAS threads before numpy loads)

import json
import os
import sys
import time
from pathlib import Path

from snrt.backends.base import CopyEvent
from snrt.backends.numpy_backend import NumpyBackend
import snrt
from snrt.executor import Executor
from snrt.optim import SGD
from snrt.scheduler.planner import make_plan

ROOT = Path(__file__).resolve().parent.parent
CASES = [("cifar_resnet110", 32, 32), ("resnet50", 224, 8)]
POLICIES = ("none", "superneurons")


class EmptyKernel:
    """A kernel that does nothing, with its layer's facts."""

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        pass

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        pass


class DoneEvent(CopyEvent):
    def wait(self):
        pass


class EmptyBackend(NumpyBackend):
    """The CPU backend with empty kernels, no gradient sums and copies that are done at once."""

    def kernel_for(self, layer, in_shapes):
        return EmptyKernel(super().kernel_for(layer, in_shapes))

    def accumulate(self, total, part):
        pass

    def update(self, optimizer, w, g, states, weight_decay, lr, count, workspace, grad_scale=1.0):
        pass

    def offload(self, buffer):
        return DoneEvent()

    def prefetch(self, buffer, source):
        return DoneEvent()


def measure(name, size, batch, policy, iterations=20):
    """Seconds per step of `executor.run` over `iterations` runs (after one warm-up)."""
    graph = snrt.load_config(ROOT / "configs" / f"{name}.yaml", {"input.shape": [3, size, size]}).graph
    plan = make_plan(graph, batch, policy, cost_model=NumpyBackend.cost_model, kernels=NumpyBackend.kernel_choice())
    backend = EmptyBackend(plan.arena_bytes, plan.host_bytes)
    executor = Executor(graph, plan, backend)
    feed = {input_name: None for input_name, _ in plan.inputs}
    backend.upload = lambda view, array: None
    optimizer = SGD()
    executor.run(feed, 0, 0, optimizer)
    start = time.perf_counter()
    for i in range(iterations):
        executor.run(feed, i + 1, 0, optimizer)
    seconds = (time.perf_counter() - start) / iterations
    backend.close()
    return {"network": name, "size": size, "batch": batch, "policy": policy, "steps": len(plan.steps),
            "seconds_per_iteration": seconds, "us_per_step": seconds / len(plan.steps) * 1e6}


def main():
    load = os.getloadavg()[0]
    rows = [measure(name, size, batch, policy) for name, size, batch in CASES for policy in POLICIES]
    lines = ["# Executor overhead per plan step", "",
             "Every kernel, copy and update replaced by one that does nothing: the time left is the "
             f"executor's own (`python scripts/bench_executor.py` on {timing.cpu_model()}; load average {load:.2f}).",
             "",
             "| network | batch | policy | steps | ms per iteration | us per step |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['network']} {r['size']}x{r['size']} | {r['batch']} | {r['policy']} | {r['steps']} | "
                     f"{r['seconds_per_iteration'] * 1e3:.1f} | {r['us_per_step']:.2f} |")
    print("\n".join(lines))
    if "--no-write" not in sys.argv:
        (ROOT / "results" / "bench_executor.md").write_text("\n".join(lines) + "\n")
        (ROOT / "results" / "bench_executor.json").write_text(json.dumps({"load_average": load, "cpu_model": timing.cpu_model(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
