"""The Graph IR and its Python API."""

import re

import pytest

import snrt
from snrt.graph import Graph
from snrt.layers.activation import ReLU
from snrt.layers.input import Input
from snrt.layers.join import Add, Concat
from snrt.layers.linear import Linear
from snrt.layers.loss import SoftmaxCrossEntropy


def small_graph():
    """data -> fc1 -> relu -> {fc2, fc3} -> add (fan-out of relu, two joins) -> loss."""
    g = Graph("branchy")
    g.add(Input(shape=(6,)), name="data")
    g.add(Input(shape=(), dtype="int64"), name="label")
    g.add(Linear(out_features=8), inputs=["data"], name="fc1")
    g.add(ReLU(), name="relu")
    g.add(Linear(out_features=8), inputs=["relu"], name="fc2")
    g.add(Linear(out_features=8, bias=False), inputs=["relu"], name="fc3")
    g.add(Add(), inputs=["fc2", "fc3", "relu"], name="sum")
    g.add(Concat(), inputs=["sum", "fc1"], name="cat")
    g.add(Linear(out_features=3), name="logits")
    g.add(SoftmaxCrossEntropy(), inputs=["logits", "label"], name="loss")
    return g


def test_shapes_are_inferred_at_build_time():
    g = small_graph()
    assert g["fc1"].shape == (8,)
    assert g["cat"].shape == (16,)
    assert g["loss"].shape == ()
    assert g["label"].dtype == "int64" and g["logits"].dtype == "float32"
    assert g.in_shapes("cat", 5) == [(5, 8), (5, 8)]


def test_default_input_is_the_previous_node():
    g = small_graph()
    assert g["relu"].inputs == ("fc1",)
    assert g["logits"].inputs == ("cat",)


def test_fan_out_and_topological_order():
    g = small_graph()
    consumers = g.consumers()
    assert consumers["relu"] == ["fc2", "fc3", "sum"]
    assert consumers["fc1"] == ["relu", "cat"]
    order = g.topological_order()
    for name in order:
        assert all(order.index(i) < order.index(name) for i in g[name].inputs)


def test_parameters_and_counts():
    g = small_graph()
    specs = g.param_specs()
    assert set(specs) == {"fc1", "fc2", "fc3", "logits"}
    assert "bias" not in specs["fc3"]
    assert g.num_params() == (6 * 8 + 8) + (8 * 8 + 8) + 8 * 8 + (16 * 3 + 3)


def test_summary_lists_types_and_totals():
    text = small_graph().summary(batch=4)
    for word in ("Linear", "Concat", "SoftmaxCrossEntropy", "total", "branchy"):
        assert word in text
    rows = small_graph().rows(batch=4)
    assert [r.name for r in rows][:3] == ["data", "label", "fc1"]
    fc1 = rows[2]
    assert fc1.params == 56 and fc1.forward_flops == 2 * 4 * 6 * 8 and fc1.activation_bytes == 4 * 8 * 4


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda g: g.add(ReLU(), inputs=["nope"], name="r"), "node 'r': input 'nope' is not an earlier node"),
        (lambda g: g.add(ReLU(), name="fc1"), "node 'fc1': a node with this name already exists"),
        (lambda g: g.add(Add(), inputs=["fc1"], name="a"), "node 'a': Add takes at least 2 input(s), got 1"),
        (lambda g: g.add(Add(), inputs=["fc1", "data"], name="a"), "node 'a': Add cannot take inputs of shape [8], [6]"),
        (lambda g: g.add(SoftmaxCrossEntropy(), inputs=["fc1"], name="l"), "node 'l': SoftmaxCrossEntropy takes 2 input(s)"),
        (lambda g: g.add("relu", name="x"), "node 'x': expected a Layer instance"),
        (lambda g: g.add(ReLU(), name="fc1:relu"), "node 'fc1:relu': a node's name must be a non-empty string "
                                                  "without ':' or '@'"),
        (lambda g: g.add(ReLU(), name="relu@1"), "node 'relu@1': a node's name must be"),
        (lambda g: g.add(ReLU(), name=""), "node '': a node's name must be"),
        (lambda g: g.add(ReLU(), name=7), "node '7': a node's name must be"),
        (lambda g: g.add(ReLU(), inputs=3, name="r"), "node 'r': inputs: expected a node's name or a list of them, got 3"),
        (lambda g: g.add(ReLU(), inputs=[["fc1"]], name="r"), "node 'r': inputs: expected a node's name or a list"),
    ],
)
def test_building_errors_name_the_node(build, words):
    g = small_graph()
    with pytest.raises(snrt.GraphError) as info:
        build(g)
    assert words in str(info.value)


@pytest.mark.parametrize("batch", [0, -2, "4", 2.0, True])
def test_a_summary_at_a_batch_that_is_not_a_positive_int_says_so(batch):
    with pytest.raises(snrt.SnrtError, match=f"batch: expected a positive int, got {re.escape(repr(batch))}"):
        small_graph().summary(batch=batch)


def test_layers_are_configuration_only_and_comparable():
    assert Linear(out_features=3) == Linear(out_features=3)
    assert Linear(out_features=3) != Linear(out_features=3, bias=False)
    assert Linear(out_features=3).options() == {"out_features": 3, "bias": True}
    with pytest.raises(TypeError):
        Linear()  # out_features is required


def test_structure_ignores_names():
    a, b = small_graph(), Graph("other")
    renamed = {}
    for node in a.nodes.values():
        renamed[node.name] = b.add(node.layer, inputs=[renamed[i] for i in node.inputs], name=f"n_{node.name}")
    assert a.structure() == b.structure()
    assert a != b
