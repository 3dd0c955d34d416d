"""AlexNet (Krizhevsky, Sutskever and Hinton, NIPS 2012) as in Caffe's bvlc_alexnet.

227x227 input; conv11x11/4 96, ReLU, LRN, maxpool 3/2; conv5x5 256 pad 2, ReLU, LRN, maxpool;
conv3x3 384, 384, 256 (pad 1, ReLU), maxpool; FC 4096, ReLU, Dropout, FC 4096, ReLU, Dropout,
FC classes. The paper's two-GPU split survives as `groups=2` on conv2, conv4 and conv5 (one
graph, no towers): 60,965,224 parameters for 1000 classes. `groups=1` gives the ungrouped
variant, 62,378,344 parameters.
"""

from snrt.layers.norm import LRN
from snrt.layers.pool import MaxPool
from snrt.models.common import classifier_head, conv_relu, dropout_mlp, image_graph


def alexnet(image_size=227, classes=1000, groups=2):
    """AlexNet with LRN and Dropout; `groups` is the split of conv2, conv4 and conv5."""
    g, x = image_graph("alexnet", 3, image_size)
    x = conv_relu(g, x, "conv1", 96, 11, stride=4)
    x = g.add(LRN(), [x], "norm1")
    x = g.add(MaxPool(kernel=3, stride=2), [x], "pool1")
    x = conv_relu(g, x, "conv2", 256, 5, padding=2, groups=groups)
    x = g.add(LRN(), [x], "norm2")
    x = g.add(MaxPool(kernel=3, stride=2), [x], "pool2")
    x = conv_relu(g, x, "conv3", 384, 3, padding=1)
    x = conv_relu(g, x, "conv4", 384, 3, padding=1, groups=groups)
    x = conv_relu(g, x, "conv5", 256, 3, padding=1, groups=groups)
    x = g.add(MaxPool(kernel=3, stride=2), [x], "pool5")
    x = dropout_mlp(g, x, "fc", (4096, 4096))
    return classifier_head(g, x, classes)
