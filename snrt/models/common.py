"""Pieces every model family shares: the two graph inputs, conv units and the loss head."""

from snrt.graph import Graph
from snrt.layers.activation import ReLU
from snrt.layers.conv import Conv2d
from snrt.layers.dropout import Dropout
from snrt.layers.input import Input
from snrt.layers.linear import Linear
from snrt.layers.loss import SoftmaxCrossEntropy
from snrt.layers.norm import BatchNorm


def image_graph(name, channels, image_size):
    """A Graph holding the inputs "data" (channels, image_size, image_size) and "label".

    Returns (graph, "data"); the first layer must name "data" as its input, because the
    default input of `add` would be the label node.
    """
    g = Graph(name)
    g.add(Input(shape=(channels, image_size, image_size)), name="data")
    g.add(Input(shape=(), dtype="int64"), name="label")
    return g, "data"


def conv_bn_relu(g, x, name, out_channels, kernel, stride=1, padding=0, eps=1e-5, relu=True, zero_init=False):
    """Conv2d (no bias: BatchNorm's shift replaces it), BatchNorm, then ReLU unless relu=False.

    `zero_init` starts the BatchNorm scale at 0 (the last unit of a residual branch).
    Returns the name of the last node; nodes are named `<name>.conv`, `.bn`, `.relu`.
    """
    y = g.add(Conv2d(out_channels, kernel, stride, padding, bias=False), [x], f"{name}.conv")
    y = g.add(BatchNorm(eps=eps, zero_init=zero_init), [y], f"{name}.bn")
    return g.add(ReLU(), [y], f"{name}.relu") if relu else y


def bn_relu_conv(g, x, name, out_channels, kernel, padding=0):
    """Pre-activation unit: BatchNorm, ReLU, then a bias-free stride-1 Conv2d (DenseNet)."""
    y = g.add(BatchNorm(), [x], f"{name}.bn")
    y = g.add(ReLU(), [y], f"{name}.relu")
    return g.add(Conv2d(out_channels, kernel, padding=padding, bias=False), [y], f"{name}.conv")


def conv_relu(g, x, name, out_channels, kernel, stride=1, padding=0, groups=1):
    """Conv2d with bias followed by ReLU (the BatchNorm-free nets: AlexNet, VGG)."""
    y = g.add(Conv2d(out_channels, kernel, stride, padding, groups=groups), [x], f"{name}.conv")
    return g.add(ReLU(), [y], f"{name}.relu")


def classifier_head(g, x, classes):
    """Linear(classes) on `x` ("fc", the logits), then SoftmaxCrossEntropy with "label"."""
    logits = g.add(Linear(out_features=classes), [x], "fc")
    g.add(SoftmaxCrossEntropy(), [logits, "label"], "loss")
    return g


def dropout_mlp(g, x, name, widths, p=0.5):
    """Linear, ReLU, Dropout(p) for every width in `widths` (the AlexNet / VGG classifier body)."""
    for i, width in enumerate(widths):
        x = g.add(Linear(out_features=width), [x], f"{name}{i}")
        x = g.add(ReLU(), [x], f"{name}{i}.relu")
        x = g.add(Dropout(p=p), [x], f"{name}{i}.drop")
    return x
