"""ONNX export: a network's inference graph with its weights (the `onnx` extra), opset 17.

Each node becomes the ONNX operators that compute its eval-mode forward: Conv2d -> Conv,
BatchNorm -> BatchNormalization (running statistics), Linear -> Flatten + Gemm, GlobalAvgPool ->
GlobalAveragePool + Flatten, Dropout -> Identity, a loss layer -> Softmax of its logits (the
model's output, ``<node>.probs``), and the other layers of TRANSLATE. The graph's inputs are the
Input nodes a forward pass reads (not the labels), batch dimension named "batch". A layer
without a translation is an error naming the node and its type.
"""

import numpy as np

from snrt.errors import SnrtError

OPSET = 17
IR_VERSION = 9  # what opset 17 needs; older than the onnx package's newest, so runtimes of 2023 on read it


class _Emitter:
    """The ONNX graph being built: `op` appends a node, `tensor` an initializer."""

    def __init__(self, helper, numpy_helper):
        self.helper, self.numpy_helper = helper, numpy_helper
        self.nodes, self.initializers = [], []

    def op(self, kind, inputs, out, **attrs):
        self.nodes.append(self.helper.make_node(kind, inputs, [out], name=out, **attrs))
        return out

    def tensor(self, value, tname):
        self.initializers.append(self.numpy_helper.from_array(value, tname))
        return tname


def to_onnx(graph, weights, name=None):
    """The onnx.ModelProto of `graph` with `weights` ({(node, name): array}: parameters and
    BatchNorm statistics)."""
    try:
        import onnx
        from onnx import TensorProto, helper, numpy_helper
    except ImportError:
        raise SnrtError("ONNX export needs onnx: pip install 'snrt[onnx]'") from None
    emit, inputs, outputs = _Emitter(helper, numpy_helper), [], []
    labels = {i for n in graph.nodes.values() if n.layer.type_name == "SoftmaxCrossEntropy" for i in n.inputs[1:]}
    for node in graph.nodes.values():
        layer, kind = node.layer, node.layer.type_name
        if not node.inputs:
            if node.name not in labels:
                inputs.append(helper.make_tensor_value_info(node.name, TensorProto.FLOAT, ["batch", *node.shape]))
            continue
        if kind not in TRANSLATE:
            raise SnrtError(f"node {node.name!r} ({kind}): no ONNX translation; exportable layers: "
                            f"{', '.join(sorted(TRANSLATE))}")
        shapes = graph.in_shapes(node.name, 1)
        params = {p: weights[(node.name, p)] for p in (*layer.param_specs(shapes), *layer.state_specs(shapes))}
        out = TRANSLATE[kind](layer, list(node.inputs), params, node.name, emit)
        if kind == "SoftmaxCrossEntropy":  # the probabilities of its logits
            outputs.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, ["batch", *graph[node.inputs[0]].shape]))
    if not outputs:  # no loss: the nodes nothing reads
        read = {i for n in graph.nodes.values() for i in n.inputs}
        outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", *graph[n].shape])
                   for n in graph.nodes if n not in read]
    model = helper.make_model(helper.make_graph(emit.nodes, name or graph.name, inputs, outputs, emit.initializers),
                              opset_imports=[helper.make_opsetid("", OPSET)], producer_name="snrt",
                              ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def _weights(params, name, emit, order):
    """The initializer names of `params` ({name: array}) in `order`, those present."""
    return [emit.tensor(params[p], f"{name}.{p}") for p in order if p in params]


def _pads(padding):
    return [padding[0], padding[1], padding[0], padding[1]]


def _conv(layer, xs, params, name, emit):
    return emit.op("Conv", [xs[0], *_weights(params, name, emit, ("weight", "bias"))], name,
                   kernel_shape=list(layer.kernel), strides=list(layer.stride), pads=_pads(layer.padding),
                   dilations=list(layer.dilation), group=layer.groups)


def _batchnorm(layer, xs, params, name, emit):
    channels = params["running_mean"].shape
    if "weight" not in params:  # affine: false: the statistics alone
        params = dict(params, weight=np.ones(channels, np.float32), bias=np.zeros(channels, np.float32))
    return emit.op("BatchNormalization",
                   [xs[0], *_weights(params, name, emit, ("weight", "bias", "running_mean", "running_var"))], name,
                   epsilon=float(layer.eps))


def _pool(kind):
    def translate(layer, xs, params, name, emit):
        attrs = dict(kernel_shape=list(layer.kernel), strides=list(layer.stride), pads=_pads(layer.padding),
                     ceil_mode=int(layer.ceil_mode))
        if kind == "AveragePool":
            attrs["count_include_pad"] = int(layer.count_include_pad)
        return emit.op(kind, xs[:1], name, **attrs)
    return translate


def _linear(layer, xs, params, name, emit):
    flat = emit.op("Flatten", xs[:1], f"{name}.flat", axis=1)
    return emit.op("Gemm", [flat, *_weights(params, name, emit, ("weight", "bias"))], name, transB=1)


def _global_pool(layer, xs, params, name, emit):
    return emit.op("Flatten", [emit.op("GlobalAveragePool", xs[:1], f"{name}.pooled")], name, axis=1)


def _relu6(layer, xs, params, name, emit):
    low, high = emit.tensor(np.float32(0), f"{name}.low"), emit.tensor(np.float32(6), f"{name}.high")
    return emit.op("Clip", [xs[0], low, high], name)


def _silu(layer, xs, params, name, emit):
    return emit.op("Mul", [xs[0], emit.op("Sigmoid", xs[:1], f"{name}.gate")], name)


def _simple(kind, **attributes):
    """A one-operator translation; `attributes` values that are strings name the layer's option."""
    def translate(layer, xs, params, name, emit):
        attrs = {k: (getattr(layer, v) if isinstance(v, str) else v) for k, v in attributes.items()}
        return emit.op(kind, xs if kind in ("Sum", "Concat") else xs[:1], name, **attrs)
    return translate


def _loss(layer, xs, params, name, emit):
    return emit.op("Softmax", xs[:1], f"{name}.probs", axis=1)


TRANSLATE = {
    "Conv2d": _conv,
    "BatchNorm": _batchnorm,
    "Linear": _linear,
    "MaxPool": _pool("MaxPool"),
    "AvgPool": _pool("AveragePool"),
    "GlobalAvgPool": _global_pool,
    "Flatten": _simple("Flatten", axis=1),
    "ReLU": _simple("Relu"),
    "ReLU6": _relu6,
    "LeakyReLU": _simple("LeakyRelu", alpha="slope"),
    "Sigmoid": _simple("Sigmoid"),
    "Tanh": _simple("Tanh"),
    "SiLU": _silu,
    "Identity": _simple("Identity"),
    "Dropout": _simple("Identity"),
    "Dropout2d": _simple("Identity"),
    "Add": _simple("Sum"),
    "Concat": _simple("Concat", axis="axis"),
    "Softmax": _simple("Softmax", axis="axis"),
    "SoftmaxCrossEntropy": _loss,
}
