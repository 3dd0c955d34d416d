"""The executor: one loop over a Plan's steps, one handler per step kind.

It never decides anything the plan did not say: buffers come alive at the step the plan lists
them under `allocations`, die at `free` steps, and every array a kernel touches is a view of
the backend's arena at the planned offset.

Replay: the plan is static and every tensor has a fixed offset, so on a backend that can
capture (CUDA graphs) the second iteration's steps are captured as one graph and every later
iteration is that graph replayed: the batch copied in, the updates' scalars (learning rate,
step count) written to their rows, one launch. Kept out, and then run step by step: the first
iteration (it compiles kernels and builds cuDNN graphs), check mode, profiling, data
parallel, clipping by the gradients' norm and loss scaling (both read the norm on the host),
and a network whose kernels draw random numbers from the iteration's seed (Dropout).
"""

import math
import time

from snrt.layers.base import KernelContext, Saved
from snrt.layers.staging import Staged, is_two_byte
from snrt.scheduler.fuse import planned_graph
from snrt.scheduler.plan import PERSISTENT_ROLES


class PlanViolation(RuntimeError):
    """Check mode found the run disagreeing with its plan (a planner bug)."""


class Executor:
    """Runs `plan` for `graph` on `backend` (a snrt.backends.base.Backend). Persistent buffers
    are reserved once, here, and start at zero. `graph` is the network as built; `self.graph`
    the one the plan's steps name (fused where the plan was made so, snrt/scheduler/fuse.py).
    Random layers are keyed by their index in `graph`, so fusion never changes their masks.

    Every step is bound once, here, to its views, kernel and KernelContext: running a step is
    one call of a prepared closure, with no lookups and no allocations
    (results/bench_executor.md measures what is left). With `replay` (and a backend that
    captures), iterations after the second are one captured graph each (module docstring).
    """

    def __init__(self, graph, plan, backend, group=None, replay=True):
        self.graph, self.plan, self.backend = planned_graph(graph, plan), plan, backend
        self.group = group  # the ranks the gradients are summed over (snrt.parallel), for plan.ranks > 1
        if plan.ranks > 1 and (group is None or group.size != plan.ranks):
            raise ValueError(f"the plan sums gradients over {plan.ranks} ranks; this process's group has "
                             f"{getattr(group, 'size', 1)}")
        self.xp = backend.xp
        arena = backend.arena
        self.views = [arena.view(b) if b.offset >= 0 else None for b in plan.buffers]
        self.persistent = {}  # (node, "weight" / "weight:momentum" / ...) -> buffer id
        for b in plan.buffers:
            if b.role in PERSISTENT_ROLES and not b.is_copy:
                node, _, rest = b.name.partition(":")
                self.persistent[(node, rest)] = b.id
                if b.resident:  # optimizer state starts at zero (a home in the host store starts so); the rest is loaded
                    arena.reserve(b)
                    self.views[b.id].fill(0)
        self.kernels = {  # the backend's kernel choice: the layer itself, or a faster kernel for it
            name: backend.kernel_for(node.layer, self.graph.in_shapes(name, plan.batch))
            for name, node in self.graph.nodes.items() if node.inputs
        }
        self.contexts = []  # one KernelContext per compute step; run() sets their iteration and seed
        self.context_nodes = []  # the node of each context's step
        self.waited = []  # copy events waited for this iteration (their times are read at the end)
        self.pending = {}  # buffer id -> copy event
        self.measured_bytes = [0] * len(plan.steps)  # live arena bytes seen at each step
        # copy time and how much the compute waited for copies; for gradient exchanges: the time
        # spent starting and polling them (MPI moves data inside these calls), waiting for them, and
        # the bytes (this rank's part) of all and of those already done when waited for
        self.copy_stats = {"copy_s": 0.0, "stalled_s": 0.0, "exchange_calls_s": 0.0, "exchange_stalled_s": 0.0,
                           "exchanged_bytes": 0, "exchanged_early_bytes": 0}
        self.exchanges = []  # gradient exchanges in flight, polled after each backward step
        self.optimizer = None
        self.grad_squares = 0.0  # sum of the squares of this iteration's parameter gradients (clip_norm, loss scaling)
        self.summing_squares, self.loss_scale, self.overflowed = False, 1.0, False  # set by run
        kinds = [s.kind for s in plan.steps]
        self.updates_deferred = "update" not in kinds or kinds.index("update") > max(
            (i for i, k in enumerate(kinds) if k == "backward"), default=-1)
        self.lr = 0.0
        self.iteration = 0  # of the run in progress; the update count is iteration + 1
        node_index = {name: i for i, name in enumerate(graph.nodes)}
        binders = {"forward": self._bind_forward, "recompute": self._bind_forward, "backward": self._bind_backward,
                   "update": self._bind_update, "free": self._bind_free, "offload": self._bind_offload,
                   "prefetch": self._bind_prefetch, "wait": self._bind_wait, "allreduce": self._bind_allreduce,
                   "allreduce_wait": self._bind_allreduce_wait}
        self.actions = [binders[step.kind](step, node_index) for step in plan.steps]
        self.reservations = [tuple(plan.buffers[b] for b in ids) for ids in plan.allocations]
        self.replay_off = None if replay else "turned off (--no-cuda-graph)"  # why steps run one by one
        self.captured, self._captured_with = None, None  # the captured iteration and the optimizer it updates with
        self.runs = self.replayed = 0  # iterations run, and of them run as the captured graph
        self.step_index = -1  # the step that raised in _run_steps (a failed capture names it)
        self.faulted = None  # why no run can follow a failed one (several ranks), else None
        self._update_steps = tuple(i for i, step in enumerate(plan.steps) if step.kind == "update")
        self._update_rows = sum(len(plan.steps[i].slots) for i in self._update_steps)

    def view_of(self, node, name):
        """The array of a persistent buffer, e.g. view_of("conv1", "weight"): its device view,
        or, when the plan streams it, its home in the host store (a host array)."""
        b = self.plan.buffers[self.persistent[(node, name)]]
        if b.resident:
            return self.views[b.id]
        return self.backend.host.slot(b).view(b.dtype).reshape(b.shape)

    def load(self, node, name, value):
        """Write host array `value` into persistent buffer (node, name), wherever it lives."""
        view, buffer = self.view_of(node, name), self.plan.buffers[self.persistent[(node, name)]]
        if buffer.resident:
            self.backend.upload(view, value)
        else:
            view[...] = value
            self.backend.host.settle(buffer)

    def fetch(self, node, name):
        """A host copy of persistent buffer (node, name)."""
        view, buffer = self.view_of(node, name), self.plan.buffers[self.persistent[(node, name)]]
        if buffer.resident:
            return self.backend.to_host(view)
        copy = view.copy()
        self.backend.host.settle(buffer)
        return copy

    def wrap_steps(self, kinds, wrapper):
        """Replace the action of every step whose kind is in `kinds` by `wrapper(step, action)`
        (a no-argument callable that should call `action`), e.g. to time kernels."""
        for i, step in enumerate(self.plan.steps):
            if step.kind in kinds:
                self.actions[i] = wrapper(step, self.actions[i])
        self.replay_off = self.replay_off or "its steps are wrapped (timed one by one)"

    def run(self, feed, iteration, seed, optimizer=None, lr=0.0, loss_scale=1.0):
        """One pass over the plan. `feed` maps input node names to host arrays (batch first).
        With a `loss_scale`, the loss's gradient is multiplied by it and the parameter
        gradients divided by it before the updates, which are all skipped (`overflowed` True)
        when any gradient is not finite.

        Returns (per-sample losses, per-sample correct flags) as host arrays, read before the
        iteration's buffers are released, or None when the graph has no loss.
        """
        if optimizer is not None and optimizer.defers_updates and not self.updates_deferred:
            raise RuntimeError("this optimizer clips by the global gradient norm, but the plan updates each layer "
                               "during the backward pass: plan it with deferred_updates=True")
        if loss_scale != 1.0 and not self.updates_deferred:
            raise RuntimeError("loss scaling skips the updates of an iteration whose gradients overflow, but the plan "
                               "updates each layer during the backward pass: plan it with deferred_updates=True")
        self.optimizer, self.lr, self.iteration, self.loss_scale = optimizer, lr, iteration, loss_scale
        self.summing_squares = optimizer is not None and (optimizer.clip_norm > 0 or loss_scale != 1.0)
        self.grad_squares, self.overflowed = 0.0, False
        for ctx in self.contexts:
            ctx.iteration, ctx.seed = iteration, seed
        if self.faulted:
            raise RuntimeError(self.faulted)
        self.runs += 1
        try:
            if self.replay_refusal() is None:
                if self.captured is not None and self._captured_with is optimizer:
                    return self._replay(feed)
                if self.runs > 1 and self._capture(feed, optimizer):
                    return self._finish()
            self._run_steps(feed)
            return self._finish()
        except BaseException:
            self._abandon()
            raise

    def _abandon(self):
        """After a fault inside an iteration (an error, Ctrl-C): wait for the copies in flight
        (they write to the arena and the host store), then release the iteration's buffers, so
        that the next run starts as the first did. What the iteration updated before the fault
        stays updated. With several ranks, the ranks are out of step and their exchanges may
        never finish: every later run is refused."""
        if self.plan.ranks > 1:
            self.faulted = ("an earlier iteration failed on this rank, so the ranks are out of step: restart the run "
                            "(from its last checkpoint)")
            return
        for event in self.pending.values():
            try:
                event.wait()
            except Exception:  # the fault being raised is the one to report
                pass
        self.pending.clear()
        self.waited.clear()
        self.backend.synchronize()
        self._release_iteration()

    def replay_refusal(self):
        """None when the next iteration may be replayed (or captured); else why its steps run
        one by one."""
        if self.replay_off:
            return self.replay_off
        unsupported = self.backend.replay_unsupported_reason()
        if unsupported:
            return unsupported
        if self.backend.arena.check:
            return "check mode verifies every step against the plan"
        if getattr(self.backend, "profile", False):
            return "profiling times every step"
        if self.plan.ranks > 1:
            return "the gradient exchange between ranks is driven from the host"
        if self.summing_squares:
            return "clipping by the gradients' norm and loss scaling read the norm on the host every iteration"
        return None

    def describe_replay(self):
        """One line on how the iterations ran: replayed as one graph, or step by step and why."""
        if self.replayed:
            return f"CUDA graph: {self.replayed} of {self.runs} iterations ran as one captured graph"
        return f"steps run one by one: {self.replay_refusal() or 'no iteration captured yet'}"

    def _run_steps(self, feed):
        """Every step in order, the batch `feed` copied in at the first (None: already in)."""
        arena, steps, measured = self.backend.arena, self.plan.steps, self.measured_bytes
        reserve = arena.reserve
        i = 0
        try:
            for i, action in enumerate(self.actions):
                for buffer in self.reservations[i]:
                    reserve(buffer)
                if i == 0 and feed is not None:
                    self._feed(feed)
                measured[i] = arena.live_bytes
                if arena.check:
                    self._verify(i, steps[i])
                action()
        except Exception:
            self.step_index = i
            raise

    def _finish(self):
        """The iteration's outputs (see run); copy times summed; its buffers released."""
        outputs = self._outputs()
        for event in self.waited:  # reading a copy's time may block, so only now
            self.copy_stats["copy_s"] += event.seconds
        self.waited.clear()
        self._release_iteration()
        return outputs

    def _release_iteration(self):
        """Release every buffer of the iteration still live (all but the resident ones)."""
        arena = self.backend.arena
        for b in list(arena.live.values()):
            if not b.resident:
                arena.release(b)

    def _capture(self, feed, optimizer):
        """Capture this iteration's steps as one graph and run it; False (the reason kept in
        `replay_off`, nothing run) where a step cannot be captured."""
        keyed = [node for ctx, node in zip(self.contexts, self.context_nodes) if ctx.read_key]
        if keyed:
            self.replay_off = (f"node {keyed[0]!r} draws random numbers from the iteration's seed, which a replay "
                               "would repeat")
            return False
        self._feed(feed)
        self.step_index = -1
        try:
            with self.backend.capturing(self._update_rows) as captured:
                self._run_steps(None)
                self.step_index = None  # what fails from here, fails ending the capture or launching it
            with self.backend.replaying(captured):  # the first launch, with the rows as the capture wrote them
                pass
        except Exception as error:  # run step by step from here on; a real fault shows up there again
            self.replay_off = f"the capture failed {self._where()}: {error}"
            self.pending.clear()
            self.waited.clear()
            self._release_iteration()
            return False
        self.waited.clear()  # captured copies have no times of their own
        self.captured, self._captured_with = captured, optimizer
        self.replayed += 1
        return True

    def _where(self):
        """Where a capture stopped: at step `step_index`, beginning (-1), or ending or
        launching (None)."""
        if self.step_index is None:
            return "at its end or first launch"
        if self.step_index < 0:
            return "as it began"
        step = self.plan.steps[self.step_index]
        return f"at step {self.step_index} ({step.kind} {getattr(step, 'node', '')})"

    def _replay(self, feed):
        """This iteration as the captured graph: the batch in, the updates' rows, one launch."""
        self._feed(feed)
        with self.backend.replaying(self.captured):
            for i in self._update_steps:
                self.actions[i]()
        self.replayed += 1
        return self._finish()

    def _outputs(self):
        """(per-sample loss: the weighted sum over loss layers, per-sample accuracy by the last
        loss layer's probabilities: 0 or 1, or the fraction of pixels right for per-pixel
        labels), on the host; None without a loss layer."""
        if not self.plan.losses:
            return None
        v, to_host = self.views, self.backend.to_host
        total = None
        for out, _, _, _, weight in self.plan.losses:
            term = to_host(v[out]) if weight == 1 else weight * to_host(v[out])
            total = term if total is None else total + term
        _, _, probs, labels, _ = self.plan.losses[-1]
        right = to_host(self.xp.argmax(v[probs], axis=1) == v[labels])
        return total, (right if right.ndim == 1 else right.reshape(len(right), -1).mean(axis=1))

    def _feed(self, feed):
        for name, b in self.plan.inputs:
            self.backend.feed(self.views[b], feed[name])
        samples = self.plan.batch * self.plan.ranks  # the loss is the mean over every rank's samples
        for _, seed, _, _, weight in self.plan.losses:
            if seed >= 0:
                self.views[seed].fill(weight / samples * self.loss_scale)

    # ---- binding: one closure per step ------------------------------------------------
    def _context(self, step, node_index):
        ctx = KernelContext(self.xp, training=self.plan.training, node_index=node_index[step.node],
                            workspace=self.views[step.workspace] if step.workspace >= 0 else None,
                            in_shapes=self.graph.in_shapes(step.node, self.plan.batch))
        self.contexts.append(ctx)
        self.context_nodes.append(step.node)
        return ctx

    def _named(self, pairs):
        return {name: self.views[b] for name, b in pairs}

    def _bind_forward(self, step, node_index):
        ctx, v = self._context(step, node_index), self.views
        args = (ctx, [v[b] for b in step.inputs], self._named(step.params), self._named(step.state), v[step.output],
                self._named(step.aux))
        forward = _kernel(self.kernels[step.node], [*args[1], args[4], *args[5].values()], self.backend.convert).forward
        recompute, release = step.recompute, ctx.release_scratch

        def run():
            release()
            forward(*args, recompute=recompute)
        return run

    def _bind_backward(self, step, node_index):
        ctx, v = self._context(step, node_index), self.views
        saved = Saved(tuple(v[b] if b >= 0 else None for b in step.saved_inputs),
                      v[step.saved_output] if step.saved_output >= 0 else None)
        targets = [None if g is None else g[1] if g[1] >= 0 else g[0] for g in step.grad_inputs]
        # a gradient that took over gy's buffer is written already (Layer.passes_gradient), or
        # is gy's own array, which the kernel writes over (Layer.gradient_in_place)
        in_place = self.graph.nodes[step.node].layer.gradient_in_place
        gxs = [None if b is None or b == step.grad_output and not in_place else v[b] for b in targets]
        args = (ctx, v[step.grad_output], saved, self._named(step.params), self._named(step.aux), gxs,
                self._named(step.grad_params))
        backward = _kernel(self.kernels[step.node], [args[1], *saved.xs, saved.y, *args[4].values(), *gxs],
                           self.backend.convert).backward
        sums = tuple((v[g[0]], v[g[1]]) for g in step.grad_inputs if g is not None and g[1] >= 0)
        release, accumulate = ctx.release_scratch, self.backend.accumulate
        # with several ranks the gradients are complete only once summed (see _bind_allreduce_wait)
        grads = tuple(v[g] for _, g in step.grad_params) if self.plan.ranks == 1 else ()
        vdot, exchanges, stats = self.xp.vdot, self.exchanges, self.copy_stats

        def run():
            release()
            backward(*args)
            for total, part in sums:  # a gradient with several contributions: add this one
                accumulate(total, part)
            if exchanges:  # MPI moves a started exchange on only when asked
                started = time.perf_counter()
                for exchange in exchanges:
                    exchange.poll()
                stats["exchange_calls_s"] += time.perf_counter() - started
            if grads and self.summing_squares:  # complete here: square it
                for g in grads:
                    self.grad_squares += float(vdot(g, g))
        return run

    def _bind_update(self, step, node_index):
        v, buffers = self.views, self.plan.buffers
        slots = tuple((v[param], v[grad], tuple(v[s] for s in states), buffers[param].name, decay)
                      for param, grad, states, decay in step.slots)
        workspace = v[step.workspace] if step.workspace >= 0 else None
        resolved = [None, ()]  # the optimizer last run with, and its (weight decay, lr factor) per slot

        def run():
            optimizer = self.optimizer
            if optimizer is None:
                raise RuntimeError("a training plan needs an optimizer")
            if resolved[0] is not optimizer:
                resolved[:] = [optimizer, tuple(optimizer.settings(name, decay) for *_, name, decay in slots)]
            update, lr, count, scale = self.backend.update, self.lr, self.iteration + 1, self.loss_scale
            if scale != 1.0 and not math.isfinite(self.grad_squares):  # an overflow: no update this iteration
                self.overflowed = True
                return
            grad_scale = optimizer.grad_scale(self.grad_squares / (scale * scale)) / scale
            for (param, grad, states, _, _), (weight_decay, lr_scale) in zip(slots, resolved[1]):
                update(optimizer, param, grad, states, weight_decay, lr * lr_scale, count, workspace, grad_scale)
        return run

    def _bind_offload(self, step, node_index):
        buffer, offload, pending = self.plan.buffers[step.buffer], self.backend.offload, self.pending

        def run():
            pending[buffer.id] = offload(buffer)
        return run

    def _bind_prefetch(self, step, node_index):
        buffers, prefetch, pending = self.plan.buffers, self.backend.prefetch, self.pending
        buffer, source = buffers[step.buffer], buffers[step.source]

        def run():
            pending[buffer.id] = prefetch(buffer, source)
        return run

    def _bind_wait(self, step, node_index):
        b, pending, stats, waited = step.buffer, self.pending, self.copy_stats, self.waited

        def run():
            event = pending.pop(b)
            start = time.perf_counter()
            event.wait()
            stats["stalled_s"] += time.perf_counter() - start
            waited.append(event)
        return run

    def _bind_allreduce(self, step, node_index):
        v, copyto, pending = self.views, self.xp.copyto, self.pending
        gathered = v[step.gathered]
        packing = tuple(zip(_row_parts(gathered[self.group.rank], [v[g] for g in step.grads]),
                            (v[g].reshape(-1) for g in step.grads)))
        start, group, exchanges, stats = self.backend.start_exchange, self.group, self.exchanges, self.copy_stats

        def run():
            for slot, grad in packing:
                copyto(slot, grad)
            started = time.perf_counter()
            pending[step.gathered] = exchange = start(group, gathered)
            stats["exchange_calls_s"] += time.perf_counter() - started
            exchanges.append(exchange)
        return run

    def _bind_allreduce_wait(self, step, node_index):
        v, xp, pending, stats = self.views, self.xp, self.pending, self.copy_stats
        gathered, sums = v[step.gathered], [v[b] for b in step.sums]
        rows = [_row_parts(row, sums) for row in gathered]  # rows[r][j]: rank r's part of sum j
        adding = tuple((s.reshape(-1), tuple(row[j] for row in rows)) for j, s in enumerate(sums))
        vdot = xp.vdot

        exchanges = self.exchanges

        def run():
            exchange = pending.pop(step.gathered)
            exchanges.remove(exchange)
            stats["exchanged_bytes"] += step.nbytes
            if exchange.poll():
                stats["exchanged_early_bytes"] += step.nbytes
            started = time.perf_counter()
            exchange.wait()
            stats["exchange_stalled_s"] += time.perf_counter() - started
            for total, parts in adding:  # in rank order: ((rank 0 + rank 1) + rank 2) + ...
                xp.copyto(total, parts[0])
                for part in parts[1:]:
                    xp.add(total, part, out=total)
            if self.summing_squares:
                for total, _ in adding:
                    self.grad_squares += float(vdot(total, total))
        return run

    def _bind_free(self, step, node_index):
        buffers, release = tuple(self.plan.buffers[b] for b in step.buffers), self.backend.arena.release

        def run():
            for buffer in buffers:
                release(buffer)
        return run

    def _verify(self, i, step):
        """Check mode: the live bytes are the plan's, and no step reads poisoned memory."""
        arena = self.backend.arena
        if arena.live_bytes != self.plan.device_bytes[i]:
            raise PlanViolation(f"step {i} ({step.kind} {getattr(step, 'node', '')}): {arena.live_bytes} bytes "
                                f"live, the plan predicts {self.plan.device_bytes[i]}")
        if step.kind in ("forward", "recompute", "backward", "update"):
            for b in step.reads():
                buffer = self.plan.buffers[b]
                if arena.holds_poison(buffer):
                    raise PlanViolation(f"step {i} ({step.kind} {step.node}) reads {buffer.name}, which holds "
                                        "poison: it was freed, never written, or not yet prefetched")


def _kernel(kernel, arrays, convert):
    """`kernel`, staged in fp32 (converting by `convert`, the backend's) when any of its
    step's `arrays` is stored in 2 bytes."""
    return Staged(kernel, convert) if any(is_two_byte(a) for a in arrays) else kernel


def _row_parts(row, arrays):
    """Consecutive views of the 1-d `row`, one per array of `arrays`, each of its size."""
    parts, at = [], 0
    for a in arrays:
        parts.append(row[at:at + a.size])
        at += a.size
    return parts
