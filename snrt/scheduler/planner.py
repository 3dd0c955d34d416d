"""From a graph to a Plan: the buffer table, the execution order, allocations and offsets.

`make_plan` builds the steps of one iteration (forward in topological order; in training,
backward in reverse order with each node's optimizer update right after its backward, when
its parameter gradients are complete), then derives when every buffer comes alive, the
predicted device bytes per step and each buffer's arena offset.
"""

from snrt.errors import SnrtError
from snrt.layers.base import BACKWARD, FORWARD, numel
from snrt.layers.input import Input
from snrt.scheduler.plan import PERSISTENT_ROLES, Backward, Buffer, Forward, Plan, Update

POLICIES = ("none",)
ALIGN_BYTES = 256
_ITEMSIZE = {"float32": 4, "float64": 8, "int32": 4, "int64": 8, "uint8": 1}


class _Table:
    """Collects buffers in creation order; ids are positions."""

    def __init__(self):
        self.buffers = []

    def add(self, name, shape, dtype, role):
        nbytes = numel(shape) * _ITEMSIZE[dtype]
        self.buffers.append(Buffer(len(self.buffers), name, tuple(shape), dtype, nbytes, role))
        return len(self.buffers) - 1


def make_plan(graph, batch, policy="none", training=True, momentum=True, dtype="float32"):
    """The Plan of one iteration of `graph` at `batch` under `policy`.

    `training` False gives a forward-only (evaluation) plan; `momentum` allocates one
    optimizer-state buffer per parameter.
    """
    if policy not in POLICIES:
        raise SnrtError(f"memory policy {policy!r} is not available; this planner implements: {', '.join(POLICIES)}")
    table = _Table()
    builder = _StepBuilder(graph, batch, table, dtype)
    steps = builder.forward_steps(training)
    if training:
        steps += builder.backward_steps(momentum)
    loss = builder.loss_buffers()
    fed = tuple(b for _, b in builder.input_buffers) + ((loss[1],) if loss and loss[1] >= 0 else ())
    allocations = allocation_points(table.buffers, steps, fed)
    device_bytes = predict_device_bytes(table.buffers, steps, allocations)
    buffers, arena_bytes = assign_offsets(table.buffers)
    return Plan(batch, policy, training, tuple(buffers), tuple(steps), tuple(device_bytes), arena_bytes,
                tuple(allocations), tuple(builder.input_buffers), loss)


class _StepBuilder:
    """Creates buffers and steps for one graph; keeps the node -> buffer maps."""

    def __init__(self, graph, batch, table, dtype):
        self.graph, self.batch, self.table, self.dtype = graph, batch, table, dtype
        self.output, self.aux, self.params, self.state = {}, {}, {}, {}
        self.input_buffers = []
        self.grad = {}
        for node in graph.nodes.values():
            self._node_buffers(node)

    def _node_buffers(self, node):
        name, layer, add = node.name, node.layer, self.table.add
        out_dtype = self.dtype if node.dtype.startswith("float") else node.dtype
        self.output[name] = add(f"{name}:y", node.full_shape(self.batch), out_dtype, "activation")
        if isinstance(layer, Input):
            self.input_buffers.append((name, self.output[name]))
            return
        in_shapes = self.graph.in_shapes(name, self.batch)
        self.params[name] = tuple(
            (p, add(f"{name}:{p}", spec.shape, self.dtype, "parameter"))
            for p, spec in layer.param_specs(in_shapes).items()
        )
        self.state[name] = tuple(
            (s, add(f"{name}:{s}", spec.shape, self.dtype, "state"))
            for s, spec in layer.state_specs(in_shapes).items()
        )
        self.aux[name] = tuple(
            (a, add(f"{name}:{a}", spec.shape, self.dtype if spec.dtype == "compute" else spec.dtype, "aux"))
            for a, spec in layer.aux_specs(in_shapes).items()
        )

    def _workspace(self, name, phase):
        layer = self.graph[name].layer
        nbytes = layer.workspace_bytes(self.graph.in_shapes(name, self.batch), phase, itemsize=_ITEMSIZE[self.dtype])
        return self.table.add(f"{name}:workspace:{phase}", (nbytes,), "uint8", "workspace") if nbytes else -1

    def forward_steps(self, training):
        steps = []
        for node in self.graph.nodes.values():
            if isinstance(node.layer, Input):
                continue
            steps.append(Forward(
                node.name, tuple(self.output[i] for i in node.inputs), self.output[node.name],
                self.aux[node.name], self.params[node.name], self.state[node.name],
                self._workspace(node.name, FORWARD),
            ))
        return steps

    def _needs_grad(self):
        """Nodes whose output gradient is needed: they have parameters upstream of the loss."""
        needs = {}
        for node in self.graph.nodes.values():
            layer = node.layer
            wanted = range(len(node.inputs)) if layer.differentiable_inputs is None else layer.differentiable_inputs
            needs[node.name] = bool(self.params.get(node.name)) or any(needs[node.inputs[i]] for i in wanted)
        return needs

    def backward_steps(self, momentum):
        needs = self._needs_grad()
        add = self.table.add
        for node in self.graph.nodes.values():
            if needs[node.name]:
                self.grad[node.name] = add(f"{node.name}:grad", node.full_shape(self.batch), self.dtype, "gradient")
        written = set()
        steps = []
        for node in reversed(list(self.graph.nodes.values())):
            if not needs[node.name] or isinstance(node.layer, Input):
                continue
            layer = node.layer
            wanted = range(len(node.inputs)) if layer.differentiable_inputs is None else layer.differentiable_inputs
            grad_inputs = []
            for i, source in enumerate(node.inputs):
                if i not in wanted or not needs[source]:
                    grad_inputs.append(None)
                elif source in written:
                    partial = add(f"{node.name}:partial{i}", self.graph[source].full_shape(self.batch), self.dtype, "gradient")
                    grad_inputs.append((self.grad[source], partial))
                else:
                    written.add(source)
                    grad_inputs.append((self.grad[source], -1))
            grad_params = tuple(
                (p, add(f"{node.name}:{p}:grad", self.table.buffers[b].shape, self.dtype, "parameter_gradient"))
                for p, b in self.params[node.name]
            )
            saves = layer.saves
            steps.append(Backward(
                node.name, self.grad[node.name],
                tuple(self.output[i] if k in saves.inputs else -1 for k, i in enumerate(node.inputs)),
                self.output[node.name] if saves.output else -1,
                self.aux[node.name], self.params[node.name], tuple(grad_inputs), grad_params,
                self._workspace(node.name, BACKWARD),
            ))
            if grad_params:
                steps.append(self._update(node, grad_params, momentum))
        return steps

    def _update(self, node, grad_params, momentum):
        specs = node.layer.param_specs(self.graph.in_shapes(node.name, self.batch))
        slots = []
        for (p, param), (_, grad) in zip(self.params[node.name], grad_params):
            buf = self.table.buffers[param]
            state = self.table.add(f"{node.name}:{p}:momentum", buf.shape, self.dtype, "optimizer_state") if momentum else -1
            slots.append((param, grad, state, specs[p].decay))
        largest = max(self.table.buffers[p].nbytes for p, _, _, _ in slots)
        workspace = self.table.add(f"{node.name}:workspace:update", (largest,), "uint8", "workspace")
        return Update(node.name, tuple(slots), workspace)

    def loss_buffers(self):
        """(loss output, its gradient seed or -1, softmax probs, labels) of the graph's loss node;
        () for a graph without one that is only evaluated."""
        losses = [n for n in self.graph.nodes.values() if n.layer.type_name == "SoftmaxCrossEntropy"]
        if len(losses) != 1:
            if self.grad:
                raise ValueError(f"training needs exactly one SoftmaxCrossEntropy node, the graph has {len(losses)}")
            return ()
        node = losses[0]
        probs = dict(self.aux[node.name])["probs"]
        return (self.output[node.name], self.grad.get(node.name, -1), probs, self.output[node.inputs[1]])


def allocation_points(buffers, steps, fed):
    """Per step, the buffers that come alive just before it: those it writes first.

    Persistent buffers are alive from the start; `fed` (inputs, the loss seed) are written
    by the executor before the first step, so they come alive with it.
    """
    seen = {b.id for b in buffers if b.role in PERSISTENT_ROLES}
    points = []
    for i, step in enumerate(steps):
        first = fed if i == 0 else ()
        fresh = tuple(b for b in dict.fromkeys((*first, *step.writes())) if b not in seen)
        seen.update(fresh)
        points.append(fresh)
    return points


def predict_device_bytes(buffers, steps, allocations):
    """Bytes on the device while each step runs: resident + alive (allocated, not yet freed)."""
    live = sum(b.nbytes for b in buffers if b.role in PERSISTENT_ROLES)
    out = []
    for step, fresh in zip(steps, allocations):
        live += sum(buffers[b].nbytes for b in fresh)
        out.append(live)
        if step.kind == "free":
            live -= sum(buffers[b].nbytes for b in step.buffers)
    return out


def assign_offsets(buffers):
    """Every buffer at its own aligned offset, in id order; returns (buffers, arena bytes)."""
    placed, offset = [], 0
    for b in buffers:
        placed.append(Buffer(b.id, b.name, b.shape, b.dtype, b.nbytes, b.role, offset, b.host_slot))
        offset += -(-b.nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return placed, offset
