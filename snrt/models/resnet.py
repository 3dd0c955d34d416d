"""Residual networks (He, Zhang, Ren and Sun, "Deep Residual Learning for Image Recognition", 2016).

ImageNet nets use torchvision's Bottleneck layout (ResNet v1.5): 1x1 conv, 3x3 conv carrying
the stage's stride, 1x1 conv to 4x the width, each bias-free and followed by BatchNorm (ReLU
after the first two); the shortcut is the identity, or conv1x1 (stride) + BatchNorm where the
shape changes (the first block of each stage); the sum goes through ReLU. Stem: conv7x7/2 64,
BN, ReLU, maxpool 3/2 pad 1; stages of widths 64, 128, 256, 512 with strides 1, 2, 2, 2; then
global average pooling and the classifier. Depth = 3 * blocks + 2.

CIFAR nets (section 4.2 of the paper): conv3x3 16, BN, ReLU, three stages of n blocks at 16,
32, 64 channels (strides 1, 2, 2). Basic blocks (two 3x3 convs, depth 6n + 2) or the
bottlenecks above (depth 9n + 2). Shortcuts are projections (conv1x1 + BN) where the shape
changes, never the zero-padding option A.
"""

from snrt.layers.activation import ReLU
from snrt.layers.join import Add
from snrt.layers.pool import GlobalAvgPool, MaxPool
from snrt.models.common import classifier_head, conv_bn_relu, image_graph

IMAGENET_STAGES = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}
SUPERNEURONS_2500_STAGES = (6, 32, 788, 6)  # depth 2498, SuperNeurons' "ResNet2500"


def _residual(g, x, y, name, stride):
    """Add the shortcut of `x` (identity, or conv1x1+BN when the shape changes) to `y`; ReLU."""
    out_channels = g[y].shape[0]
    shortcut = x
    if stride != 1 or g[x].shape[0] != out_channels:
        shortcut = conv_bn_relu(g, x, f"{name}.proj", out_channels, 1, stride, relu=False)
    y = g.add(Add(), [y, shortcut], f"{name}.add")
    return g.add(ReLU(), [y], f"{name}.relu")


def bottleneck(g, x, name, width, stride=1, zero_init=False):
    """1x1 width, 3x3 width (stride), 1x1 4*width, each with BN; shortcut; ReLU. Returns the output.

    `zero_init` starts the last BN's scale at 0, so that the block starts as its shortcut.
    """
    y = conv_bn_relu(g, x, f"{name}.a", width, 1)
    y = conv_bn_relu(g, y, f"{name}.b", width, 3, stride, 1)
    y = conv_bn_relu(g, y, f"{name}.c", 4 * width, 1, relu=False, zero_init=zero_init)
    return _residual(g, x, y, name, stride)


def basic_block(g, x, name, width, stride=1, zero_init=False):
    """Two 3x3 convs of `width` (the first with the stride), each with BN; shortcut; ReLU."""
    y = conv_bn_relu(g, x, f"{name}.a", width, 3, stride, 1)
    y = conv_bn_relu(g, y, f"{name}.b", width, 3, 1, 1, relu=False, zero_init=zero_init)
    return _residual(g, x, y, name, stride)


def _stages(g, x, block, widths, counts, strides, zero_init=False):
    """`counts[s]` blocks of `widths[s]` per stage, the first of each with `strides[s]`."""
    for s, (width, count, stride) in enumerate(zip(widths, counts, strides), start=1):
        for i in range(count):
            x = block(g, x, f"stage{s}.{i}", width, stride if i == 0 else 1, zero_init)
    return x


def _head(g, x, classes):
    x = g.add(GlobalAvgPool(), [x], "pool")
    return classifier_head(g, x, classes)


def resnet(depth=None, stages=None, image_size=224, classes=1000, zero_init_residual=False):
    """ImageNet bottleneck ResNet of any depth (ResNet-50 when neither depth nor stages is given).

    `stages` (four block counts) defaults to the paper's table for depth 50, 101, 152, 200;
    any other depth needs `stages`, and depth must equal 3 * sum(stages) + 2 when both are given.
    `zero_init_residual` starts every block as its shortcut (needed to train thousands of layers).
    """
    if stages is None:
        depth = 50 if depth is None else depth
        if depth not in IMAGENET_STAGES:
            raise ValueError(f"no standard stages for depth {depth}; pass stages=(n1, n2, n3, n4)")
        stages = IMAGENET_STAGES[depth]
    if depth is not None and depth != 3 * sum(stages) + 2:
        raise ValueError(f"stages {list(stages)} give depth {3 * sum(stages) + 2}, not {depth}")
    depth = 3 * sum(stages) + 2
    g, x = image_graph(f"resnet{depth}", 3, image_size)
    x = conv_bn_relu(g, x, "conv1", 64, 7, 2, 3)
    x = g.add(MaxPool(kernel=3, stride=2, padding=1), [x], "maxpool")
    x = _stages(g, x, bottleneck, (64, 128, 256, 512), stages, (1, 2, 2, 2), zero_init_residual)
    return _head(g, x, classes)


def resnet2500(image_size=227, classes=1000):
    """SuperNeurons' ResNet2500: bottleneck stages of 6, 32, 788, 6 blocks (depth 2498).

    Every block starts as its shortcut (zero-initialised last BN scale): without it, the
    variances of 832 residual branches add up and the first updates diverge.
    """
    return resnet(stages=SUPERNEURONS_2500_STAGES, image_size=image_size, classes=classes, zero_init_residual=True)


BLOCKS = {"basic": (basic_block, 2), "bottleneck": (bottleneck, 3)}  # block, convs per block


def cifar_resnet(depth=None, n=None, block="basic", image_size=32, classes=10):
    """CIFAR ResNet: n blocks per stage, depth 6n + 2 (block="basic") or 9n + 2 ("bottleneck").

    Give `depth` or `n` (ResNet-20 when neither is given); both must agree when both are given.
    """
    if block not in BLOCKS:
        raise ValueError(f"block must be one of {sorted(BLOCKS)}, got {block!r}")
    block, per_block = BLOCKS[block]
    if n is None:
        n, rest = divmod((20 if depth is None else depth) - 2, 3 * per_block)
        if rest or n < 1:
            raise ValueError(f"CIFAR ResNet depth must be {3 * per_block}n + 2, got {depth}")
    if depth is not None and depth != 3 * per_block * n + 2:
        raise ValueError(f"n={n} gives depth {3 * per_block * n + 2}, not {depth}")
    depth = 3 * per_block * n + 2
    g, x = image_graph(f"cifar_resnet{depth}", 3, image_size)
    x = conv_bn_relu(g, x, "conv1", 16, 3, 1, 1)
    x = _stages(g, x, block, (16, 32, 64), (n, n, n), (1, 2, 2))
    return _head(g, x, classes)
