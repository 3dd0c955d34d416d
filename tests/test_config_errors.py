"""Broken network files: each gives one ConfigError naming the file, the key path and the fix."""

import re
import textwrap

import pytest

import snrt
from snrt import ConfigError, load_config
from snrt.config import MemoryConfig, OptimizerConfig, TrainConfig, config_from_graph, with_settings
from snrt.cli import main
from snrt.layers.input import Input
from snrt.layers.linear import Linear
from snrt.layers.loss import SoftmaxCrossEntropy

VALID = """
input: {shape: [3, 16, 16], classes: 10}
blocks:
  pair:
    args: {channels: null}
    layers:
      - {type: Conv2d, name: a, out_channels: $channels, kernel: 3, padding: 1}
      - {type: ReLU}
      - {type: Add, inputs: [relu0, $in]}
train: {batch: 4, iterations: 2, optimizer: {lr: 0.1}}
memory: {policy: none, budget: 1GiB}
network:
  - {type: Conv2d, out_channels: 8, kernel: 3, padding: 1}
  - {block: pair, args: {channels: 8}, repeat: 2}
  - {type: GlobalAvgPool}
  - {type: Linear, out_features: $classes}
  - {type: SoftmaxCrossEntropy}
"""

# (case id, text replaced in VALID or a whole document, expected key path, words in the message)
CASES = [
    ("yaml-syntax", ("network:\n", "network: [\n"), "", "not valid YAML: line"),
    ("not-a-mapping", "- just\n- a list\n", "", "expected a mapping"),
    ("missing-network", ("network:\n  - {type: Conv2d, out_channels: 8, kernel: 3, padding: 1}\n  - {block: pair, args: {channels: 8}, repeat: 2}\n  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: $classes}\n  - {type: SoftmaxCrossEntropy}\n", ""), "network", "missing"),
    ("unknown-top-key", ("train:", "trian: {}\ntrain:"), "trian", "did you mean 'train'"),
    ("input-shape", ("shape: [3, 16, 16]", "shape: [3, -16, 16]"), "input.shape", "positive ints"),
    ("input-classes", ("classes: 10", "classes: ten"), "input.classes", "int >= 2"),
    ("unknown-layer-type", ("type: ReLU}", "type: Relu}"), "network[1].block.pair.layers[1].type", "did you mean 'ReLU'"),
    ("unknown-option", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool, size: 2}"), "network[2].size", "has no option 'size'"),
    ("option-type", ("out_features: $classes", "out_features: 10.5"), "network[3].out_features", "must be an int"),
    ("option-value-in-block", ("kernel: 3, padding: 1}\n      - {type: ReLU}", "kernel: three, padding: 1}\n      - {type: ReLU}"),
     "network[1].block.pair.layers[0].kernel", "positive int or pair"),
    ("missing-option", ("{type: Linear, out_features: $classes}", "{type: Linear}"), "network[3]", "needs option 'out_features'"),
    ("unknown-input", ("inputs: [relu0, $in]", "inputs: [relu9, $in]"), "network[1].block.pair.layers[2].inputs[0]", "unknown input 'relu9'"),
    ("cycle", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool, name: gap, inputs: [fc]}\n  - {type: ReLU, name: fc, inputs: [gap]}"),
     "network[2].inputs", "cycle: gap -> fc -> gap"),
    ("shape-mismatch", ("{type: Add, inputs: [relu0, $in]}", "{type: Concat, inputs: [relu0, $in]}\n      - {type: Conv2d, out_channels: 4, kernel: 1}\n      - {type: Add, inputs: [conv2d0, $in]}"),
     "network[1].block.pair.layers[4]", "same shape"),
    ("wrong-arity", ("{type: Add, inputs: [relu0, $in]}", "{type: Add, inputs: [relu0]}"), "network[1].block.pair.layers[2]", "at least 2 input(s), got 1"),
    ("unknown-block", ("{block: pair,", "{block: pairs,"), "network[1].block", "unknown block 'pairs'"),
    ("missing-block-arg", ("args: {channels: 8}, repeat: 2", "repeat: 2"), "network[1].args", "needs argument 'channels'"),
    ("unknown-block-arg", ("args: {channels: 8}", "args: {channels: 8, width: 3}"), "network[1].args.width", "unknown key"),
    ("bad-repeat", ("repeat: 2", "repeat: 0"), "network[1].repeat", "positive int"),
    ("unknown-variable", ("out_features: $classes", "out_features: $clases"), "network[3].out_features", "unknown name $clases"),
    ("bad-expression", ("out_features: $classes", "out_features: '${classes ** 2}'"), "network[3].out_features", "is not allowed"),
    ("duplicate-name", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool, name: x}\n  - {type: ReLU, name: x}"), "network[3].name", "used twice"),
    ("type-and-block", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool, block: pair}"), "network[2]", "either 'type' or 'block'"),
    ("train-type", ("batch: 4", "batch: four"), "train.batch", "expected an int"),
    ("train-positive", ("iterations: 2", "iterations: 0"), "train.iterations", "positive"),
    ("optimizer-choice", ("optimizer: {lr: 0.1}", "optimizer: {type: adagrad}"), "train.optimizer.type",
     "expected one of sgd, adam, adamw"),
    ("adam-beta", ("optimizer: {lr: 0.1}", "optimizer: {type: adam, beta2: 1.0}"), "train.optimizer.beta2", "below 1"),
    ("policy-choice", ("policy: none", "policy: fast"), "memory.policy", "superneurons"),
    ("budget-format", ("budget: 1GiB", "budget: lots"), "memory.budget", "such as 12GiB"),
    ("self-recursive-block", ("      - {type: Add, inputs: [relu0, $in]}", "      - {type: Add, inputs: [relu0, $in]}\n      - {block: pair, args: {channels: 8}}"),
     "network[1].block.pair.layers[3].block", "uses itself"),
    ("loss-on-4d", ("  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: $classes}\n", ""), "network[2]", "add a Flatten"),
    ("type-is-a-list", ("{type: GlobalAvgPool}", "{type: [GlobalAvgPool]}"), "network[2].type", "expected a layer type name"),
    ("type-is-a-mapping", ("{type: GlobalAvgPool}", "{type: {a: 1}}"), "network[2].type", "expected a layer type name"),
    ("block-is-a-list", ("{block: pair,", "{block: [pair],"), "network[1].block", "expected a block name"),
    ("no-loss", ("  - {type: SoftmaxCrossEntropy}\n", ""), "network", "expected a loss layer"),
    ("narrow-aux-head", ("  - {type: GlobalAvgPool}\n", "  - {type: GlobalAvgPool}\n"
                         "  - {type: SoftmaxCrossEntropy, name: aux, weight: 0.3}\n  - {type: Identity, inputs: [globalavgpool0]}\n"),
     "network[3]", "the loss 'aux' reads 'globalavgpool0' of shape [8] per sample; it needs [10]"),
    ("groups-not-a-list", ("optimizer: {lr: 0.1}", "optimizer: {lr: 0.1, groups: {params: '*'}}"),
     "train.optimizer.groups", "expected a list of parameter groups"),
    ("group-without-params", ("optimizer: {lr: 0.1}", "optimizer: {lr: 0.1, groups: [{lr_scale: 2}]}"),
     "train.optimizer.groups[0]", "expected a mapping with 'params'"),
    ("group-params-empty", ("optimizer: {lr: 0.1}", "optimizer: {lr: 0.1, groups: [{params: []}]}"),
     "train.optimizer.groups[0].params", "expected a name pattern or a list of them"),
    ("group-matches-nothing", ("optimizer: {lr: 0.1}", "optimizer: {lr: 0.1, groups: [{params: '*:bias'}, {params: 'fc:*'}]}"),
     "train.optimizer.groups[1].params", "pattern 'fc:*' matches no parameter (names are node:param, e.g. conv2d0:weight"),
    ("group-lr-scale", ("optimizer: {lr: 0.1}", "optimizer: {lr: 0.1, groups: [{params: '*', lr_scale: 0}]}"),
     "train.optimizer.groups[0].lr_scale", "expected a positive value"),
    ("group-unknown-key", ("optimizer: {lr: 0.1}", "optimizer: {lr: 0.1, groups: [{params: '*', weight_decy: 0}]}"),
     "train.optimizer.groups[0].weight_decy", "did you mean 'weight_decay'"),
    ("per-pixel-flag", ("classes: 10}", "classes: 10, per_pixel: 1}"), "input.per_pixel", "expected true or false"),
    ("per-pixel-classifier-head", ("classes: 10}", "classes: 10, per_pixel: true}"), "network[4]",
     "the labels give a class per position ([16, 16] per sample) but the logits are [10] per sample"),
    ("per-pixel-head-wrong-size", VALID.replace("classes: 10}", "classes: 10, per_pixel: true}").replace(
        "  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: $classes}\n",
        "  - {type: Conv2d, out_channels: 7, kernel: 1}\n"), "network[3]", "it needs [10, 16, 16] (input.classes scores per pixel)"),
    ("loss-weight", ("{type: SoftmaxCrossEntropy}", "{type: SoftmaxCrossEntropy, weight: 0}"), "network[4].weight",
     "option 'weight' must be a finite number > 0"),
    ("narrow-head", ("out_features: $classes", "out_features: 9"), "network[4]", "it needs [10]"),
    ("vars-classes", ("train:", "vars: {classes: 3}\ntrain:"), "vars.classes", "is input.classes"),
    ("input-in-network", ("  - {type: GlobalAvgPool}\n", "  - {type: GlobalAvgPool}\n  - {type: Input, shape: [3]}\n"),
     "network[3].type", "no Input layers"),
    ("conv-without-out-channels", ("{type: Conv2d, out_channels: 8, kernel: 3, padding: 1}\n  - {block",
                                   "{type: Conv2d, kernel: 3, padding: 1}\n  - {block"), "network[0]", "needs option 'out_channels'"),
    ("nan-option", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool}\n  - {type: Dropout, p: .nan}"), "network[3].p",
     "a finite number"),
    ("nan-lr", ("optimizer: {lr: 0.1}", "optimizer: {lr: .nan}"), "train.optimizer.lr", "finite number"),
    ("inf-budget", ("budget: 1GiB", "budget: .inf"), "memory.budget", "byte size"),
    ("huge-budget", ("budget: 1GiB", "budget: 1e400"), "memory.budget", "finite byte size"),
    ("fractional-bytes", ("budget: 1GiB", "budget: '1.5'"), "memory.budget", "whole number of bytes, got '1.5': add a unit"),
    ("host-store-type", ("budget: 1GiB", "budget: 1GiB, host_store: 3"), "memory.host_store", "expected a string"),
    ("name-a-path", "name: ../../escaped\n" + VALID, "name", "expected a plain name"),
    ("name-empty", "name: ''\n" + VALID, "name", "expected a plain name"),
    ("duplicate-key", VALID + "input: {shape: [3, 8, 8], classes: 3}\n", "input", "given twice in one mapping (lines"),
    ("duplicate-option", ("{type: GlobalAvgPool}", "{type: Dropout, p: 0.1, p: 0.2}"), "p", "given twice in one mapping (line"),
    ("label-into-a-layer", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool}\n  - {type: Flatten, inputs: [label]}"),
     "network[3].inputs", "reads 'label', the class indices, which only a loss reads"),
    ("astronomical-width", ("out_features: $classes", "out_features: '${classes * 1000000000000000000}'"),
     "network[3]", "its output per sample would hold 10,000,000,000,000,000,000 values"),
    ("tag-it-cannot-read", ("classes: 10}", "classes: !!int ten}"), "", "not valid YAML: line 2, column 38: the tag !!int cannot read 'ten'"),
    ("bool-tag", ("padding: 1}\n  - {block", "padding: 1, bias: !!bool maybe}\n  - {block"), "", "the tag !!bool cannot read 'maybe'"),
    ("map-tag-on-a-list", ("args: {channels: 8}", "args: !!map [8]"), "", "expected a mapping node, but found sequence"),
    ("unused-block-unknown-type", ("blocks:\n", "blocks:\n  spare:\n    layers:\n      - {type: Relu}\n"),
     "blocks.spare.layers[0].type", "did you mean 'ReLU'"),
    ("too-many-workers", ("iterations: 2,", "iterations: 2, data: {workers: 100000},"), "train.data.workers",
     "expected at most 512"),
    ("zero-bucket", ("iterations: 2,", "iterations: 2, gradient_bucket: 0,"), "train.gradient_bucket",
     "positive byte size"),
    ("bucket-format", ("iterations: 2,", "iterations: 2, gradient_bucket: big,"), "train.gradient_bucket",
     "such as 12GiB"),
    ("huge-repeat", ("repeat: 2", "repeat: 1000000"), "network[1].repeat", "more than 200,000 layers"),
    ("long-expression", ("out_features: $classes", "out_features: '${" + "+".join(["classes"] * 200) + "}'"),
     "network[3].out_features", "at most 1000"),
    ("name-with-a-colon", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool, name: 'pool:1'}"), "network[2]",
     "a node's name must be a non-empty string without ':' or '@'"),
    ("block-name-with-an-at", ("{block: pair,", "{block: pair, name: p@1,"), "network[1].block.pair.layers[0]",
     "layer 'p@1.0.a' (Conv2d): a node's name must be"),
    ("generated-name-clash", ("{type: GlobalAvgPool}", "{type: GlobalAvgPool, name: pair0.0.a}"), "network[2]",
     "also the name of the layer at network[1]"),
]


def broken(change):
    if isinstance(change, str):
        return change
    old, new = change
    assert old in VALID, f"test setup: {old!r} not in the valid document"
    return VALID.replace(old, new, 1)


def test_the_valid_document_loads(tmp_path):
    path = tmp_path / "net.yaml"
    path.write_text(VALID)
    config = load_config(path)
    assert config.train.batch == 4 and config.memory.budget == 2**30
    assert "pair0.1.a" in config.graph.nodes


@pytest.mark.parametrize("case, change, key, words", CASES, ids=[c[0] for c in CASES])
def test_broken_config_reports_file_key_and_expectation(tmp_path, case, change, key, words):
    path = tmp_path / f"{case}.yaml"
    path.write_text(broken(change))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    error = info.value
    assert error.source == str(path)
    assert error.key == key, str(error)
    assert words in error.message, str(error)
    assert str(error).startswith(f"{path}: {key + ': ' if key else ''}")


def test_deep_nesting_alias_bombs_and_block_chains_are_errors_not_crashes(tmp_path):
    """What would hang or overflow the stack: YAML nested 1,000 deep, aliases that stand for
    billions of values, a chain of 2,000 blocks, parentheses nested 300 deep, a file that is
    not UTF-8."""
    bomb = "vars:\n  a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
    for i in range(1, 9):
        bomb += f"  v{i}: &v{i} [{', '.join(['*a' if i == 1 else f'*v{i - 1}'] * 10)}]\n"
    chain = VALID.replace("blocks:\n", "blocks:\n" + "".join(
        f"  c{i}: {{layers: [{{block: c{i + 1}}}]}}\n" for i in range(2000)) + "  c2000: {layers: [{type: ReLU}]}\n")
    chain = chain.replace("  - {type: GlobalAvgPool}", "  - {block: c0}\n  - {type: GlobalAvgPool}")
    deep_expression = VALID.replace("out_features: $classes", "out_features: '${" + "(" * 300 + "classes" + ")" * 300 + "}'")
    cases = {"deep.yaml": ("network: " + "[" * 1000 + "]" * 1000 + "\n", "nested too deeply"),
             "bomb.yaml": (VALID + bomb, "expands to more than"),
             "chain.yaml": (chain, "nested more than 64 deep"),
             "expression.yaml": (deep_expression, "not an expression")}
    for name, (text, words) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError, match=words):
            load_config(tmp_path / name)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00network")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path / "binary.yaml")


def test_there_are_at_least_twenty_kinds():
    assert len({c[0] for c in CASES}) >= 20


def test_cli_prints_one_line_and_no_traceback(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(broken(("kernel: 3, padding: 1}\n      - {type: ReLU}", "kernel: 0, padding: 1}\n      - {type: ReLU}")))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{path}: network[1].block.pair.layers[0].kernel:" in " ".join(err.split())


@pytest.mark.parametrize("source", [None, 3, ["configs/lenet.yaml"]])
def test_a_source_that_is_neither_a_path_nor_a_dict_is_named(source):
    with pytest.raises(snrt.ConfigError, match=re.escape(f"expected a network file's path or a parsed dict, got "
                                                         f"{'nothing' if source is None else type(source).__name__}")):
        load_config(source)


@pytest.mark.parametrize("command", [["inspect"], ["plan"], ["train", "--no-progress"]])
def test_a_file_too_large_for_a_network_is_refused_without_reading_it_all(tmp_path, capsys, command):
    from snrt.config import MAX_YAML_BYTES

    large = tmp_path / "data.yaml"
    large.write_text("# " + "x" * MAX_YAML_BYTES)
    for path in (large, "/dev/zero"):  # a device that never ends
        assert main([command[0], str(path), *command[1:]]) == 2
        assert f"{path}: larger than 16 MiB; expected a network YAML file" in " ".join(capsys.readouterr().err.split())


def test_missing_file_is_reported(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")


def test_round_trip_through_yaml(tmp_path):
    import yaml

    from snrt.config import config_to_yaml

    path = tmp_path / "net.yaml"
    path.write_text(VALID)
    config = load_config(path)
    again = tmp_path / "again.yaml"
    again.write_text(config_to_yaml(config))
    reloaded = load_config(again)
    assert reloaded.graph == config.graph
    assert reloaded.train == config.train and reloaded.memory == config.memory
    assert yaml.safe_load(again.read_text())["network"][0]["name"] == "conv2d0"


def test_expressions_and_scoped_names(tmp_path):
    path = tmp_path / "net.yaml"
    path.write_text(textwrap.dedent("""
        input: {shape: [4], classes: 3}
        vars: {width: 6}
        blocks:
          mlp:
            args: {hidden: null}
            layers:
              - {type: Linear, name: fc, out_features: "${hidden * 2 - 1}"}
              - {type: Tanh}
        network:
          - {block: mlp, name: body, args: {hidden: $width}}
          - {type: Linear, out_features: $classes}
          - {type: SoftmaxCrossEntropy}
    """))
    graph = load_config(path).graph
    assert graph["body.fc"].shape == (11,)
    assert graph["body.tanh0"].inputs == ("body.fc",)
    assert graph["softmaxcrossentropy0"].inputs == ("linear0", "label")


def test_settings_are_changed_on_a_loaded_config_and_checked_like_the_file():
    config = snrt.load_config("configs/lenet.yaml")
    changed = with_settings(config, train={"batch": 8, "optimizer": {"lr": 0.01}},
                            memory={"policy": "offload", "budget": "2GiB"})
    assert (changed.train.batch, changed.train.optimizer.lr) == (8, 0.01)
    assert changed.train.optimizer.momentum == config.train.optimizer.momentum  # nested sections merge
    assert (changed.memory.policy, changed.memory.budget) == ("offload", 2 * 2**30)  # the budget is bytes
    assert changed.graph is config.graph and config.train.batch != 8  # the original is unchanged
    with pytest.raises(snrt.ConfigError, match=r"lenet.yaml: memory.budget: expected a byte size"):
        with_settings(config, memory={"budget": "lots"})
    with pytest.raises(snrt.ConfigError, match=r"train.batch: expected a positive value"):
        with_settings(config, train={"batch": 0})


@pytest.mark.parametrize("changes", [{"train": "batch=8"}, {"memory": ["offload"]}])
def test_settings_that_are_not_a_mapping_are_named(changes):
    config = snrt.load_config("configs/lenet.yaml")
    key = next(iter(changes))
    with pytest.raises(snrt.ConfigError, match=rf"lenet.yaml: {key}: expected a mapping of settings"):
        with_settings(config, **changes)


def test_settings_are_changed_on_a_config_only():
    with pytest.raises(snrt.ConfigError, match="<str>: expected a snrt.Config to change, got str 'configs/lenet.yaml'"):
        with_settings("configs/lenet.yaml", train={"batch": 8})


def python_graph(classes=3):
    """A network built in Python whose head gives `classes` scores."""
    graph = snrt.Graph("mlp")
    graph.add(Input(shape=(6,)), name="data")
    graph.add(Input(shape=(), dtype="int64"), name="label")
    graph.add(Linear(out_features=classes), inputs="data", name="fc")
    graph.add(SoftmaxCrossEntropy(), inputs=["fc", "label"])
    return graph


@pytest.mark.parametrize("arguments, key, words", [
    ({"classes": 0}, "classes", "expected an int >= 2, got int 0"),
    ({"classes": "3"}, "classes", "expected an int >= 2, got str '3'"),
    ({"classes": 5}, "network", "reads 'fc' of shape [3] per sample; it needs [5]"),  # labels past the scores
    ({"train": TrainConfig(batch=0)}, "train.batch", "expected a positive value, got 0"),
    ({"train": {"batch": 4, "optimizr": {}}}, "train.optimizr", "unknown key"),
    ({"memory": MemoryConfig(policy="fast")}, "memory.policy", "expected one of none, "),
    ({"memory": "liveness"}, "memory", "expected a MemoryConfig or a mapping of settings, got str 'liveness'"),
])
def test_a_config_of_a_python_graph_is_checked_as_a_files_would_be(arguments, key, words):
    arguments = {"classes": 3, **arguments}
    with pytest.raises(snrt.ConfigError) as caught:
        config_from_graph(python_graph(), **arguments)
    assert (caught.value.source, caught.value.key) == ("<graph mlp>", key) and words in caught.value.message


@pytest.mark.parametrize("node, layer, words", [
    ("data", Input(shape=(6,), dtype="int32"), "expected an Input of a float dtype (the data pipeline feeds it images)"),
    ("label", Input(shape=()), "expected an Input of an int dtype (the data pipeline feeds it class indices)"),
    ("extra", Input(shape=(6,)), "an Input other than 'data' and 'label', which nothing feeds"),
])
def test_a_python_graph_reads_the_inputs_the_data_pipeline_feeds(node, layer, words):
    graph = snrt.Graph("mlp")
    for name in ("data", "label", "extra"):
        default = {"data": Input(shape=(6,)), "label": Input(shape=(), dtype="int64")}.get(name)
        if name == node or default:
            graph.add(layer if name == node else default, name=name)
    graph.add(Linear(out_features=3), inputs="data", name="fc")
    graph.add(SoftmaxCrossEntropy(), inputs=["fc", "label"])
    with pytest.raises(snrt.ConfigError) as caught:
        config_from_graph(graph, 3)
    assert caught.value.key == node and words in caught.value.message


def test_a_python_graph_may_take_its_images_and_labels_in_other_float_and_int_dtypes():
    graph = snrt.Graph("mlp")
    graph.add(Input(shape=(6,), dtype="float64"), name="data")  # planned in the run's precision, as float32 is
    graph.add(Input(shape=(), dtype="int32"), name="label")
    graph.add(Linear(out_features=3), inputs="data", name="fc")
    graph.add(SoftmaxCrossEntropy(), inputs=["fc", "label"])
    assert config_from_graph(graph, 3).input.shape == [6]


def test_a_config_of_a_python_graph_takes_its_settings_as_dataclasses_or_mappings():
    given = config_from_graph(python_graph(), 3, TrainConfig(batch=4, optimizer=OptimizerConfig(lr=0.01)),
                              MemoryConfig(policy="liveness", budget=2**20))
    mapped = config_from_graph(python_graph(), 3, {"batch": 4, "optimizer": {"lr": 0.01}},
                               {"policy": "liveness", "budget": "1MiB"})
    assert given.train == mapped.train and given.memory == mapped.memory
    assert (given.train.batch, given.train.optimizer.lr, given.memory.budget) == (4, 0.01, 2**20)
    assert config_from_graph(python_graph(), 3).train == TrainConfig()


# ---- mutated zoo configs: each loads, or is one ConfigError ---------------------------------
ODD_VALUES = [None, [], {}, "x", "", -1, 0, 1, 3, 10**12, 2.5, float("nan"), float("inf"), -float("inf"), True,
              [1, 2], [3, 8, 8], {"a": 1}, "$nope", "$classes", "${1//0}", "${classes*0}", "1e400", [[[]]],
              "Conv2d", "ReLU", "label", "data"]
ZOO = ["lenet", "cifar_resnet20", "alexnet", "resnet50", "densenet121", "inceptionv4"]


def _mutated(doc, data):
    """A copy of `doc` with one value somewhere inside replaced, removed or duplicated."""
    import copy

    from hypothesis import strategies as st

    doc = copy.deepcopy(doc)
    parent, key, node = None, None, doc
    while isinstance(node, (dict, list)) and node and (parent is None or data.draw(st.integers(0, 3)) > 0):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, data.draw(st.sampled_from(keys))
        node = parent[key]
    if parent is None:
        return data.draw(st.sampled_from(ODD_VALUES))
    action = data.draw(st.sampled_from(["replace", "remove", "duplicate", "rename"]))
    if action == "replace":
        parent[key] = data.draw(st.sampled_from(ODD_VALUES))
    elif action == "remove":
        del parent[key]
    elif action == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif isinstance(parent, dict):
        parent[str(key) + data.draw(st.sampled_from(["s", "_", "0"]))] = parent.pop(key)
    return doc


@pytest.mark.parametrize("name", ZOO)
def test_mutated_zoo_configs_load_or_give_one_config_error(name, tmp_path):
    """Hundreds of one-edit mutants of the zoo's files: every one either loads or raises a
    ConfigError naming the file, never another exception, a hang or a crash."""
    import yaml
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    original = yaml.safe_load(open(f"configs/{name}.yaml"))
    path = tmp_path / f"{name}.yaml"

    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(st.data())
    def check(data):
        path.write_text(yaml.safe_dump(_mutated(original, data), sort_keys=False))
        try:
            load_config(path)
        except ConfigError as error:
            assert str(error).startswith(str(path)), str(error)

    check()


def test_a_reserved_word_as_a_name_in_an_expression_says_so(tmp_path):
    path = tmp_path / "net.yaml"
    path.write_text(VALID.replace("args: {channels: null}", "args: {channels: null, in: 2}").replace(
        "out_channels: $channels, kernel: 3", "out_channels: '${in * 4}', kernel: 3"))
    with pytest.raises(ConfigError, match="'in' is a reserved word"):
        load_config(path)


def test_a_block_reads_several_inputs_as_in0_in1():
    from tests.test_train import UNET

    graph = load_config(UNET).graph
    upsample, concat = graph["dec2.upsample0"], graph["dec2.concat0"]
    assert upsample.inputs == ("bottom",) and concat.inputs == ("dec2.upsample0", "enc2.relu0")
    assert graph["dec2.conv2d0"].shape == (6, 4, 4)
    network = list(UNET["network"])
    decoder = next(i for i, entry in enumerate(network) if entry.get("name") == "dec2")
    network[decoder] = {**network[decoder], "inputs": ["bottom"]}  # the skip connection forgotten
    broken = {**UNET, "network": network}
    with pytest.raises(ConfigError, match=r"unknown input '\$in1'.*\$in0, \$in1, ... when it reads several"):
        load_config(broken)


def test_a_file_without_a_name_is_named_after_the_file_made_plain(tmp_path):
    path = tmp_path / "my net (v2).yaml"
    path.write_text(VALID)
    assert load_config(path).name == "my_net__v2_"


def test_numbers_in_exponent_form_are_floats(tmp_path):
    path = tmp_path / "net.yaml"
    path.write_text(VALID.replace("optimizer: {lr: 0.1}", "optimizer: {lr: 1e-3, weight_decay: 5E-4}"))
    optimizer = load_config(path).train.optimizer
    assert (optimizer.lr, optimizer.weight_decay) == (0.001, 0.0005)


@pytest.mark.parametrize("overrides, key, words", [
    (["train.batch", 2], "", "expected a mapping of dotted keys to values such as {'train.batch': 2}, got list"),
    ({("train", "batch"): 2}, "('train', 'batch')", "expected a dotted key such as 'train.batch', got tuple"),
    ({"train..batch": 2}, "train..batch", "expected a dotted key such as 'train.batch', got str 'train..batch'"),
])
def test_overrides_that_are_not_dotted_keys_are_named(overrides, key, words):
    with pytest.raises(ConfigError) as caught:
        load_config("configs/lenet.yaml", overrides=overrides)
    assert (caught.value.source, caught.value.key) == ("<overrides>", key) and words in caught.value.message
