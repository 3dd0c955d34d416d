"""Fusion as a graph fact: the graph a plan is made for, with each ReLU folded into the
BatchNorm or Add before it where nothing else reads that node's output.

    conv -> bn -> relu -> conv        becomes        conv -> bn (BatchNormReLU) -> conv
    (body, shortcut) -> add -> relu   becomes        (body, shortcut) -> add (AddReLU)

The fused node keeps the first part's name (so its parameters and state keep theirs, and
checkpoints, weights and exports of the network are unchanged), its inputs and its place; the
ReLU's readers read it instead. The scheduler then sees one node, one output and one saved-tensor
contract (snrt/layers/fused.py), and plans neither the tensor between the parts nor its gradient.
A plan records whether it was made from the fused graph (`Plan.fused`); `planned_graph` gives
the graph a plan's steps name.
"""

from snrt.graph import Graph
from snrt.layers.activation import ReLU
from snrt.layers.fused import AddReLU, BatchNormReLU
from snrt.layers.join import Add
from snrt.layers.norm import BatchNorm

FUSED = {BatchNorm: BatchNormReLU, Add: AddReLU}  # the layer a ReLU folds into -> the fused layer


def fuse_layers(graph):
    """The graph with every fusable pair (a layer of FUSED, the ReLU that alone reads it) as one
    node, in the order and with the names of `graph` (less the ReLUs folded in); `graph` itself
    when there is none."""
    consumers = graph.consumers()
    folded = {}  # ReLU's name -> the node it folds into
    for name, node in graph.nodes.items():
        if type(node.layer) is ReLU:
            first = graph.nodes[node.inputs[0]]
            if type(first.layer) in FUSED and consumers[first.name] == [name]:
                folded[name] = first.name
    if not folded:
        return graph
    into = set(folded.values())
    fused = Graph(graph.name)
    for name, node in graph.nodes.items():
        if name in folded:
            continue
        layer = node.layer
        if name in into:
            layer = FUSED[type(layer)](**{field: getattr(layer, field) for field in layer.__dataclass_fields__})
        fused.add(layer, inputs=[folded.get(i, i) for i in node.inputs], name=name, key=node.key)
    return fused


def planned_graph(graph, plan):
    """The graph whose node names `plan`'s steps use: `graph` fused when the plan was made so."""
    return fuse_layers(graph) if plan.fused else graph
