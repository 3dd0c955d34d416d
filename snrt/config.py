"""YAML networks and run settings -> Config (graph, input, train, memory).

The format is documented in docs/network-yaml.md. Every mistake becomes one ConfigError that
names the file, the key path (``network[12].block.bottleneck.layers[3].kernel``) and what was
expected. Loading works in three steps: `expand_network` turns blocks, repeats and `$values`
into a flat list of layer entries with global names; their inputs are resolved and sorted
topologically (a cycle is reported with its path); the Graph is built node by node.
"""

import copy
import dataclasses
import difflib
import fnmatch
import heapq
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from snrt.errors import ConfigError, GraphError
from snrt.expressions import evaluate
from snrt.graph import Graph
from snrt.layers import LAYERS
from snrt.layers.input import Input
from snrt.precision import PRECISIONS
from snrt.scheduler import policies
from snrt.units import Bytes, parse_bytes
from snrt.workers import MAX_WORKERS

OPTIMIZERS = ("sgd", "adam", "adamw")
DATASETS = ("synthetic", "npz", "cifar10", "cifar100", "digits", "folder")
TOP_LEVEL_KEYS = ("name", "input", "vars", "train", "memory", "blocks", "network")
PLAIN_NAME = re.compile(r"[A-Za-z0-9._-]{1,200}")  # a network's name, and its default run folder's
LABEL_READERS = {"SoftmaxCrossEntropy"}  # layers whose default inputs are [previous, label]
LOSSES = LABEL_READERS  # the layers a training iteration starts its backward pass from
# Limits that turn a runaway file into an error instead of a hang or a crash
MAX_NODES = 200_000  # layers after expansion (ResNet2500 has 8,337)
MAX_BLOCK_DEPTH = 64  # blocks inside blocks
MAX_YAML_VALUES = 2_000_000  # values in the loaded document, YAML aliases expanded
MAX_YAML_BYTES = 16 * 2**20  # a network file's size (the zoo's are under 6 KB; /dev/zero never ends)


# ---- settings sections ------------------------------------------------------------------
@dataclass
class InputConfig:
    """Per-sample image shape (C, H, W), number of classes, and whether the labels give a class
    per pixel (segmentation: labels (H, W) per sample) rather than per image."""

    shape: list
    classes: int
    per_pixel: bool = False


class ParamGroups(tuple):
    """Annotation of train.optimizer.groups: a tuple of ParamGroup."""


@dataclass(frozen=True)
class ParamGroup:
    """Optimizer settings for the parameters whose "node:param" name matches one of `params`,
    shell-style patterns ("*:bias", "fc:*", "stage3.*"). weight_decay None keeps the
    optimizer's (which skips the parameters their layer does not decay: biases, norm scales)."""

    params: tuple = ()
    weight_decay: float = None
    lr_scale: float = 1.0


@dataclass
class OptimizerConfig:
    """sgd (momentum, nesterov), adam or adamw (beta1, beta2, eps); weight_decay for all
    (L2 in the gradient for sgd and adam, decoupled for adamw); clip_value for all; groups:
    per-parameter weight decay and learning-rate factors, the first matching group wins."""

    type: str = "sgd"
    lr: float = 0.1
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    clip_value: float = 0.0  # > 0: every gradient element clipped to [-clip_value, clip_value]
    clip_norm: float = 0.0  # > 0: all gradients scaled so that their global L2 norm is at most this
    groups: ParamGroups = ParamGroups()


@dataclass
class ScheduleConfig:
    """Learning rate over iterations: linear warm-up, then constant, step decay or cosine."""

    type: str = "constant"
    warmup: int = 0
    milestones: list = field(default_factory=list)  # step: iterations where lr is multiplied by gamma
    gamma: float = 0.1
    min_lr: float = 0.0  # cosine: the final learning rate


@dataclass
class DataConfig:
    """Where batches come from (see snrt/data.py) and how they are augmented."""

    type: str = "synthetic"
    path: str = None  # .npz file, CIFAR folder or image folder (DIR/train/<class>/*, snrt/images.py)
    crop_padding: int = 0  # random crop after zero padding by this many pixels (0: off)
    flip: bool = False  # random horizontal flip
    normalize: bool = True  # per-channel mean/std of the training split
    holdout: float = 0.2  # fraction held out for eval when the set has no test split
    samples: int = 2048  # size of the synthetic set
    skip_bad_images: bool = False  # image folders: count and leave out files that are not readable images
    workers: int = None  # processes preparing batches (snrt/workers.py); 0: a thread of the trainer's process;
    # null: for data decoded from files (image folders) the usable cores over the ranks on this host, else 0


@dataclass
class TrainConfig:
    batch: int = 32
    iterations: int = 100
    seed: int = 0
    init: str = "default"  # default (each layer's own), he or xavier for conv/linear weights
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint_every: int = 0  # iterations between checkpoints (0: only at the end)
    eval_every: int = 0  # iterations between held-out evaluations, recorded in the metrics (0: only at the end)
    gradient_bucket: Bytes = 25 * 2**20  # data parallel: gradients exchanged per bucket (snrt/scheduler/reduce.py)
    precision: str = "fp32"  # the dtype tensors are stored and computed in (snrt/precision.py)
    deterministic: bool = True  # GPU: only kernels that compute the same bits every time
    fuse: bool = True  # plan each BatchNorm or Add and the ReLU after it as one node (snrt/scheduler/fuse.py)
    cuda_graph: bool = True  # GPU: replay each iteration after the second as one captured CUDA graph (snrt/executor.py)


@dataclass
class MemoryConfig:
    """The memory policy (snrt/scheduler/policies.py, or auto) and the device budget in bytes."""

    policy: str = "none"
    budget: Bytes = None  # written as 12GiB etc.; None: no budget
    stream_parameters: bool = False  # parameters and optimizer state live in host memory (snrt/scheduler/stream.py)
    host_store: str = None  # CPU: a folder for the host store as a file on disk (None: in memory)


@dataclass
class Config:
    """A loaded network file: the graph plus the settings to train it."""

    name: str
    graph: Graph
    input: InputConfig
    train: TrainConfig
    memory: MemoryConfig
    source: str


CHOICES = {
    (OptimizerConfig, "type"): OPTIMIZERS,
    (ScheduleConfig, "type"): ("constant", "step", "cosine"),
    (DataConfig, "type"): DATASETS,
    (TrainConfig, "init"): ("default", "he", "xavier"),
    (TrainConfig, "precision"): tuple(PRECISIONS),
    (MemoryConfig, "policy"): policies.CHOICES,
}
OPTIONAL = ("path", "host_store", "workers")  # settings that may be null
POSITIVE = {(TrainConfig, "batch"), (TrainConfig, "gradient_bucket"), (TrainConfig, "iterations"), (OptimizerConfig, "lr"), (ParamGroup, "lr_scale"),
            (DataConfig, "samples"), (DataConfig, "holdout"), (OptimizerConfig, "eps")}
BELOW_ONE = {(DataConfig, "holdout"), (OptimizerConfig, "beta1"), (OptimizerConfig, "beta2")}  # fractions
AT_MOST = {(DataConfig, "workers"): MAX_WORKERS}


# ---- public entry points ----------------------------------------------------------------
def config_from_graph(graph, classes, train=None, memory=None, name=None):
    """A Config for a graph built in Python (its images come in through the node "data").

    `train` and `memory` are a TrainConfig and a MemoryConfig, or mappings as a file's sections
    (None: the defaults); either is checked as a file's would be, and so are `classes` and the
    loss layers reading that many scores."""
    if not isinstance(graph, Graph):
        raise ConfigError(f"<{type(graph).__name__}>", "", f"expected a snrt.Graph, got {_kind(graph)}")
    source = f"<graph {graph.name}>"
    if "data" not in graph.nodes or "label" not in graph.nodes:
        raise ConfigError(name or graph.name, "", "a trainable graph needs Input nodes named 'data' and 'label'")
    fed = {"data": ("float", "a float dtype (the data pipeline feeds it images)"),
           "label": ("int", "an int dtype (the data pipeline feeds it class indices)")}
    for node in graph.nodes.values():  # the Inputs the data pipeline feeds, and no others
        kind, wanted = fed.get(node.name, (None, None))
        if isinstance(node.layer, Input) != bool(kind) or (kind and not node.dtype.startswith(kind)):
            raise ConfigError(source, node.name, f"expected an Input of {wanted}, got {node.layer!r}" if kind else
                              f"an Input other than 'data' and 'label', which nothing feeds: {node.layer!r}")
    if not _is_int(classes) or classes < 2:
        raise ConfigError(source, "classes", f"expected an int >= 2, got {_kind(classes)}")
    _check_loss(source, graph, classes)
    sections = {}
    for key, cls, given in (("train", TrainConfig, train), ("memory", MemoryConfig, memory)):
        if isinstance(given, cls):
            given = settings_dict(given)
        elif given is not None and not isinstance(given, dict):
            raise ConfigError(source, key, f"expected a {cls.__name__} or a mapping of settings, got {_kind(given)}")
        sections[key] = parse_section(source, key, cls, given or {})
    _check_groups(source, graph, sections["train"].optimizer.groups)
    input_cfg = InputConfig(list(graph["data"].shape), classes, per_pixel=bool(graph["label"].shape))
    return Config(name or graph.name, graph, input_cfg, sections["train"], sections["memory"], source)



def with_settings(config, train=None, memory=None):
    """A copy of `config` with settings replaced, checked as the file's are, e.g.
    with_settings(cfg, train={"batch": 8}, memory={"policy": "offload", "budget": "2GiB"}).

    Nested sections merge: train={"optimizer": {"lr": 0.01}} keeps the other optimizer settings.
    """
    if not isinstance(config, Config):
        raise ConfigError(f"<{type(config).__name__}>", "", f"expected a snrt.Config to change, got {_kind(config)}")
    sections = {}
    for key, cls, changes in (("train", TrainConfig, train), ("memory", MemoryConfig, memory)):
        if changes is not None and not isinstance(changes, dict):
            raise ConfigError(config.source, key, f"expected a mapping of settings such as {{'batch': 8}}, "
                                                  f"got {_kind(changes)}")
        if changes:
            current = settings_dict(getattr(config, key))
            sections[key] = parse_section(config.source, key, cls, _merged(current, changes))
    return dataclasses.replace(config, **sections)


def settings_dict(section):
    """A settings dataclass (TrainConfig, MemoryConfig) as plain data that parses back to it:
    tuples as lists, a parameter group's unset weight_decay left out."""
    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items() if not (k == "weight_decay" and v is None)}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value
    return plain(dataclasses.asdict(section))


def _merged(base, changes):
    """`base` (a dict) with `changes` set, merging nested dicts key by key."""
    out = dict(base)
    for k, v in changes.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(source, overrides=None):
    """Load a network file (path) or an already parsed dict into a Config.

    `overrides` maps dotted keys to values set before validation, e.g.
    {"train.batch": 2, "input.shape": [3, 64, 64]} (what the command-line flags do), so that
    a bad value is reported like one in the file.
    """
    _check_overrides(overrides)
    if isinstance(source, dict):
        return parse_config(apply_overrides(source, overrides), "<dict>")
    if not isinstance(source, (str, os.PathLike)):
        raise ConfigError(f"<{type(source).__name__}>", "", f"expected a network file's path or a parsed dict, "
                                                           f"got {_kind(source)}")
    path = Path(source)
    try:
        text = _read_text(path)
    except FileNotFoundError:
        raise ConfigError(str(path), "", "file not found") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "", "this is a folder; expected a network YAML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), "", f"not UTF-8 text (byte {e.start}); expected a network YAML file") from None
    except OSError as e:
        raise ConfigError(str(path), "", f"cannot read the file ({e.strerror})") from None
    try:
        doc = yaml.load(text, Loader=_Loader)
    except _DuplicateKey as e:
        raise ConfigError(str(path), e.key, str(e)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(str(path), "", f"not valid YAML: {where}{problem}") from None
    except RecursionError:
        raise ConfigError(str(path), "", "not valid YAML: nested too deeply") from None
    _check_size(str(path), doc)
    return parse_config(apply_overrides(doc, overrides), str(path), default_name=path.stem)


class _DuplicateKey(Exception):
    """A mapping of the file gives one key twice (YAML would keep the last silently)."""

    def __init__(self, key, first, second):
        where = f"line {first}" if first == second else f"lines {first} and {second}"
        super().__init__(f"given twice in one mapping ({where}); keep one")
        self.key = str(key)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, but a key given twice in a mapping is an error, a tagged value its
    tag cannot read (!!int abc, !!bool maybe) is a YAML error at its line, and numbers in
    exponent form without a point (1e-3, 5E4) are floats, as in JSON and YAML 1.2."""

    def construct_object(self, node, deep=False):
        try:
            return super().construct_object(node, deep)
        except (ValueError, KeyError, TypeError, AttributeError):  # PyYAML's constructors assume a readable value
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise yaml.constructor.ConstructorError(None, None, f"the tag {tag} cannot read {node.value!r}",
                                                    node.start_mark) from None

    def construct_mapping(self, node, deep=False):
        if not isinstance(node, yaml.MappingNode):  # !!map [1]: the constructor says what it expected
            return super().construct_mapping(node, deep)
        seen = {}  # key -> its line
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *alias" may override, as YAML says
                continue
            key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the constructor reports it
                continue
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9]+(?:\.[0-9]*)?[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _read_text(path):
    """The text of the network file `path`; ConfigError when it is larger than a network file
    can be (a data file or a device given by mistake), read no further than that."""
    with open(path, "rb") as f:
        data = f.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(str(path), "", f"larger than {MAX_YAML_BYTES // 2**20} MiB; expected a network YAML file "
                                         "(a few KB: write the network with blocks and repeat)")
    return data.decode("utf-8")


def _check_size(source, doc):
    """Refuse a document with more than MAX_YAML_VALUES values once YAML aliases are expanded
    (a few lines of aliases can stand for billions), counting without expanding."""
    seen, stack = 0, [doc]
    while stack:
        value = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise ConfigError(source, "", f"the file expands to more than {MAX_YAML_VALUES:,} values (YAML aliases "
                                          "nested in aliases?); write the network with blocks and repeat instead")
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def _check_overrides(overrides):
    """A ConfigError (source "<overrides>") unless `overrides` is None or a mapping whose keys are
    dotted names such as "train.batch"."""
    if overrides is None:
        return
    if not isinstance(overrides, dict):
        raise ConfigError("<overrides>", "", f"expected a mapping of dotted keys to values such as "
                                             f"{{'train.batch': 2}}, got {_kind(overrides)}")
    for dotted in overrides:
        if not isinstance(dotted, str) or not all(dotted.split(".")):
            raise ConfigError("<overrides>", str(dotted), f"expected a dotted key such as 'train.batch', "
                                                          f"got {_kind(dotted)}")


def apply_overrides(doc, overrides):
    """A copy of `doc` with each dotted key of `overrides` set (sections created as needed).

    A callable value is applied to the current value (e.g. to resize `input.shape`).
    """
    if not overrides or not isinstance(doc, dict):
        return doc
    doc = copy.deepcopy(doc)
    for dotted, value in overrides.items():
        *parents, last = dotted.split(".")
        section = doc
        for name in parents:
            if not isinstance(section.get(name), dict):
                section[name] = {}
            section = section[name]
        section[last] = value(section.get(last)) if callable(value) else value
    return doc


def parse_config(doc, source, default_name="net"):
    """Validate a parsed YAML document and build its Config."""
    if not isinstance(doc, dict):
        raise ConfigError(source, "", f"expected a mapping with keys {', '.join(TOP_LEVEL_KEYS)}; got {_kind(doc)}")
    _reject_unknown(source, "", doc, TOP_LEVEL_KEYS)
    for required in ("input", "network"):
        if required not in doc:
            raise ConfigError(source, required, "missing; every network file needs 'input' and 'network'")
    name = doc.get("name", None)
    if name is None:  # the file's name, made plain
        name = re.sub(r"[^A-Za-z0-9._-]", "_", default_name)[:200].strip(".") or "net"
    elif not isinstance(name, str):
        raise ConfigError(source, "name", f"expected a string, got {_kind(name)}")
    elif not PLAIN_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(source, "name", f"expected a plain name (letters, digits, '.', '_', '-'; it names the "
                                          f"run folder runs/NAME), got {name!r}")
    input_cfg = _parse_input(source, doc["input"])
    env = {"classes": input_cfg.classes, **_parse_vars(source, doc.get("vars", {}))}
    blocks = _parse_blocks(source, doc.get("blocks", {}))
    try:
        entries = expand_network(source, doc["network"], blocks, env)
    except RecursionError:
        raise ConfigError(source, "network", "nested too deeply") from None
    _check_unused_blocks(source, blocks, doc["network"])
    graph = build_graph(source, name, input_cfg, entries)
    _check_loss(source, graph, input_cfg.classes)
    train = parse_section(source, "train", TrainConfig, doc.get("train", {}))
    _check_groups(source, graph, train.optimizer.groups)
    memory = parse_section(source, "memory", MemoryConfig, doc.get("memory", {}))
    return Config(name, graph, input_cfg, train, memory, source)


# ---- small validators ---------------------------------------------------------------------
def _kind(value):
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


def _suggest(word, choices):
    """' (did you mean 'X'?)' for the closest choice, compared case-insensitively, or ''."""
    lowered = {str(c).lower(): c for c in choices}
    close = difflib.get_close_matches(str(word).lower(), list(lowered), n=1)
    return f" (did you mean '{lowered[close[0]]}'?)" if close else ""


def _join(key, child):
    if isinstance(child, int):
        return f"{key}[{child}]"
    return f"{key}.{child}" if key else child


def _reject_unknown(source, key, mapping, allowed):
    for k in mapping:
        if k not in allowed:
            hint = _suggest(k, allowed)
            raise ConfigError(source, _join(key, k), f"unknown key{hint}; expected one of {', '.join(allowed)}")


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _parse_input(source, section):
    if not isinstance(section, dict):
        raise ConfigError(source, "input", f"expected a mapping with 'shape' and 'classes', got {_kind(section)}")
    _reject_unknown(source, "input", section, ("shape", "classes", "per_pixel"))
    shape, classes, per_pixel = section.get("shape"), section.get("classes"), section.get("per_pixel", False)
    if not isinstance(shape, list) or not shape or not all(_is_int(d) and d > 0 for d in shape):
        raise ConfigError(source, "input.shape", f"expected a list of positive ints such as [3, 224, 224], got {_kind(shape)}")
    if not _is_int(classes) or classes < 2:
        raise ConfigError(source, "input.classes", f"expected an int >= 2, got {_kind(classes)}")
    if not isinstance(per_pixel, bool):
        raise ConfigError(source, "input.per_pixel", f"expected true or false, got {_kind(per_pixel)}")
    if per_pixel and len(shape) != 3:
        raise ConfigError(source, "input.per_pixel", f"per-pixel labels need images (C, H, W), input.shape is {shape}")
    return InputConfig(shape, classes, per_pixel)


def _parse_vars(source, section):
    if not isinstance(section, dict):
        raise ConfigError(source, "vars", f"expected a mapping of names to values, got {_kind(section)}")
    for k in section:
        if not isinstance(k, str) or not k.isidentifier():
            raise ConfigError(source, f"vars.{k}", "expected a name made of letters, digits and _")
        if k == "classes":
            raise ConfigError(source, "vars.classes", "$classes is input.classes; set it there, or choose another name")
    return dict(section)


def parse_section(source, key, cls, section):
    """Fill dataclass `cls` from a mapping, checking keys, types, choices and ranges."""
    if not isinstance(section, dict):
        raise ConfigError(source, key, f"expected a mapping, got {_kind(section)}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    _reject_unknown(source, key, section, tuple(fields))
    values = {}
    for name, value in section.items():
        k, f = f"{key}.{name}", fields[name]
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            values[name] = parse_section(source, k, f.default_factory, value)
        else:
            values[name] = _check_setting(source, k, cls, name, f.type, value)
    return cls(**values)


def _check_setting(source, key, cls, name, annotation, value):
    if annotation is ParamGroups:
        return _parse_groups(source, key, value)
    if annotation is Bytes:
        if value is None:
            return None
        try:
            value = parse_bytes(value)
        except ValueError as e:
            raise ConfigError(source, key, str(e)) from None
        if (cls, name) in POSITIVE and value <= 0:
            raise ConfigError(source, key, f"expected a positive byte size, got {value!r}")
        return value
    if value is None and name in OPTIONAL:
        return None
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(source, key, f"expected a string, got {_kind(value)}")
        choices = CHOICES.get((cls, name))
        if choices and value not in choices:
            raise ConfigError(source, key, f"expected one of {', '.join(choices)}, got {value!r}")
    elif annotation is int and not _is_int(value):
        raise ConfigError(source, key, f"expected an int, got {_kind(value)}")
    elif annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(source, key, f"expected a number, got {_kind(value)}")
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(source, key, f"expected a finite number, got {value!r}")
    elif annotation is bool and not isinstance(value, bool):
        raise ConfigError(source, key, f"expected true or false, got {_kind(value)}")
    elif annotation is list and not (isinstance(value, list) and all(_is_int(v) and v >= 0 for v in value)):
        raise ConfigError(source, key, f"expected a list of non-negative ints, got {_kind(value)}")
    if (cls, name) in POSITIVE and value <= 0:
        raise ConfigError(source, key, f"expected a positive value, got {value!r}")
    if (cls, name) in BELOW_ONE and value >= 1:
        raise ConfigError(source, key, f"expected a fraction below 1, got {value!r}")
    if (cls, name) in AT_MOST and value > AT_MOST[(cls, name)]:
        raise ConfigError(source, key, f"expected at most {AT_MOST[(cls, name)]}, got {value!r}")
    if annotation in (int, float) and value < 0:
        raise ConfigError(source, key, f"expected a non-negative value, got {value!r}")
    return value


def _parse_groups(source, key, value):
    """train.optimizer.groups: a list of mappings, each with `params` (a pattern or a list of
    them) and optionally weight_decay and lr_scale."""
    if not isinstance(value, list):
        raise ConfigError(source, key, f"expected a list of parameter groups, got {_kind(value)}")
    groups = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if not isinstance(item, dict) or "params" not in item:
            raise ConfigError(source, where, "expected a mapping with 'params' (name patterns such as '*:bias') "
                                             f"and weight_decay or lr_scale, got {_kind(item)}")
        patterns = item["params"]
        patterns = [patterns] if isinstance(patterns, str) else patterns
        if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
            raise ConfigError(source, f"{where}.params", "expected a name pattern or a list of them "
                                                          f"('node:param', '*' matches anything), got {_kind(item['params'])}")
        rest = parse_section(source, where, ParamGroup, {k: v for k, v in item.items() if k != "params"})
        groups.append(dataclasses.replace(rest, params=tuple(patterns)))
    return ParamGroups(groups)


def _check_groups(source, graph, groups):
    """Every parameter group matches at least one parameter of the network (a typo otherwise)."""
    names = [f"{node}:{p}" for node, specs in graph.param_specs().items() for p in specs]
    for i, group in enumerate(groups):
        for pattern in group.params:
            if not fnmatch.filter(names, pattern):
                example = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                raise ConfigError(source, f"train.optimizer.groups[{i}].params",
                                  f"pattern {pattern!r} matches no parameter (names are node:param, e.g. {example})")


# ---- blocks and expansion -----------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    """A reusable group of layers: argument defaults (None = required) and layer entries."""

    args: dict
    layers: list


@dataclass
class LayerEntry:
    """One layer after expansion: global name, type, resolved options, input refs, key path."""

    name: str
    type: str
    options: dict
    inputs: list  # global names
    key: str


def _parse_blocks(source, section):
    if not isinstance(section, dict):
        raise ConfigError(source, "blocks", f"expected a mapping of block names to blocks, got {_kind(section)}")
    blocks = {}
    for name, body in section.items():
        key = f"blocks.{name}"
        if not isinstance(body, dict):
            raise ConfigError(source, key, f"expected a mapping with 'layers' (and 'args'), got {_kind(body)}")
        _reject_unknown(source, key, body, ("args", "layers"))
        args = body.get("args", {}) or {}
        if not isinstance(args, dict):
            raise ConfigError(source, f"{key}.args", f"expected a mapping of argument names to defaults, got {_kind(args)}")
        layers = body.get("layers")
        if not isinstance(layers, list) or not layers:
            raise ConfigError(source, f"{key}.layers", f"expected a non-empty list of layers, got {_kind(layers)}")
        blocks[name] = Block(args, layers)
    return blocks


def _check_unused_blocks(source, blocks, network):
    """The layer types and block uses of the blocks `network` never uses (expanding the
    network checked the others where they are used): a typo there is an error too."""
    used, todo = set(), [network]
    while todo:
        for item in todo.pop():
            name = item.get("block") if isinstance(item, dict) else None
            if isinstance(name, str) and name in blocks and name not in used:
                used.add(name)
                todo.append(blocks[name].layers)
    for name in blocks.keys() - used:
        for i, item in enumerate(blocks[name].layers):
            key = f"blocks.{name}.layers[{i}]"
            kind = item.get("type") if isinstance(item, dict) else None
            if isinstance(kind, str) and not kind.startswith("$") and kind != "Input" and kind not in LAYERS:
                raise _unknown_type(source, key, kind)
            block = item.get("block") if isinstance(item, dict) else None
            if isinstance(block, str) and not block.startswith("$") and block not in blocks:
                raise ConfigError(source, _join(key, "block"), f"unknown block {block!r}; known: {', '.join(blocks)}")


def _unknown_type(source, key, type_name):
    """The ConfigError of an unknown layer type at `key`, with the closest known one."""
    return ConfigError(source, _join(key, "type"), f"unknown layer type {type_name!r}{_suggest(type_name, list(LAYERS))}; "
                                                   f"known: {', '.join(sorted(LAYERS))}")


_REF = re.compile(r"^\$([A-Za-z_]\w*)$")
_EXPR = re.compile(r"^\$\{(.*)\}$")


def substitute(source, key, value, env):
    """Replace `$name` and `${expression}` strings (recursively in lists) by their values."""
    if isinstance(value, list):
        return [substitute(source, _join(key, i), v, env) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value
    ref, expr = _REF.match(value), _EXPR.match(value)
    if ref:
        if ref.group(1) not in env:
            raise ConfigError(source, key, f"unknown name ${ref.group(1)}; known here: {', '.join(sorted(env)) or 'none'}")
        return env[ref.group(1)]
    if expr:
        try:
            return evaluate(expr.group(1), env)
        except ValueError as e:
            raise ConfigError(source, key, f"in {value!r}: {e}") from None
    return value


class _Expander:
    """Walks `network` and block bodies, producing LayerEntry objects in textual order."""

    def __init__(self, source, blocks):
        self.source, self.blocks = source, blocks
        self.entries = []

    def expand(self, items, key, env, prefix, block_inputs, stack):
        """Expand one scope; return the global name of its last node.

        Refs inside the scope may point forward (so that a cycle is reported as such), so
        they are resolved once the whole scope is known.
        """
        if not isinstance(items, list) or not items:
            raise ConfigError(self.source, key, f"expected a non-empty list of layers, got {_kind(items)}")
        local = {"data": "data", "label": "label"}
        if stack:  # a block: $in is its (first) input; $in0, $in1, ... name each of its inputs
            local = {"$in": block_inputs[0], **{f"$in{i}": x for i, x in enumerate(block_inputs)}}
        counters = {}
        pending = []  # (entry, [(raw ref, key)])
        previous = block_inputs[0]
        for i, item in enumerate(items):
            item_key = _join(key, i)
            if not isinstance(item, dict) or ("type" in item) == ("block" in item):
                raise ConfigError(self.source, item_key, f"expected a mapping with either 'type' or 'block', got {_kind(item)}")
            if "block" in item:
                name, previous = self._expand_block(item, item_key, env, prefix, local, previous, counters, stack)
            else:
                entry, refs = self._layer(item, item_key, env, prefix, previous, counters)
                name, previous = entry.name[len(prefix):], entry.name
                pending.append((entry, refs))
            if name in local:
                raise ConfigError(self.source, _join(item_key, "name"), f"name '{name}' is used twice in this scope")
            local[name] = previous
        for entry, refs in pending:
            entry.inputs = [self._resolve(ref, ref_key, local) for ref, ref_key in refs]
        return previous

    def _resolve(self, ref, key, local):
        if isinstance(ref, _GlobalName):
            return str(ref)
        if ref in local:
            return local[ref]
        known = ", ".join(k for k in local if not k.startswith("$")) or "none"
        where = "this block" if "$in" in local else "the network"
        hint = " ($in is the block's input; $in0, $in1, ... when it reads several)" if "$in" in local else ""
        raise ConfigError(self.source, key, f"unknown input '{ref}': no layer of that name in {where}{hint}; known: {known}")

    def _auto_name(self, counters, base):
        k = counters.get(base, 0)
        counters[base] = k + 1
        return f"{base}{k}"

    def _layer(self, item, key, env, prefix, previous, counters):
        type_name = item["type"]
        if not isinstance(type_name, str):
            raise ConfigError(self.source, _join(key, "type"), f"expected a layer type name, got {_kind(type_name)}")
        if type_name == "Input":
            raise ConfigError(self.source, _join(key, "type"), "the inputs ('data', 'label') come from the input: "
                                                                "section; a network lists no Input layers")
        if type_name not in LAYERS:
            raise _unknown_type(self.source, key, type_name)
        name = item.get("name")
        if name is None:
            name = self._auto_name(counters, type_name.lower())
        elif not isinstance(name, str) or not name or name.startswith("$"):
            raise ConfigError(self.source, _join(key, "name"), f"expected a name (not starting with '$'), got {_kind(name)}")
        options = {k: substitute(self.source, _join(key, k), v, env) for k, v in item.items()
                   if k not in ("type", "name", "inputs")}
        inputs = item.get("inputs")
        if inputs is None:
            refs = [(previous, key)]
            if type_name in LABEL_READERS:
                refs.append(("label", key))
            refs = [(self._global_ref(r), k) for r, k in refs]
        else:
            if isinstance(inputs, str):
                inputs = [inputs]
            if not isinstance(inputs, list) or not all(isinstance(r, str) for r in inputs):
                raise ConfigError(self.source, _join(key, "inputs"), f"expected a list of layer names, got {_kind(inputs)}")
            refs = [(r, _join(_join(key, "inputs"), j)) for j, r in enumerate(inputs)]
        entry = LayerEntry(prefix + name, type_name, options, [], key)
        self.entries.append(entry)
        if len(self.entries) > MAX_NODES:
            raise ConfigError(self.source, key, f"the network expands to more than {MAX_NODES:,} layers "
                                                "(a repeat count too large?)")
        return entry, refs

    @staticmethod
    def _global_ref(name):
        """Default inputs are already global names; mark them so `_resolve` passes them through."""
        return _GlobalName(name)

    def _expand_block(self, item, key, env, prefix, local, previous, counters, stack):
        _reject_unknown(self.source, key, item, ("block", "args", "repeat", "name", "inputs"))
        block_name = item["block"]
        if not isinstance(block_name, str):
            raise ConfigError(self.source, _join(key, "block"), f"expected a block name, got {_kind(block_name)}")
        if len(stack) >= MAX_BLOCK_DEPTH:
            raise ConfigError(self.source, _join(key, "block"), f"blocks nested more than {MAX_BLOCK_DEPTH} deep")
        if block_name not in self.blocks:
            known = ", ".join(self.blocks) or "none defined"
            raise ConfigError(self.source, _join(key, "block"), f"unknown block {block_name!r}; known: {known}")
        if block_name in stack:
            raise ConfigError(self.source, _join(key, "block"), f"block '{block_name}' uses itself ({' -> '.join(stack + (block_name,))})")
        block = self.blocks[block_name]
        repeat = substitute(self.source, _join(key, "repeat"), item.get("repeat", 1), env)
        if not _is_int(repeat) or repeat < 1:
            raise ConfigError(self.source, _join(key, "repeat"), f"expected a positive int, got {_kind(repeat)}")
        args = self._block_args(item, key, env, block, block_name)
        name = item.get("name") or self._auto_name(counters, block_name)
        if not isinstance(name, str) or "." in name or name.startswith("$"):
            raise ConfigError(self.source, _join(key, "name"), f"expected a name without '.' or '$', got {_kind(name)}")
        block_inputs = (previous,)
        if "inputs" in item:  # one layer or several: $in (= $in0), $in1, ... in the block
            refs = item["inputs"] if isinstance(item["inputs"], list) else [item["inputs"]]
            if not refs or not all(isinstance(r, str) for r in refs):
                raise ConfigError(self.source, _join(key, "inputs"), f"expected a list of layer names, got {_kind(item['inputs'])}")
            for j, ref in enumerate(refs):
                if ref not in local:
                    self._resolve(ref, _join(_join(key, "inputs"), j), local)
            block_inputs = tuple(local[ref] for ref in refs)
        body_key = f"{key}.block.{block_name}.layers"
        before = len(self.entries)
        for r in range(repeat):  # a repeat reads the previous repeat's output as $in, the other inputs as given
            instance = name if repeat == 1 else f"{name}.{r}"
            output = self.expand(block.layers, body_key, args, f"{prefix}{instance}.", block_inputs,
                                 stack + (block_name,))
            block_inputs = (output, *block_inputs[1:])
            if r == 0 and before + (len(self.entries) - before) * repeat > MAX_NODES:
                raise ConfigError(self.source, _join(key, "repeat"), f"{repeat} repeats of block '{block_name}' "
                                  f"make more than {MAX_NODES:,} layers")
        return name, output

    def _block_args(self, item, key, env, block, block_name):
        given = item.get("args", {}) or {}
        if not isinstance(given, dict):
            raise ConfigError(self.source, _join(key, "args"), f"expected a mapping of argument values, got {_kind(given)}")
        _reject_unknown(self.source, _join(key, "args"), given, tuple(block.args))
        args = {k: v for k, v in env.items() if k == "classes" or k not in block.args}
        for arg, default in block.args.items():
            if arg in given:
                args[arg] = substitute(self.source, _join(_join(key, "args"), arg), given[arg], env)
            elif default is None:
                raise ConfigError(self.source, _join(key, "args"), f"block '{block_name}' needs argument '{arg}'")
            else:
                args[arg] = default
        return args


class _GlobalName(str):
    """A ref that is already a global node name (a default input), not a local one."""


def expand_network(source, network, blocks, env):
    """Flatten `network` into LayerEntry objects with global names and resolved inputs."""
    expander = _Expander(source, blocks)
    expander.expand(network, "network", env, "", ("data",), ())
    first = {}
    for entry in expander.entries:  # a name given at one level can equal one generated at another
        if entry.name in ("data", "label") or entry.name in first:
            other = first.get(entry.name)
            clash = f"the layer at {other.key}" if other else "a graph input"
            raise ConfigError(source, entry.key, f"layer name '{entry.name}' is also the name of {clash}; rename one")
        first[entry.name] = entry
    return expander.entries


# ---- graph construction -------------------------------------------------------------------
def _sort_topologically(source, entries):
    """Entries in dependency order, textual order among ready ones; a cycle is an error."""
    index = {e.name: i for i, e in enumerate(entries)}
    waiting = [sum(1 for r in e.inputs if r in index) for e in entries]
    readers = {e.name: [] for e in entries}
    for e in entries:
        for r in e.inputs:
            if r in index:
                readers[r].append(index[e.name])
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        i = heapq.heappop(ready)
        ordered.append(entries[i])
        for j in readers[entries[i].name]:
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(ordered) < len(entries):
        stuck = {e.name for e in entries} - {e.name for e in ordered}
        cycle = _find_cycle(entries, index, stuck)
        first = entries[index[cycle[0]]]
        raise ConfigError(source, _join(first.key, "inputs"), f"layers form a cycle: {' -> '.join(cycle)}")
    return ordered


def _find_cycle(entries, index, stuck):
    """A cycle among the `stuck` entries, as a list of names ending where it started."""
    name = min(stuck, key=index.get)
    path, seen = [], {}
    while name not in seen:
        seen[name] = len(path)
        path.append(name)
        name = next(r for r in entries[index[name]].inputs if r in stuck)
    return path[seen[name]:] + [name]


def build_graph(source, name, input_cfg, entries):
    """The Graph of the expanded entries, with the `data` and `label` input nodes."""
    graph = Graph(name)
    graph.add(Input(shape=tuple(input_cfg.shape)), name="data", key="input.shape")
    label_shape = tuple(input_cfg.shape[1:]) if input_cfg.per_pixel else ()
    graph.add(Input(shape=label_shape, dtype="int64"), name="label", key="input.classes")
    for entry in _sort_topologically(source, entries):
        if any(ref == "label" and not (entry.type in LABEL_READERS and i == 1) for i, ref in enumerate(entry.inputs)):
            raise ConfigError(source, _join(entry.key, "inputs"), f"layer '{entry.name}' ({entry.type}) reads 'label', "
                                                                   "the class indices, which only a loss reads (as "
                                                                   "its second input)")
        layer = make_layer(source, entry)
        try:
            graph.add(layer, inputs=entry.inputs, name=entry.name, key=entry.key)
        except GraphError as e:
            raise ConfigError(source, entry.key, f"layer '{entry.name}' ({entry.type}): {e.message}") from None
    return graph


def _check_loss(source, graph, classes):
    """A training network has at least one loss layer (several are summed with their weights),
    each reading `classes` scores per sample, or per pixel when the labels are per pixel (the
    layer itself checks that it reads the labels)."""
    losses = [n for n in graph.nodes.values() if n.layer.type_name in LOSSES]
    if not losses:
        raise ConfigError(source, "network", f"expected a loss layer ({', '.join(sorted(LOSSES))}), found none")
    wanted = (classes, *graph["label"].shape)
    what = "input.classes scores per pixel" if len(wanted) > 1 else "input.classes scores"
    for loss in losses:
        logits = graph[loss.inputs[0]]
        if tuple(logits.shape) != wanted:
            raise ConfigError(source, loss.key or "network",
                              f"the loss '{loss.name}' reads '{logits.name}' of shape {list(logits.shape)} per "
                              f"sample; it needs {list(wanted)} ({what})")


def make_layer(source, entry):
    """Instantiate the layer of `entry`, turning option problems into ConfigErrors."""
    cls = LAYERS[entry.type]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for opt, value in entry.options.items():
        if opt not in fields:
            expected = ", ".join(fields) or "no options"
            hint = _suggest(opt, list(fields))
            raise ConfigError(source, _join(entry.key, opt), f"{entry.type} has no option '{opt}'{hint}; it takes: {expected}")
        expected_type = fields[opt].type
        if not _matches(value, expected_type):
            raise ConfigError(source, _join(entry.key, opt), f"option '{opt}' of {entry.type} must be {_describe(expected_type)}, got {_kind(value)}")
    for opt, f in fields.items():
        if opt not in entry.options and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(source, entry.key, f"{entry.type} needs option '{opt}'")
    try:
        return cls(**entry.options)
    except (ValueError, TypeError) as e:
        message = str(e)
        match = re.search(r"option '(\w+)'", message)
        key = _join(entry.key, match.group(1)) if match else entry.key
        raise ConfigError(source, key, f"{entry.type}: {message}") from None


def _matches(value, annotation):
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return _is_int(value)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if annotation is str:
        return isinstance(value, str)
    return True  # compound options (pairs, shapes) are checked by the layer itself


def _describe(annotation):
    return {bool: "true or false", int: "an int", float: "a finite number", str: "a string"}[annotation]


# ---- writing back -----------------------------------------------------------------------------
def graph_to_dict(graph, input_cfg):
    """A flat YAML document (every layer named, every input explicit) that loads to `graph`."""
    network = []
    for node in graph.nodes.values():
        if node.name in ("data", "label"):
            continue
        entry = {"type": node.layer.type_name, "name": node.name, "inputs": list(node.inputs)}
        entry.update(node.layer.options())
        network.append(entry)
    return {
        "name": graph.name,
        "input": {"shape": list(input_cfg.shape), "classes": input_cfg.classes,
                  **({"per_pixel": True} if input_cfg.per_pixel else {})},
        "network": network,
    }


def config_to_yaml(config):
    """The Config as YAML text: the flat network plus its train and memory sections."""
    doc = graph_to_dict(config.graph, config.input)
    doc["train"] = settings_dict(config.train)
    doc["memory"] = settings_dict(config.memory)
    return yaml.safe_dump(doc, sort_keys=False, default_flow_style=None)
