"""A LeNet-style small CNN (after LeCun et al., 1998) for 8x8 grey digit images (scikit-learn's
`load_digits`): conv3x3 16 pad 1, BN, ReLU, maxpool 2/2, conv3x3 32 pad 1, BN, ReLU, global
average pooling, Linear classes. About 5.8k parameters; trains in seconds on the CPU.
"""

from snrt.layers.pool import GlobalAvgPool, MaxPool
from snrt.models.common import classifier_head, conv_bn_relu, image_graph


def lenet(image_size=8, classes=10, channels=1):
    """The small digits CNN above."""
    g, x = image_graph("lenet", channels, image_size)
    x = conv_bn_relu(g, x, "conv1", 16, 3, 1, 1)
    x = g.add(MaxPool(kernel=2, stride=2), [x], "pool1")
    x = conv_bn_relu(g, x, "conv2", 32, 3, 1, 1)
    x = g.add(GlobalAvgPool(), [x], "pool2")
    return classifier_head(g, x, classes)
