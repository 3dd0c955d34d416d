"""The executor: one loop over a Plan's steps, one handler per step kind.

It never decides anything the plan did not say: buffers come alive at the step the plan lists
them under `allocations`, die at `free` steps, and every array a kernel touches is a view of
the backend's arena at the planned offset.
"""

from snrt.layers.base import KernelContext, Saved
from snrt.scheduler.plan import PERSISTENT_ROLES


class Executor:
    """Runs `plan` for `graph` on `backend`. Persistent buffers are reserved once, here."""

    def __init__(self, graph, plan, backend):
        self.graph, self.plan, self.backend = graph, plan, backend
        self.xp = backend.xp
        arena = backend.arena
        self.views = [arena.view(b) for b in plan.buffers]
        for b in plan.buffers:
            if b.role in PERSISTENT_ROLES:
                arena.reserve(b)
        self.node_index = {name: i for i, name in enumerate(graph.nodes)}
        self.handlers = {
            "forward": self._forward, "recompute": self._forward, "backward": self._backward,
            "update": self._update, "free": self._free,
        }
        self.optimizer = None
        self.lr = 0.0

    def view_of(self, node, name):
        """The array of a persistent buffer, e.g. view_of("conv1", "weight")."""
        return self.views[self._persistent_ids()[(node, name)]]

    def _persistent_ids(self):
        if not hasattr(self, "_persistent"):
            self._persistent = {}
            for b in self.plan.buffers:
                if b.role in PERSISTENT_ROLES:
                    node, _, rest = b.name.partition(":")
                    self._persistent[(node, rest)] = b.id
        return self._persistent

    def run(self, feed, iteration, seed, optimizer=None, lr=0.0):
        """One pass over the plan. `feed` maps input node names to host arrays (batch first)."""
        self.iteration, self.seed, self.optimizer, self.lr = iteration, seed, optimizer, lr
        arena, buffers = self.backend.arena, self.plan.buffers
        for i, step in enumerate(self.plan.steps):
            for b in self.plan.allocations[i]:
                arena.reserve(buffers[b])
            if i == 0:
                self._feed(feed)
            self.handlers[step.kind](step)
        for b in list(arena.live.values()):
            if b.role not in PERSISTENT_ROLES:
                arena.release(b)

    def _feed(self, feed):
        for name, b in self.plan.inputs:
            self.views[b][...] = self.xp.asarray(feed[name])
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
        layer = self.graph[step.node].layer
        xs = [self.views[b] for b in step.inputs]
        layer.forward(self._ctx(step.node, step.workspace), xs, self._named(step.params), self._named(step.state),
                      self.views[step.output], self._named(step.aux), recompute=step.recompute)

    def _backward(self, step):
        layer = self.graph[step.node].layer
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

    def _free(self, step):
        for b in step.buffers:
            self.backend.arena.release(self.plan.buffers[b])
