"""The model zoo: parameter counts against published numbers, YAML configs against the Python
builders, depths and output shapes."""

import functools
import time
from pathlib import Path

import pytest

from snrt.config import load_config
from snrt.layers.conv import Conv2d
from snrt.layers.linear import Linear
from snrt.layers.loss import SoftmaxCrossEntropy
from snrt.models import MODELS, cifar_resnet, resnet

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# name: (published count, exact count of the reference implementation), 1000 classes.
# torchvision for ResNet, VGG and DenseNet; timm's inception_v4; Caffe's bvlc_alexnet.
PUBLISHED = {
    "resnet50": (25.557e6, 25_557_032),
    "resnet101": (44.549e6, 44_549_160),
    "resnet152": (60.193e6, 60_192_808),
    "vgg16": (138.358e6, 138_357_544),
    "vgg19": (143.667e6, 143_667_240),
    "alexnet": (61.0e6, 60_965_224),
    "densenet121": (7.98e6, 7_978_856),
    "inceptionv4": (42.7e6, 42_679_816),
}

# Networks written only in YAML (no Python builder): exact counts of the reference
# implementations.
YAML_ONLY = {
    "se_resnet50": 28_088_024,
    "mobilenet_v2": 3_504_872,  # torchvision's
    "convnext_tiny": 28_589_128,  # timm's
    "efficientnet_b0": 5_288_548,  # torchvision's
    "unet": 31_037_698,  # milesial/Pytorch-UNet's UNet(3, 2, bilinear=False)
}

# He et al. 2016, table 6 (option-A shortcuts); our projections add a few thousand parameters.
CIFAR_PUBLISHED = {
    "cifar_resnet20": 0.27e6,
    "cifar_resnet56": 0.85e6,
    "cifar_resnet110": 1.7e6,
    "cifar_resnet164": 1.7e6,
}


@functools.cache
def built(name):
    return MODELS[name]()


def is_weighted(node):
    return isinstance(node.layer, (Conv2d, Linear))


def depth(g):
    """Conv2d + Linear layers on the longest path from the inputs to the loss."""
    longest = {}
    for node in g.nodes.values():
        longest[node.name] = max((longest[i] for i in node.inputs), default=0) + is_weighted(node)
    return max(longest.values())


def projection_convs(g):
    """Conv2d nodes that read a tensor an earlier Conv2d already read (a shortcut branch)."""
    read, projections = set(), []
    for node in g.nodes.values():
        if isinstance(node.layer, Conv2d):
            if node.inputs[0] in read:
                projections.append(node.name)
            read.add(node.inputs[0])
    return projections


def logits_shape(g):
    (loss,) = [n for n in g.nodes.values() if isinstance(n.layer, SoftmaxCrossEntropy)]
    assert loss.inputs[1] == "label"
    return g[loss.inputs[0]].shape


# ---- (1) parameter counts ----------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_count_matches_published(name):
    published, exact = PUBLISHED[name]
    count = built(name).num_params()
    print(f"{name}: {count:,} parameters (published {published / 1e6:.3f}M)")
    assert abs(count - published) <= 0.005 * published
    assert count == exact


@pytest.mark.parametrize("name", sorted(CIFAR_PUBLISHED))
def test_cifar_parameter_count_close_to_published(name):
    assert built(name).num_params() == pytest.approx(CIFAR_PUBLISHED[name], rel=0.02)


def test_alexnet_groups_variant():
    assert MODELS["alexnet"](groups=1).num_params() == 62_378_344


# ---- (2) YAML configs build the same graphs as the builders ------------------------------------
def test_every_model_has_a_config():
    assert sorted(p.stem for p in CONFIGS.glob("*.yaml")) == sorted([*MODELS, *YAML_ONLY])


@pytest.mark.parametrize("name", sorted(YAML_ONLY))
def test_yaml_only_networks_have_their_published_parameter_count(name):
    assert load_config(CONFIGS / f"{name}.yaml").graph.num_params() == YAML_ONLY[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_config_matches_builder(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert cfg.name == name
    assert cfg.graph.structure() == built(name).structure()
    assert cfg.train.optimizer.type == "sgd"
    expected_policy = "superneurons" if name == "resnet2500" else "none"
    assert cfg.memory.policy == expected_policy


def test_resnet2500_config_settings():
    cfg = load_config(CONFIGS / "resnet2500.yaml")
    assert cfg.train.batch == 16
    assert cfg.memory.budget == 12 * 2**30
    assert cfg.input.shape == [3, 227, 227] and cfg.input.classes == 1000
    assert len((CONFIGS / "resnet2500.yaml").read_text().splitlines()) < 100


# ---- (3) ResNet2500 ------------------------------------------------------------------------------
def test_resnet2500_depth_and_size():
    start = time.perf_counter()
    g = load_config(CONFIGS / "resnet2500.yaml").graph
    seconds = time.perf_counter() - start
    print(f"resnet2500.yaml: {len(g)} nodes, {g.num_params():,} parameters, loaded in {seconds:.2f}s")
    weighted = [n for n in g.nodes.values() if is_weighted(n)]
    projections = projection_convs(g)
    assert len(projections) == 4  # the first block of each stage
    assert len(weighted) - len(projections) == 2498 == depth(g)
    # 2 inputs, stem 4, 832 blocks of 10 nodes (3 x conv-BN, 2 ReLU, Add, ReLU), 4 projections
    # of 2, pool, fc, loss.
    assert len(g) == 2 + 4 + 832 * 10 + 4 * 2 + 3 == 8337


# ---- (4) inputs and outputs ------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(MODELS))
def test_inputs_and_logits(name):
    g = built(name)
    data, label = g["data"], g["label"]
    assert len(data.shape) == 3 and data.dtype == "float32"
    assert label.shape == () and label.dtype == "int64"
    classes = 10 if name.startswith(("cifar", "lenet")) else 1000
    assert logits_shape(g) == (classes,)
    assert list(g.nodes)[-1] == "loss" and isinstance(g["fc"].layer, Linear)


@pytest.mark.parametrize(
    "name", ["alexnet", "vgg16", "resnet50", "inceptionv4", "densenet121", "lenet", "cifar_resnet20"]
)
def test_classes_argument(name):
    assert logits_shape(MODELS[name](classes=7)) == (7,)


@pytest.mark.parametrize(
    "name, node, shape",
    [
        ("inceptionv4", "mixed5a.concat", (384, 35, 35)),
        ("inceptionv4", "reduction_a.0.concat", (1024, 17, 17)),
        ("inceptionv4", "reduction_b.0.concat", (1536, 8, 8)),
        ("inceptionv4", "inception_c.2.concat", (1536, 8, 8)),
        ("densenet121", "relu5", (1024, 7, 7)),
        ("resnet50", "stage4.2.relu", (2048, 7, 7)),
        ("alexnet", "pool5", (256, 6, 6)),
        ("vgg16", "pool5", (512, 7, 7)),
    ],
)
def test_feature_map_shapes(name, node, shape):
    assert built(name)[node].shape == shape


# ---- (5) depth formulas ---------------------------------------------------------------------------
@pytest.mark.parametrize("depth_, stages", [(50, None), (101, None), (152, None), (26, (2, 2, 2, 2))])
def test_imagenet_resnet_depth(depth_, stages):
    assert depth(resnet(depth=depth_, stages=stages)) == depth_


@pytest.mark.parametrize(
    "depth_, block",
    [(20, "basic"), (32, "basic"), (56, "basic"), (110, "basic"), (29, "bottleneck"), (164, "bottleneck")],
)
def test_cifar_resnet_depth_and_output(depth_, block):
    g = cifar_resnet(depth=depth_, block=block)
    assert depth(g) == depth_
    per_block = 2 if block == "basic" else 3
    assert sum(is_weighted(n) for n in g.nodes.values()) - len(projection_convs(g)) == depth_
    assert len(projection_convs(g)) == (2 if block == "basic" else 3)
    n = (depth_ - 2) // (3 * per_block)
    assert cifar_resnet(n=n, block=block).structure() == g.structure()
    last = [node for node in g.nodes.values() if node.layer.type_name == "GlobalAvgPool"][0]
    assert g[last.inputs[0]].shape == ((64 if block == "basic" else 256), 8, 8)
    assert logits_shape(g) == (10,)


@pytest.mark.parametrize(
    "build, kwargs",
    [
        (cifar_resnet, {"depth": 21}),
        (cifar_resnet, {"depth": 32, "block": "bottleneck"}),  # 6n + 2 but not 9n + 2
        (cifar_resnet, {"depth": 20, "block": "wide"}),
        (cifar_resnet, {"depth": 20, "n": 4}),
        (resnet, {"depth": 51}),
        (resnet, {"depth": 50, "stages": (3, 4, 6, 4)}),
    ],
)
def test_bad_depth_is_an_error(build, kwargs):
    with pytest.raises(ValueError):
        build(**kwargs)
