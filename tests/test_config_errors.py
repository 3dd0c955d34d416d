"""Broken network files: each gives one ConfigError naming the file, the key path and the fix."""

import textwrap

import pytest

import snrt
from snrt import ConfigError, load_config
from snrt.config import with_settings
from snrt.cli import main

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
    ("optimizer-choice", ("optimizer: {lr: 0.1}", "optimizer: {type: adam}"), "train.optimizer.type", "expected one of sgd"),
    ("policy-choice", ("policy: none", "policy: fast"), "memory.policy", "superneurons"),
    ("budget-format", ("budget: 1GiB", "budget: lots"), "memory.budget", "such as 12GiB"),
    ("self-recursive-block", ("      - {type: Add, inputs: [relu0, $in]}", "      - {type: Add, inputs: [relu0, $in]}\n      - {block: pair, args: {channels: 8}}"),
     "network[1].block.pair.layers[3].block", "uses itself"),
    ("loss-on-4d", ("  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: $classes}\n", ""), "network[2]", "add a Flatten"),
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


def test_there_are_at_least_twenty_kinds():
    assert len({c[0] for c in CASES}) >= 20


def test_cli_prints_one_line_and_no_traceback(tmp_path, capsys):
    path = tmp_path / "bad.yaml"
    path.write_text(broken(("kernel: 3, padding: 1}\n      - {type: ReLU}", "kernel: 0, padding: 1}\n      - {type: ReLU}")))
    assert main(["inspect", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"{path}: network[1].block.pair.layers[0].kernel:" in " ".join(err.split())


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
