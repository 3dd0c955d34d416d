"""The cost model: how long a step takes and how long a copy takes, as plain numbers.

Times come from each layer's `cost` (FLOPs and bytes moved) and three machine rates. The
defaults describe the CPU backend on a 2-core machine (fitted to measured kernel times by
scripts/calibrate_cpu_cost.py, results/cost_calibration.md; the per-step overhead is mostly
Python's) and a PCIe-attached GPU (not measured); a step whose kernel the backend's kernel
choice timed (cuDNN's engines, snrt/backends/cudnn_engines.py; the CPU's dense convolutions,
snrt/backends/cpu_choice.py) takes those seconds instead (`step_seconds`); `simulate`
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
    link_bytes_per_s: float = 4e9  # what one rank receives per second in a collective
    collective_latency_s: float = 50e-6

    def kernel_s(self, cost):
        """Seconds for one kernel call of Cost `cost`."""
        return cost.flops / self.flops_per_s + cost.bytes / self.memory_bytes_per_s + self.step_overhead_s

    def copy_s(self, nbytes):
        """Seconds to copy `nbytes` between host and device."""
        return nbytes / self.copy_bytes_per_s

    def exchange_s(self, nbytes, ranks):
        """Seconds to exchange a bucket of `nbytes` per rank among `ranks` ranks (an allgather:
        each rank receives the other ranks' slots)."""
        return self.collective_latency_s * (ranks - 1) + (ranks - 1) * nbytes / self.link_bytes_per_s


CPU = CostModel()
CUDA = CostModel(flops_per_s=8e12, memory_bytes_per_s=500e9, copy_bytes_per_s=12e9, step_overhead_s=10e-6,
                 link_bytes_per_s=20e9, collective_latency_s=20e-6)


def step_cost(step, graph, batch):
    """The Cost of a compute step: its layer's, or an update's memory traffic; None for the
    others (copies and bookkeeping take no compute time)."""
    if step.kind in ("forward", "recompute", "backward"):
        phase = BACKWARD if step.kind == "backward" else FORWARD
        node = graph[step.node]
        return node.layer.cost(graph.in_shapes(node.name, batch), phase)
    if step.kind == "update":
        return Cost(flops=0, bytes=update_bytes(graph, step.node, len(step.slots[0][2])))
    if step.kind == "allreduce":  # packing the bucket into this rank's slot
        return Cost(flops=0, bytes=2 * step.nbytes)
    if step.kind == "allreduce_wait":  # adding the ranks' slots into the summed gradients
        return Cost(flops=step.nbytes // FLOAT32_BYTES * (step.ranks - 1), bytes=(step.ranks + 1) * step.nbytes)
    return None


def update_bytes(graph, node, states=1):
    """Bytes an update of `node`'s parameters moves: parameter, gradient and `states` optimizer
    buffers per parameter read, parameter and states written."""
    specs = graph[node].layer.param_specs(graph.in_shapes(node, 1))
    return (3 + 2 * states) * FLOAT32_BYTES * sum(numel(spec.shape) for spec in specs.values())


def step_seconds(step, graph, batch, model, kernels=None, itemsize=FLOAT32_BYTES):
    """Predicted compute-stream seconds of `step` (copies and bookkeeping take none): a layer's
    step takes what its kernel was timed to take when the kernel choice `kernels` timed it
    (`measured_seconds`: cuDNN's engines, the CPU's dense convolutions) and the step overhead;
    else the cost model's rates."""
    if kernels is not None and step.kind in ("forward", "recompute", "backward"):
        node = graph[step.node]
        measured = kernels.measured_seconds(node.layer, graph.in_shapes(node.name, batch),
                                            BACKWARD if step.kind == "backward" else FORWARD, itemsize)
        if measured is not None:
            return measured + model.step_overhead_s
    cost = step_cost(step, graph, batch)
    return 0.0 if cost is None else model.kernel_s(cost)


def simulate(steps, buffers, seconds, model, stalls=None, intervals=None):
    """(iteration seconds, exposed copy seconds) with copies on their own FIFO streams; a dict
    `stalls` receives the seconds stalled at the waits for each buffer (or gathered bucket), a
    list `intervals` (stream, start, end) of every step that takes time on a stream
    ("compute", "offload", "prefetch", "allreduce").

    `seconds[i]` is step i's compute time. An offload or prefetch starts when issued (and
    its stream is free), an allreduce's exchange once its packing is done (and the previous
    exchange is over); a wait stalls the compute stream until that copy or exchange is done.
    """
    now = 0.0
    stream_free = {"offload": 0.0, "prefetch": 0.0, "allreduce": 0.0}
    done = {}
    stalled = 0.0
    for step, s in zip(steps, seconds):
        if step.kind == "allreduce":
            start = max(now + s, stream_free["allreduce"])
            stream_free["allreduce"] = done[step.gathered] = start + model.exchange_s(step.nbytes, step.ranks)
            if intervals is not None:
                intervals.append(("allreduce", start, stream_free["allreduce"]))
        elif step.kind in stream_free:
            start = max(now, stream_free[step.kind])
            stream_free[step.kind] = done[step.buffer] = start + model.copy_s(buffers[step.buffer].nbytes)
            if intervals is not None:
                intervals.append((step.kind, start, stream_free[step.kind]))
        elif step.kind in ("wait", "allreduce_wait"):
            waited = step.buffer if step.kind == "wait" else step.gathered
            ready = done[waited]
            if ready > now:
                stalled += ready - now
                if stalls is not None:
                    stalls[waited] = stalls.get(waited, 0.0) + ready - now
                now = ready
        if intervals is not None and s:
            intervals.append(("compute", now, now + s))
        now += s
    return now, stalled
