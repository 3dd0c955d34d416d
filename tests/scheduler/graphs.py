"""Generated graphs for planner property tests: chains, residual joins, concat branches, fan-out."""

from hypothesis import strategies as st

from snrt.graph import Graph
from snrt.layers.activation import ELU, GELU, Identity, ReLU, Sigmoid, SiLU, Softmax, Tanh
from snrt.layers.conv import Conv2d, ConvTranspose2d
from snrt.layers.dropout import Dropout, Dropout2d
from snrt.layers.input import Input
from snrt.layers.join import Add, Concat, Mul
from snrt.layers.linear import Linear, Reshape
from snrt.layers.loss import SoftmaxCrossEntropy
from snrt.layers.norm import BatchNorm, GroupNorm, LayerNorm
from snrt.layers.pool import AdaptiveAvgPool, GlobalAvgPool, MaxPool, Upsample

CHANNELS, SIZE, CLASSES = 3, 6, 4

OPS = ("conv", "conv1", "bn", "relu", "tanh", "pool", "dropout", "add", "concat", "silu", "gelu", "elu",
       "softmax", "identity", "mul", "gate", "dropout2d", "same5", "adaptive", "groupnorm", "layernorm",
       "upsample", "deconv", "bn_plain")
ELEMENTWISE = {"relu": ReLU, "tanh": Tanh, "silu": SiLU, "gelu": GELU, "elu": ELU, "softmax": Softmax,
               "identity": Identity}


@st.composite
def graph_recipes(draw, max_ops=12):
    """A list of (op, a, b): op applied to earlier nodes a (and b), by position."""
    n = draw(st.integers(1, max_ops))
    recipe = []
    for k in range(n):
        op = draw(st.sampled_from(OPS))
        a = draw(st.integers(0, k))
        b = draw(st.integers(0, k))
        recipe.append((op, a, b))
    return recipe


def build(recipe):
    """The Graph of `recipe`: every main-path node has shape (CHANNELS, SIZE, SIZE)."""
    g = Graph("generated")
    g.add(Input(shape=(CHANNELS, SIZE, SIZE)), name="data")
    g.add(Input(shape=(), dtype="int64"), name="label")
    nodes = [g.add(Conv2d(out_channels=CHANNELS, kernel=3, padding=1), inputs=["data"], name="stem")]
    for k, (op, a, b) in enumerate(recipe):
        x, y = nodes[a], nodes[b]
        name = f"n{k}"
        if op == "conv":
            nodes.append(g.add(Conv2d(out_channels=CHANNELS, kernel=3, padding=1, bias=False), inputs=[x], name=name))
        elif op == "conv1":
            nodes.append(g.add(Conv2d(out_channels=CHANNELS, kernel=1), inputs=[x], name=name))
        elif op == "bn":
            nodes.append(g.add(BatchNorm(), inputs=[x], name=name))
        elif op == "bn_plain":
            nodes.append(g.add(BatchNorm(affine=False), inputs=[x], name=name))
        elif op == "deconv":  # a strided conv down and a transposed conv back up
            down = g.add(Conv2d(out_channels=CHANNELS, kernel=3, stride=2, padding=1), inputs=[x], name=f"{name}_down")
            nodes.append(g.add(ConvTranspose2d(out_channels=CHANNELS, kernel=3, stride=2, padding=1, output_padding=1),
                               inputs=[down], name=name))
        elif op in ELEMENTWISE:
            nodes.append(g.add(ELEMENTWISE[op](), inputs=[x], name=name))
        elif op == "pool":
            nodes.append(g.add(MaxPool(kernel=3, stride=1, padding=1), inputs=[x], name=name))
        elif op == "dropout":
            nodes.append(g.add(Dropout(p=0.25), inputs=[x], name=name))
        elif op == "upsample":  # up (nearest or bilinear, by the other input's position) and back down
            mode = "bilinear" if b % 2 else "nearest"
            up = g.add(Upsample(scale=2, mode=mode), inputs=[x], name=f"{name}_up")
            nodes.append(g.add(AdaptiveAvgPool(output=SIZE), inputs=[up], name=name))
        elif op == "groupnorm":
            nodes.append(g.add(GroupNorm(groups=CHANNELS), inputs=[x], name=name))
        elif op == "layernorm":
            nodes.append(g.add(LayerNorm(), inputs=[x], name=name))
        elif op == "dropout2d":
            nodes.append(g.add(Dropout2d(p=0.25), inputs=[x], name=name))
        elif op == "same5":
            nodes.append(g.add(Conv2d(out_channels=CHANNELS, kernel=5, padding="same"), inputs=[x], name=name))
        elif op == "adaptive":  # pool to 4x4 and back to SIZE x SIZE through a flat reshape
            pooled = g.add(AdaptiveAvgPool(output=4), inputs=[x], name=f"{name}_pool")
            flat = g.add(Reshape(shape=[-1]), inputs=[pooled], name=f"{name}_flat")
            wide = g.add(Linear(out_features=CHANNELS * SIZE * SIZE), inputs=[flat], name=f"{name}_wide")
            nodes.append(g.add(Reshape(shape=[CHANNELS, SIZE, SIZE]), inputs=[wide], name=name))
        elif op == "add":
            nodes.append(g.add(Add(), inputs=[x, y], name=name))
        elif op == "mul":
            nodes.append(g.add(Mul(), inputs=[x, y], name=name))
        elif op == "gate":  # squeeze and excitation: x times sigmoid(a channel summary of y)
            squeeze = g.add(GlobalAvgPool(), inputs=[y], name=f"{name}_squeeze")
            excite = g.add(Sigmoid(), inputs=[squeeze], name=f"{name}_excite")
            nodes.append(g.add(Mul(), inputs=[x, excite], name=name))
        else:  # concat, then a 1x1 conv back to CHANNELS
            cat = g.add(Concat(), inputs=[x, y], name=f"{name}_cat")
            nodes.append(g.add(Conv2d(out_channels=CHANNELS, kernel=1), inputs=[cat], name=name))
    g.add(GlobalAvgPool(), inputs=[nodes[-1]], name="gap")
    g.add(Linear(out_features=CLASSES), name="fc")
    g.add(SoftmaxCrossEntropy(), inputs=["fc", "label"], name="loss")
    return g
