"""The model zoo: Python builders returning `snrt.graph.Graph`s; configs/ holds the same nets in YAML.

Every graph reads the inputs "data" (C, H, W) and "label" (one int64 per sample) and ends in
Linear(classes) (node "fc", the logits) and SoftmaxCrossEntropy(fc, label) (node "loss").
`MODELS` maps a name (the configs/ file name) to a builder taking keyword arguments
(`image_size`, `classes`, and the family's own).
"""

from functools import partial

from snrt.models.alexnet import alexnet
from snrt.models.densenet import densenet
from snrt.models.inception import inception_v4
from snrt.models.lenet import lenet
from snrt.models.resnet import cifar_resnet, resnet, resnet2500
from snrt.models.vgg import vgg

MODELS = {
    "alexnet": alexnet,
    "vgg16": partial(vgg, depth=16),
    "vgg19": partial(vgg, depth=19),
    "resnet50": partial(resnet, depth=50),
    "resnet101": partial(resnet, depth=101),
    "resnet152": partial(resnet, depth=152),
    "resnet2500": resnet2500,
    "cifar_resnet20": partial(cifar_resnet, depth=20),
    "cifar_resnet56": partial(cifar_resnet, depth=56),
    "cifar_resnet110": partial(cifar_resnet, depth=110),
    "cifar_resnet164": partial(cifar_resnet, depth=164, block="bottleneck"),
    "inceptionv4": inception_v4,
    "densenet121": densenet,
    "lenet": lenet,
}

__all__ = [
    "MODELS",
    "alexnet",
    "cifar_resnet",
    "densenet",
    "inception_v4",
    "lenet",
    "resnet",
    "resnet2500",
    "vgg",
]
