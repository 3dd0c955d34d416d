"""The layer graph: nodes with named inputs and one output each, shapes inferred at build time.

Shapes stored on nodes are per sample (no batch dimension); `Graph.shapes(batch)` and the
layer fact methods work with full shapes (batch first). Nodes are kept in topological order:
`add` only accepts inputs that already exist, so a Graph can never hold a cycle.
"""

import hashlib
import math
from dataclasses import dataclass

from snrt.errors import GraphError, ShapeError, SnrtError
from snrt.layers import Layer
from snrt.layers.base import BACKWARD, FORWARD, numel
from snrt.layers.input import Input
from snrt.summary import format_summary
from snrt.units import is_count

_DTYPE_BYTES = {"float32": 4, "float64": 8, "int32": 4, "int64": 8}
RESERVED = (":", "@")  # in node names: buffers are named node:name, and their later versions name@k
MAX_VALUES = 1 << 62  # values of one tensor per sample, or of one parameter: more than an array can index


@dataclass(frozen=True)
class Node:
    """One layer instance in the graph.

    `shape` is the per-sample output shape, `dtype` the output dtype name, `key` the YAML key
    path the node came from (None when built in Python).
    """

    name: str
    layer: Layer
    inputs: tuple
    shape: tuple
    dtype: str
    key: str = None

    def full_shape(self, batch):
        """Output shape with the batch dimension."""
        return (batch, *self.shape)

    def output_bytes(self, batch):
        """Bytes of the output tensor at `batch`."""
        return numel(self.full_shape(batch)) * _DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class LayerRow:
    """One line of a graph summary, at a given batch."""

    name: str
    type: str
    shape: tuple
    params: int
    forward_flops: int
    backward_flops: int
    activation_bytes: int


class Graph:
    """A network: `add` layers in order, each naming its inputs (default: the previous node).

    >>> g = Graph("mlp")
    >>> x = g.add(Input(shape=(784,)), name="data")
    >>> h = g.add(Linear(out_features=10))
    """

    def __init__(self, name="net"):
        self.name = name
        self.nodes = {}
        self._last = None

    # ---- building --------------------------------------------------------------------
    def add(self, layer, inputs=None, name=None, key=None):
        """Append `layer` fed by `inputs` (names; default the last node) and return its name.

        Raises GraphError naming the node if an input is unknown, the number of inputs is
        wrong, or the layer rejects the input shapes.
        """
        if not isinstance(layer, Layer):
            raise GraphError(name or "?", f"expected a Layer instance, got {type(layer).__name__}", key)
        name = name if name is not None else self._fresh_name(layer.type_name)
        if not isinstance(name, str) or not name or any(c in name for c in RESERVED):
            raise GraphError(name, "a node's name must be a non-empty string without "
                                   f"{' or '.join(repr(c) for c in RESERVED)} (they join the parts of its buffers' "
                                   "names, as in conv1:weight)", key)
        if name in self.nodes:
            raise GraphError(name, "a node with this name already exists", key)
        if inputs is None:
            inputs = () if layer.max_inputs == 0 or self._last is None else (self._last,)
        elif isinstance(inputs, str):
            inputs = (inputs,)
        if not isinstance(inputs, (list, tuple)) or not all(isinstance(i, str) for i in inputs):
            raise GraphError(name, f"inputs: expected a node's name or a list of them, got {inputs!r}", key)
        inputs = tuple(inputs)
        self._check_arity(name, layer, inputs, key)
        for i in inputs:
            if i not in self.nodes:
                raise GraphError(name, f"input '{i}' is not an earlier node of the graph", key)
        shape, dtype = self._infer(name, layer, inputs, key)
        if inputs:
            layer = layer.fitted([self.nodes[i].full_shape(1) for i in inputs])
        self.nodes[name] = Node(name, layer, inputs, shape, dtype, key)
        self._last = name
        return name

    def _fresh_name(self, type_name):
        base = type_name.lower()
        index = sum(1 for n in self.nodes.values() if n.layer.type_name == type_name)
        while f"{base}{index}" in self.nodes:
            index += 1
        return f"{base}{index}"

    @staticmethod
    def _check_arity(name, layer, inputs, key):
        low, high = layer.min_inputs, layer.max_inputs
        if len(inputs) < low or (high is not None and len(inputs) > high):
            if high is None:
                wanted = f"at least {low}"
            elif low == high:
                wanted = str(low)
            else:
                wanted = f"{low} to {high}"
            raise GraphError(
                name, f"{layer.type_name} takes {wanted} input(s), got {len(inputs)}", key
            )

    def _infer(self, name, layer, inputs, key):
        if isinstance(layer, Input):
            return layer.shape, layer.dtype
        in_shapes = [self.nodes[i].full_shape(1) for i in inputs]
        in_dtypes = [self.nodes[i].dtype for i in inputs]
        try:
            out = tuple(layer.infer_shape(in_shapes))
        except ShapeError as e:
            shapes = ", ".join(str(list(s[1:])) for s in in_shapes)
            raise GraphError(name, f"{layer.type_name} cannot take inputs of shape {shapes}: {e}", key) from None
        if len(out) < 1 or out[0] != 1 or any(d < 1 for d in out):
            raise GraphError(name, f"{layer.type_name} inferred an invalid output shape {list(out[1:])}", key)
        sizes = [("its output per sample", out[1:])] + [(f"its parameter '{p}'", spec.shape)
                                                         for p, spec in layer.param_specs(in_shapes).items()]
        for what, shape in sizes:
            if math.prod(shape) > MAX_VALUES:
                raise GraphError(name, f"{what} would hold {math.prod(shape):,} values (shape "
                                       f"{list(shape)}), more than an array can hold (2^62)", key)
        return out[1:], layer.output_dtype(in_dtypes)

    # ---- queries ---------------------------------------------------------------------
    def __len__(self):
        return len(self.nodes)

    def __getitem__(self, name):
        return self.nodes[name]

    def __eq__(self, other):
        """Same nodes (names, layers with options, inputs) in the same order."""
        return isinstance(other, Graph) and [
            (n.name, n.layer, n.inputs) for n in self.nodes.values()
        ] == [(n.name, n.layer, n.inputs) for n in other.nodes.values()]

    __hash__ = None

    def structure(self):
        """The graph up to node names: [(layer, input positions)] in order.

        Two graphs with equal structures compute the same function with the same parameters.
        """
        position = {name: i for i, name in enumerate(self.nodes)}
        return [(n.layer, tuple(position[i] for i in n.inputs)) for n in self.nodes.values()]

    def fingerprint(self):
        """A hex digest of the nodes' names, layers (with every option) and inputs: what a
        checkpoint must match. Input image sizes are left out, as the same parameters fit any
        size the layers accept (the parameters' shapes are checked on their own)."""
        parts = [(n.name, n.layer.type_name if n.layer.type_name == "Input" else repr(n.layer), n.inputs)
                 for n in self.nodes.values()]
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]

    def topological_order(self):
        """Node names, every node after its inputs (the insertion order)."""
        return list(self.nodes)

    def consumers(self):
        """Map from node name to the names of the nodes that read it (fan-out), in order."""
        out = {name: [] for name in self.nodes}
        for node in self.nodes.values():
            for i in node.inputs:
                out[i].append(node.name)
        return out

    def in_shapes(self, name, batch):
        """Full input shapes of node `name` at `batch`."""
        return [self.nodes[i].full_shape(batch) for i in self.nodes[name].inputs]

    def param_specs(self):
        """{node name: {param name: ParamSpec}} for nodes that have parameters."""
        return self._specs("param_specs")

    def state_specs(self):
        """{node name: {state name: StateSpec}} for nodes with persistent state."""
        return self._specs("state_specs")

    def _specs(self, method):
        specs = {}
        for node in self.nodes.values():
            node_specs = getattr(node.layer, method)(self.in_shapes(node.name, 1))
            if node_specs:
                specs[node.name] = node_specs
        return specs

    def num_params(self):
        """Number of trained scalars."""
        return sum(numel(p.shape) for specs in self.param_specs().values() for p in specs.values())

    def rows(self, batch=1):
        """One LayerRow per node at `batch` (Input nodes included); a batch that is not a
        positive int is a SnrtError."""
        if not is_count(batch):
            raise SnrtError(f"batch: expected a positive int, got {batch!r}")
        rows = []
        for node in self.nodes.values():
            in_shapes = self.in_shapes(node.name, batch)
            layer = node.layer
            params = sum(numel(p.shape) for p in layer.param_specs(in_shapes).values()) if in_shapes else 0
            fwd = layer.cost(in_shapes, FORWARD).flops if in_shapes else 0
            bwd = layer.cost(in_shapes, BACKWARD).flops if in_shapes else 0
            rows.append(
                LayerRow(node.name, layer.type_name, node.shape, params, fwd, bwd, node.output_bytes(batch))
            )
        return rows

    def summary(self, batch=1):
        """A plain-text table: layers by type with parameters, FLOPs and activation bytes."""
        return format_summary(self, batch)
