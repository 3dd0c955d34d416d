"""Inception-v4 (Szegedy, Ioffe, Vanhoucke and Alemi, "Inception-v4, Inception-ResNet and the
Impact of Residual Connections on Learning", AAAI 2017), in the timm / Cadene layout.

Every conv unit is Conv2d(bias=False), BatchNorm(eps=0.001), ReLU. 299x299 input: stem (three
convs, Mixed-3a, -4a, -5a) to 384x35x35, 4 x Inception-A, Reduction-A (k=192, l=224, m=256,
n=384) to 1024x17x17, 7 x Inception-B, Reduction-B to 1536x8x8, 3 x Inception-C, global
average pooling, Dropout(0.2) (keep 0.8, as in the paper), FC 1536 -> classes:
42,679,816 parameters for 1000 classes.

Each mixed block is a table of branches, all reading the block input and concatenated in
order. A branch is a chain of ops: a conv unit (out_channels, kernel, stride, padding), MAX
(maxpool 3/2) or AVG (avgpool 3/1 pad 1, padding not counted); a list of units as the last op
forks the chain into several outputs (Inception-C), concatenated in place.
"""

from snrt.layers.dropout import Dropout
from snrt.layers.join import Concat
from snrt.layers.pool import AvgPool, GlobalAvgPool, MaxPool
from snrt.models.common import classifier_head, conv_bn_relu, image_graph

MAX, AVG = "max", "avg"


def _1x(n, out):
    """A 1 x n conv unit with 'same' padding."""
    return (out, (1, n), 1, (0, n // 2))


def _x1(n, out):
    """An n x 1 conv unit with 'same' padding."""
    return (out, (n, 1), 1, (n // 2, 0))


STEM = [(32, 3, 2), (32, 3), (64, 3, 1, 1)]
MIXED_3A = [[MAX], [(96, 3, 2)]]
MIXED_4A = [[(64, 1), (96, 3)], [(64, 1), _1x(7, 64), _x1(7, 64), (96, 3)]]
MIXED_5A = [[(192, 3, 2)], [MAX]]
INCEPTION_A = [
    [(96, 1)],
    [(64, 1), (96, 3, 1, 1)],
    [(64, 1), (96, 3, 1, 1), (96, 3, 1, 1)],
    [AVG, (96, 1)],
]
REDUCTION_A = [[(384, 3, 2)], [(192, 1), (224, 3, 1, 1), (256, 3, 2)], [MAX]]  # n, k-l-m, pool
INCEPTION_B = [
    [(384, 1)],
    [(192, 1), _1x(7, 224), _x1(7, 256)],
    [(192, 1), _x1(7, 192), _1x(7, 224), _x1(7, 224), _1x(7, 256)],
    [AVG, (128, 1)],
]
REDUCTION_B = [[(192, 1), (192, 3, 2)], [(256, 1), _1x(7, 256), _x1(7, 320), (320, 3, 2)], [MAX]]
INCEPTION_C = [
    [(256, 1)],
    [(384, 1), [_1x(3, 256), _x1(3, 256)]],
    [(384, 1), _x1(3, 448), _1x(3, 512), [_1x(3, 256), _x1(3, 256)]],
    [AVG, (256, 1)],
]


def _unit(g, x, name, out_channels, kernel, stride=1, padding=0):
    return conv_bn_relu(g, x, name, out_channels, kernel, stride, padding, eps=1e-3)


def _branch(g, x, name, ops):
    """Apply the chain `ops` to `x`; returns the list of its outputs (several after a fork)."""
    for i, op in enumerate(ops):
        if op == MAX:
            x = g.add(MaxPool(kernel=3, stride=2), [x], f"{name}.{i}.maxpool")
        elif op == AVG:
            pool = AvgPool(kernel=3, stride=1, padding=1, count_include_pad=False)
            x = g.add(pool, [x], f"{name}.{i}.avgpool")
        elif isinstance(op, list):
            return [_unit(g, x, f"{name}.{i}{'abcd'[j]}", *unit) for j, unit in enumerate(op)]
        else:
            x = _unit(g, x, f"{name}.{i}", *op)
    return [x]


def mixed(g, x, name, branches):
    """Run every branch of the table on `x` and concatenate their outputs along channels."""
    outs = [y for b, ops in enumerate(branches) for y in _branch(g, x, f"{name}.b{b}", ops)]
    return g.add(Concat(), outs, f"{name}.concat")


def inception_v4(image_size=299, classes=1000, dropout=0.2):
    """Inception-v4 with its classifier (no auxiliary head)."""
    g, x = image_graph("inceptionv4", 3, image_size)
    (x,) = _branch(g, x, "stem", STEM)
    x = mixed(g, x, "mixed3a", MIXED_3A)
    x = mixed(g, x, "mixed4a", MIXED_4A)
    x = mixed(g, x, "mixed5a", MIXED_5A)
    for name, table, count in (
        ("inception_a", INCEPTION_A, 4),
        ("reduction_a", REDUCTION_A, 1),
        ("inception_b", INCEPTION_B, 7),
        ("reduction_b", REDUCTION_B, 1),
        ("inception_c", INCEPTION_C, 3),
    ):
        for i in range(count):
            x = mixed(g, x, f"{name}.{i}", table)
    x = g.add(GlobalAvgPool(), [x], "pool")
    x = g.add(Dropout(p=dropout), [x], "dropout")
    return classifier_head(g, x, classes)
