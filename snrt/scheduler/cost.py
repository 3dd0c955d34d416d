"""The cost model: how long a step takes and how long a copy takes, as plain numbers.

Times come from each layer's `cost` (FLOPs and bytes moved) and three machine rates. The
defaults describe the CPU backend on a 2-core machine (fitted to measured kernel times by
scripts/calibrate_cpu_cost.py, results/cost_calibration.md; the per-step overhead is mostly
Python's) and a PCIe-attached GPU (not measured); `simulate`
replays a plan's steps on the three streams (compute, device-to-host, host-to-device) and
returns the predicted iteration time and the copy time left exposed.
"""

from dataclasses import dataclass

from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, Cost, numel


@dataclass(frozen=True)
class CostModel:
    """Machine rates: FLOP/s of the kernels, bytes/s of memory traffic and of host copies."""

    flops_per_s: float = 210e9
    memory_bytes_per_s: float = 11e9
    copy_bytes_per_s: float = 5e9
    step_overhead_s: float = 110e-6

    def kernel_s(self, cost):
        """Seconds for one kernel call of Cost `cost`."""
        return cost.flops / self.flops_per_s + cost.bytes / self.memory_bytes_per_s + self.step_overhead_s

    def copy_s(self, nbytes):
        """Seconds to copy `nbytes` between host and device."""
        return nbytes / self.copy_bytes_per_s


CPU = CostModel()
CUDA = CostModel(flops_per_s=8e12, memory_bytes_per_s=500e9, copy_bytes_per_s=12e9, step_overhead_s=10e-6)


def step_cost(step, graph, batch):
    """The Cost of a compute step: its layer's, or an update's memory traffic; None for the
    others (copies and bookkeeping take no compute time)."""
    if step.kind in ("forward", "recompute", "backward"):
        phase = BACKWARD if step.kind == "backward" else FORWARD
        node = graph[step.node]
        return node.layer.cost(graph.in_shapes(node.name, batch), phase)
    if step.kind == "update":
        return Cost(flops=0, bytes=update_bytes(graph, step.node, len(step.slots[0][2])))
    return None


def update_bytes(graph, node, states=1):
    """Bytes an update of `node`'s parameters moves: parameter, gradient and `states` optimizer
    buffers per parameter read, parameter and states written."""
    specs = graph[node].layer.param_specs(graph.in_shapes(node, 1))
    return (3 + 2 * states) * FLOAT32_BYTES * sum(numel(spec.shape) for spec in specs.values())


def step_seconds(step, graph, batch, model):
    """Predicted compute-stream seconds of `step` (copies and bookkeeping take none)."""
    cost = step_cost(step, graph, batch)
    return 0.0 if cost is None else model.kernel_s(cost)


def simulate(steps, buffers, seconds, model):
    """(iteration seconds, exposed copy seconds) with copies on their own FIFO streams.

    `seconds[i]` is step i's compute time. An offload or prefetch starts when issued (and
    its stream is free); a wait stalls the compute stream until that copy is done.
    """
    now = 0.0
    stream_free = {"offload": 0.0, "prefetch": 0.0}
    done = {}
    stalled = 0.0
    for step, s in zip(steps, seconds):
        if step.kind in stream_free:
            start = max(now, stream_free[step.kind])
            stream_free[step.kind] = done[step.buffer] = start + model.copy_s(buffers[step.buffer].nbytes)
        elif step.kind == "wait":
            if done[step.buffer] > now:
                stalled += done[step.buffer] - now
                now = done[step.buffer]
        now += s
    return now, stalled
