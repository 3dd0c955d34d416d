"""VGG (Simonyan and Zisserman, ICLR 2015), configurations D (VGG-16) and E (VGG-19).

torchvision layout without BatchNorm: 3x3 convs (pad 1, with bias, ReLU) in five stages of
64, 128, 256, 512, 512 channels, each closed by maxpool 2/2; FC 4096, ReLU, Dropout, FC 4096,
ReLU, Dropout, FC classes. 224x224 input: 138,357,544 (VGG-16) and 143,667,240 (VGG-19)
parameters for 1000 classes.
"""

from snrt.layers.pool import MaxPool
from snrt.models.common import classifier_head, conv_relu, dropout_mlp, image_graph

WIDTHS = (64, 128, 256, 512, 512)
STAGES = {11: (1, 1, 2, 2, 2), 13: (2, 2, 2, 2, 2), 16: (2, 2, 3, 3, 3), 19: (2, 2, 4, 4, 4)}


def vgg(depth=16, image_size=224, classes=1000):
    """VGG-`depth` (11, 13, 16 or 19 weight layers)."""
    if depth not in STAGES:
        raise ValueError(f"VGG depth must be one of {sorted(STAGES)}, got {depth}")
    g, x = image_graph(f"vgg{depth}", 3, image_size)
    for stage, (width, count) in enumerate(zip(WIDTHS, STAGES[depth]), start=1):
        for i in range(count):
            x = conv_relu(g, x, f"conv{stage}_{i + 1}", width, 3, padding=1)
        x = g.add(MaxPool(kernel=2, stride=2), [x], f"pool{stage}")
    x = dropout_mlp(g, x, "fc", (4096, 4096))
    return classifier_head(g, x, classes)
