"""The executor: one loop over a Plan's steps, one handler per step kind.

It never decides anything the plan did not say: buffers come alive at the step the plan lists
them under `allocations`, die at `free` steps, and every array a kernel touches is a view of
the backend's arena at the planned offset.
"""

import time

from snrt.layers.base import KernelContext, Saved
from snrt.scheduler.plan import PERSISTENT_ROLES


class PlanViolation(RuntimeError):
    """Check mode found the run disagreeing with its plan (a planner bug)."""


class Executor:
    """Runs `plan` for `graph` on `backend` (a snrt.backends.base.Backend). Persistent buffers
    are reserved once, here, and start at zero."""

    def __init__(self, graph, plan, backend):
        self.graph, self.plan, self.backend = graph, plan, backend
        self.xp = backend.xp
        arena = backend.arena
        self.views = [arena.view(b) if b.offset >= 0 else None for b in plan.buffers]
        self.persistent = {}  # (node, "weight" / "weight:momentum" / ...) -> buffer id
        for b in plan.buffers:
            if b.role in PERSISTENT_ROLES:
                node, _, rest = b.name.partition(":")
                self.persistent[(node, rest)] = b.id
                arena.reserve(b)
                self.views[b.id].fill(0)  # optimizer state starts at zero; the rest is loaded
        self.node_index = {name: i for i, name in enumerate(graph.nodes)}
        self.kernels = {  # the backend's kernel choice: the layer itself, or a faster kernel for it
            name: backend.kernel_for(node.layer, graph.in_shapes(name, plan.batch))
            for name, node in graph.nodes.items() if node.inputs
        }
        self.waited = []  # copy events waited for this iteration (their times are read at the end)
        self.handlers = {
            "forward": self._forward, "recompute": self._forward, "backward": self._backward,
            "update": self._update, "free": self._free, "offload": self._offload,
            "prefetch": self._prefetch, "wait": self._wait,
        }
        self.pending = {}  # buffer id -> copy event
        self.measured_bytes = [0] * len(plan.steps)  # live arena bytes seen at each step
        self.copy_stats = {"copy_s": 0.0, "stalled_s": 0.0}  # copy time, and how much the compute waited
        self.optimizer = None
        self.lr = 0.0

    def view_of(self, node, name):
        """The array of a persistent buffer, e.g. view_of("conv1", "weight")."""
        return self.views[self.persistent[(node, name)]]

    def run(self, feed, iteration, seed, optimizer=None, lr=0.0):
        """One pass over the plan. `feed` maps input node names to host arrays (batch first).

        Returns (per-sample losses, per-sample correct flags) as host arrays, read before the
        iteration's buffers are released, or None when the graph has no loss.
        """
        self.iteration, self.seed, self.optimizer, self.lr = iteration, seed, optimizer, lr
        arena, buffers = self.backend.arena, self.plan.buffers
        for i, step in enumerate(self.plan.steps):
            for b in self.plan.allocations[i]:
                arena.reserve(buffers[b])
            if i == 0:
                self._feed(feed)
            self.measured_bytes[i] = arena.live_bytes
            if arena.check:
                self._verify(i, step)
            self.handlers[step.kind](step)
        outputs = self._outputs()
        for event in self.waited:  # reading a copy's time may block, so only now
            self.copy_stats["copy_s"] += event.seconds
        self.waited.clear()
        for b in list(arena.live.values()):
            if b.role not in PERSISTENT_ROLES:
                arena.release(b)
        return outputs

    def _outputs(self):
        if not self.plan.loss:
            return None
        out, _, probs, labels = self.plan.loss
        v, to_host = self.views, self.backend.to_host
        correct = self.xp.argmax(v[probs], axis=1) == v[labels]
        return to_host(v[out]), to_host(correct)

    def _feed(self, feed):
        for name, b in self.plan.inputs:
            self.backend.upload(self.views[b], feed[name])
        if self.plan.loss and self.plan.loss[1] >= 0:
            self.views[self.plan.loss[1]].fill(1.0 / self.plan.batch)

    def _ctx(self, node, workspace):
        return KernelContext(
            self.xp, training=self.plan.training, seed=self.seed, iteration=self.iteration,
            node_index=self.node_index[node], workspace=self.views[workspace] if workspace >= 0 else None,
        )

    def _named(self, pairs):
        return {name: self.views[b] for name, b in pairs}

    def _forward(self, step):
        layer = self.kernels[step.node]
        xs = [self.views[b] for b in step.inputs]
        layer.forward(self._ctx(step.node, step.workspace), xs, self._named(step.params), self._named(step.state),
                      self.views[step.output], self._named(step.aux), recompute=step.recompute)

    def _backward(self, step):
        layer = self.kernels[step.node]
        v = self.views
        saved = Saved(tuple(v[b] if b >= 0 else None for b in step.saved_inputs),
                      v[step.saved_output] if step.saved_output >= 0 else None)
        gxs = [None if g is None else v[g[1] if g[1] >= 0 else g[0]] for g in step.grad_inputs]
        layer.backward(self._ctx(step.node, step.workspace), v[step.grad_output], saved,
                       self._named(step.params), self._named(step.aux), gxs, self._named(step.grad_params))
        for g in step.grad_inputs:
            if g is not None and g[1] >= 0:
                v[g[0]] += v[g[1]]

    def _update(self, step):
        if self.optimizer is None:
            raise RuntimeError("a training plan needs an optimizer")
        for param, grad, state, decay in step.slots:
            self.optimizer.update(self.xp, self.views[param], self.views[grad],
                                  self.views[state] if state >= 0 else None, decay, self.lr,
                                  self.views[step.workspace])

    def _offload(self, step):
        self.pending[step.buffer] = self.backend.offload(self.plan.buffers[step.buffer])

    def _prefetch(self, step):
        buffers = self.plan.buffers
        self.pending[step.buffer] = self.backend.prefetch(buffers[step.buffer], buffers[step.source])

    def _wait(self, step):
        event = self.pending.pop(step.buffer)
        start = time.perf_counter()
        event.wait()
        self.copy_stats["stalled_s"] += time.perf_counter() - start
        self.waited.append(event)

    def _verify(self, i, step):
        """Check mode: the live bytes are the plan's, and no step reads poisoned memory."""
        arena = self.backend.arena
        if arena.live_bytes != self.plan.device_bytes[i]:
            raise PlanViolation(f"step {i} ({step.kind} {getattr(step, 'node', '')}): {arena.live_bytes} bytes "
                                f"live, the plan predicts {self.plan.device_bytes[i]}")
        if step.kind in ("forward", "recompute", "backward", "update"):
            for b in step.reads():
                buffer = self.plan.buffers[b]
                if buffer.dtype.startswith("float") and bool(self.xp.isnan(self.views[b]).any()):
                    raise PlanViolation(f"step {i} ({step.kind} {step.node}) reads {buffer.name}, which holds "
                                        "poison: it was freed, never written, or not yet prefetched")

    def _free(self, step):
        for b in step.buffers:
            self.backend.arena.release(self.plan.buffers[b])
