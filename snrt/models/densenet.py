"""DenseNet-BC (Huang, Liu, van der Maaten and Weinberger, "Densely Connected Convolutional
Networks", CVPR 2017), torchvision layout.

Stem: conv7x7/2 64 (no bias), BN, ReLU, maxpool 3/2 pad 1. Dense layer: BN, ReLU, conv1x1
(bn_size * growth), BN, ReLU, conv3x3 pad 1 (growth), concatenated after its input. Transition
between blocks: BN, ReLU, conv1x1 to `compression` x the channels, avgpool 2/2. Then BN, ReLU,
global average pooling and the classifier. DenseNet-121 (growth 32, blocks 6-12-24-16,
bn_size 4, compression 0.5) has 7,978,856 parameters for 1000 classes.
"""

from snrt.layers.activation import ReLU
from snrt.layers.join import Concat
from snrt.layers.norm import BatchNorm
from snrt.layers.pool import AvgPool, GlobalAvgPool, MaxPool
from snrt.models.common import bn_relu_conv, classifier_head, conv_bn_relu, image_graph


def dense_layer(g, x, name, growth, bn_size):
    """BN-ReLU-conv1x1(bn_size*growth)-BN-ReLU-conv3x3(growth); returns concat [x, new]."""
    y = bn_relu_conv(g, x, f"{name}.1", bn_size * growth, 1)
    y = bn_relu_conv(g, y, f"{name}.2", growth, 3, padding=1)
    return g.add(Concat(), [x, y], f"{name}.concat")


def transition(g, x, name, out_channels):
    """BN-ReLU-conv1x1(out_channels), then avgpool 2/2."""
    y = bn_relu_conv(g, x, name, out_channels, 1)
    return g.add(AvgPool(kernel=2, stride=2), [y], f"{name}.pool")


def densenet(blocks=(6, 12, 24, 16), growth=32, bn_size=4, compression=0.5, stem=64,
             image_size=224, classes=1000):
    """DenseNet-BC; the defaults are DenseNet-121 (depth 2 * sum(blocks) + 5)."""
    g, x = image_graph(f"densenet{2 * sum(blocks) + 5}", 3, image_size)
    x = conv_bn_relu(g, x, "conv0", stem, 7, 2, 3)
    x = g.add(MaxPool(kernel=3, stride=2, padding=1), [x], "pool0")
    for b, count in enumerate(blocks, start=1):
        for i in range(count):
            x = dense_layer(g, x, f"block{b}.{i}", growth, bn_size)
        if b < len(blocks):
            x = transition(g, x, f"transition{b}", int(g[x].shape[0] * compression))
    x = g.add(BatchNorm(), [x], "norm5")
    x = g.add(ReLU(), [x], "relu5")
    x = g.add(GlobalAvgPool(), [x], "pool5")
    return classifier_head(g, x, classes)
