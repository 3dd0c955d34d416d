"""Execution order of one iteration: the buffer table and the compute steps.

Forward runs in topological order; in training, backward runs in reverse order, gradients of
a tensor read by several nodes are summed (the first contribution is written, later ones go
through a partial buffer and are added), and each node's optimizer update comes right after
its backward, when its parameter gradients are complete (fused update). A layer whose input
gradients are its output's gradient itself (`passes_gradient`: Add, Identity) lets them take
over gy's buffer: a first contribution is then that buffer (nothing copied), a later one adds
gy itself (no partial buffer). So does one whose input gradients are one elementwise function
of gy (`gradient_in_place`: Add+ReLU's masked gy), computed over gy in place, where its step is
the last to read gy. Several inputs' gradients may be the one buffer where no later
contribution to one of them can reach another's before it is read (`_may_share`): a residual
block's Add hands gy to both branches and copies nothing.
"""

from dataclasses import dataclass

from snrt.layers.base import BACKWARD, FORWARD, numel
from snrt.layers.input import Input
from snrt.precision import FP32, precision_named
from snrt.scheduler.plan import Backward, Buffer, Forward, Update, evolve
from snrt.scheduler.offsets import aligned
from snrt.scheduler.options import PlanOptions
from snrt.scheduler.reduce import plan_reduction

ITEMSIZE = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8, "uint8": 1}


@dataclass
class Iteration:
    """The unscheduled iteration: buffers (ids are positions), steps, and where things are."""

    buffers: list
    steps: list
    inputs: tuple  # ((input node, buffer id), ...)
    losses: tuple  # per loss node: (output, gradient seed or -1, probs, labels, weight)
    output: dict  # node -> activation buffer id


def build_iteration(graph, batch, options=PlanOptions()):
    """Buffers and compute steps of one iteration of `graph` at `batch` (forward only when not
    `options.training`); of PlanOptions `options` it reads what `options.iteration_key()` names.

    `options.kernels` (a kernel choice, see snrt.layers.base.LayerKernels) sizes the workspaces
    for the kernels a backend will run. Each layer's update follows its backward step, or, with
    `deferred_updates`, all updates follow the last backward step (in the same order). With
    several `ranks` the gradients are summed across them in buckets of about `bucket_bytes`
    before the (deferred) updates: see snrt/scheduler/reduce.py.
    """
    training, optimizer_states, precision, kernels, deferred_updates, ranks, bucket_bytes = options.iteration_key()
    table = BufferTable()
    builder = _StepBuilder(graph, batch, table, precision_named(precision).storage, kernels)
    steps = builder.forward_steps()
    if training:
        steps += builder.backward_steps(optimizer_states, deferred_updates or ranks > 1)
        steps = plan_reduction(steps, table, ranks, bucket_bytes)
    return Iteration(table.buffers, steps, tuple(builder.input_buffers), builder.loss_buffers(), builder.output)


class BufferTable:
    """Collects buffers in creation order (ids are positions), and the bytes of the host store
    the passes gave homes in so far (`host_bytes`: the next free host offset)."""

    def __init__(self):
        self.buffers = []
        self.host_bytes = 0

    def add(self, name, shape, dtype, role, host_slot=-1):
        nbytes = numel(shape) * ITEMSIZE[dtype]
        self.buffers.append(Buffer(len(self.buffers), name, tuple(shape), dtype, nbytes, role, host_slot=host_slot))
        return len(self.buffers) - 1

    def home(self, b):
        """Give buffer `b` a home at the end of the host store (aligned)."""
        self.buffers[b] = evolve(self.buffers[b], host_slot=self.host_bytes)
        self.host_bytes += aligned(self.buffers[b].nbytes)

    def new_version(self, b, count):
        """Add the next version of buffer `b`: a buffer like it (shape, dtype, role, home in the
        host store) named "<name>@k"; `count` maps base names to the versions made so far and is
        updated. Its id."""
        base = self.buffers[b].name.split("@")[0]
        count[base] = count.get(base, 0) + 1
        self.buffers.append(evolve(self.buffers[b], id=len(self.buffers), name=f"{base}@{count[base]}"))
        return len(self.buffers) - 1


class _StepBuilder:
    """Creates buffers and steps for one graph; keeps the node -> buffer maps. Activations,
    their gradients and the layers' saved tensors are stored in `storage` (a dtype name), except
    where a layer keeps fp32; parameters, their gradients, state and optimizer state in fp32
    (snrt/precision.py)."""

    def __init__(self, graph, batch, table, storage, kernels):
        self.graph, self.batch, self.table, self.storage, self.kernels = graph, batch, table, storage, kernels
        self.output, self.aux, self.params, self.state = {}, {}, {}, {}
        self.input_buffers = []
        self.grad = {}
        self.owners = {}  # gradient buffer -> the nodes whose output gradient it is (several: see _may_share)
        self.position = {name: i for i, name in enumerate(graph.nodes)}
        self.consumers = graph.consumers()
        for node in graph.nodes.values():
            self._node_buffers(node)

    def _node_buffers(self, node):
        name, layer, add = node.name, node.layer, self.table.add
        out_dtype = self._stored(layer) if node.dtype.startswith("float") else node.dtype
        self.output[name] = add(f"{name}:y", node.full_shape(self.batch), out_dtype, "activation")
        if isinstance(layer, Input):
            self.input_buffers.append((name, self.output[name]))
            return
        in_shapes = self.graph.in_shapes(name, self.batch)
        self.params[name] = tuple(
            (p, add(f"{name}:{p}", spec.shape, FP32, "parameter"))
            for p, spec in layer.param_specs(in_shapes).items()
        )
        self.state[name] = tuple(
            (s, add(f"{name}:{s}", spec.shape, FP32, "state"))
            for s, spec in layer.state_specs(in_shapes).items()
        )
        self.aux[name] = tuple(
            (a, add(f"{name}:{a}", spec.shape, self._stored(layer, a) if spec.dtype == "compute" else spec.dtype, "aux"))
            for a, spec in layer.aux_specs(in_shapes).items()
        )

    def _stored(self, layer, aux=None):
        """The dtype of `layer`'s floating-point output, or of its saved tensor named `aux`."""
        return FP32 if layer.keeps_fp32 or aux in layer.fp32_aux else self.storage

    def _workspace(self, name, phase):
        layer, in_shapes = self.graph[name].layer, self.graph.in_shapes(name, self.batch)
        itemsize = ITEMSIZE[self.storage]  # of the run's tensors (a kernel of a layer keeping fp32 still reads them)
        nbytes = self.kernels.workspace_bytes(layer, in_shapes, phase, itemsize)
        return self.table.add(f"{name}:workspace:{phase}", (nbytes,), "uint8", "workspace") if nbytes else -1

    def forward_steps(self):
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
        """Nodes whose output gradient is needed: they feed the loss and have parameters at
        or above them. (A branch the loss does not read gets no gradient, as in autograd.)"""
        feeds_loss = {n.name for n in self.graph.nodes.values() if n.layer.type_name == "SoftmaxCrossEntropy"}
        for node in reversed(list(self.graph.nodes.values())):
            if node.name in feeds_loss:
                feeds_loss.update(node.inputs)
        needs = {}
        for node in self.graph.nodes.values():
            layer = node.layer
            wanted = range(len(node.inputs)) if layer.differentiable_inputs is None else layer.differentiable_inputs
            upstream = bool(self.params.get(node.name)) or any(needs[node.inputs[i]] for i in wanted)
            needs[node.name] = upstream and node.name in feeds_loss
        return needs

    def backward_steps(self, optimizer_states, deferred_updates=False):
        self.needs = needs = self._needs_grad()
        add = self.table.add
        written = set()
        steps, updates = [], []
        for node in reversed(list(self.graph.nodes.values())):
            if not needs[node.name] or isinstance(node.layer, Input):
                continue
            layer = node.layer
            gy = self._grad(node.name)  # made by a consumer's backward step, or the loss's seed
            wanted = range(len(node.inputs)) if layer.differentiable_inputs is None else layer.differentiable_inputs
            grad_inputs = []
            sources = [source for i, source in enumerate(node.inputs) if i in wanted and needs[source]]
            repeats = len(set(sources)) < len(sources)  # then gy itself may take a contribution in this step
            # (asked before this step's inputs join gy's owners)
            hands_on = layer.passes_gradient or layer.gradient_in_place and self._only_reader(gy, node)
            for i, source in enumerate(node.inputs):
                if i not in wanted or not needs[source]:
                    grad_inputs.append(None)
                    continue
                takes_over = hands_on and self.grad.get(source) != gy and self._like(source, gy)
                if source in written:  # a later contribution: gy itself is added, unless gy changes in this step
                    total = self.table.buffers[self.grad[source]]
                    partial = (gy if takes_over and not repeats
                               else add(f"{node.name}:partial{i}", total.shape, total.dtype, "gradient"))
                    grad_inputs.append((total.id, partial))
                else:
                    written.add(source)
                    if takes_over and self._may_share(gy, source, node):
                        self.grad[source] = gy
                        self.owners[gy].append(source)
                    grad_inputs.append((self._grad(source), -1))
            grad_params = tuple(
                (p, add(f"{node.name}:{p}:grad", self.table.buffers[b].shape, FP32, "parameter_gradient"))
                for p, b in self.params[node.name]
            )
            saves = layer.saves
            steps.append(Backward(
                node.name, gy,
                tuple(self.output[i] if k in saves.inputs else -1 for k, i in enumerate(node.inputs)),
                self.output[node.name] if saves.output else -1,
                self.aux[node.name], self.params[node.name], tuple(grad_inputs), grad_params,
                self._workspace(node.name, BACKWARD),
            ))
            if grad_params:
                (updates if deferred_updates else steps).append(self._update(node, grad_params, optimizer_states))
        return steps + updates

    def _grad(self, name):
        """The buffer of node `name`'s output gradient, stored as the output; made when first
        asked for (by the first backward step that writes it, else by its own)."""
        if name not in self.grad:
            output = self.table.buffers[self.output[name]]
            self.grad[name] = self.table.add(f"{name}:grad", output.shape, output.dtype, "gradient")
            self.owners[self.grad[name]] = [name]
        return self.grad[name]

    def _may_share(self, gy, source, node):
        """Whether `source`'s gradient may be buffer `gy` as well, at `node`'s backward step
        (which reads gy and passes it on): gy's owners whose own backward step, the one that
        reads their gradient, is still to come (`source` one of them) must not see each
        other's later contributions, which are added into the buffer. So at most one of them
        takes later contributions (from consumers whose backward steps are still to come, or
        from `node` itself where it reads the owner more than once), and every other reads its
        gradient before the first of those is added."""
        position, here = self.position, self.position[node.name]
        pending = [s for s in self.owners[gy] if position[s] < here] + [source]
        late = {s: [position[c] for c in self.consumers[s] if position[c] < here and self.needs[c]]
                + ([here] if node.inputs.count(s) > 1 else []) for s in pending}
        writers = [s for s in pending if late[s]]
        if len(writers) > 1:
            return False
        first_write = max(late[writers[0]]) if writers else -1  # backward steps run in decreasing position
        return all(position[s] > first_write for s in pending if s not in writers)

    def _only_reader(self, gy, node):
        """Whether `node`'s backward step is the last to read gradient buffer `gy` as a gradient
        (it may then write over it): every other tensor whose gradient gy also is has had its
        backward step already, or has none."""
        position, here = self.position, self.position[node.name]
        return all(s == node.name or position[s] > here or not self.needs[s] for s in self.owners[gy])

    def _like(self, source, gy):
        """Whether node `source`'s output gradient can be buffer `gy` (the same shape and dtype)."""
        output, gradient = self.table.buffers[self.output[source]], self.table.buffers[gy]
        return (output.shape, output.dtype) == (gradient.shape, gradient.dtype)

    def _update(self, node, grad_params, optimizer_states):
        """The node's optimizer step, with one buffer per parameter and name in `optimizer_states`
        (e.g. "momentum", or Adam's "exp_avg" and "exp_avg_sq"), named "node:param:state"."""
        specs = node.layer.param_specs(self.graph.in_shapes(node.name, self.batch))
        slots = []
        for (p, param), (_, grad) in zip(self.params[node.name], grad_params):
            buf = self.table.buffers[param]
            states = tuple(self.table.add(f"{node.name}:{p}:{s}", buf.shape, FP32, "optimizer_state")
                           for s in optimizer_states)
            slots.append((param, grad, states, specs[p].decay))
        nbytes = self.kernels.update_workspace_bytes(max(self.table.buffers[p].nbytes for p, _, _, _ in slots))
        workspace = self.table.add(f"{node.name}:workspace:update", (nbytes,), "uint8", "workspace") if nbytes else -1
        return Update(node.name, tuple(slots), workspace)

    def loss_buffers(self):
        """Per loss node, in graph order: (output, its gradient seed or -1, softmax probs, labels,
        weight). The training loss is the sum of the weighted means; a graph that is only
        evaluated may have none."""
        losses = [n for n in self.graph.nodes.values() if n.layer.type_name == "SoftmaxCrossEntropy"]
        if not losses and self.grad:
            raise ValueError("training needs a SoftmaxCrossEntropy node, the graph has none")
        return tuple((self.output[n.name], self.grad.get(n.name, -1), dict(self.aux[n.name])["probs"],
                      self.output[n.inputs[1]], n.layer.weight) for n in losses)
