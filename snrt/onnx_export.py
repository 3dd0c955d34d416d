"""ONNX export: a network's inference graph with its weights (the `interop` extra), opset 17.

Each node becomes the ONNX operators that compute its eval-mode forward: Conv2d -> Conv,
BatchNorm -> BatchNormalization (running statistics), Linear -> Flatten + Gemm, GlobalAvgPool ->
GlobalAveragePool + Flatten, Dropout -> Identity, a loss layer -> Softmax of its logits (the
model's output, ``<node>.probs``), GELU, LayerNorm (over the channels) and GroupNorm composed of
elementary operators (opset 17 has none of them), Upsample -> Resize (nearest: floor of
i / scale; bilinear: PyTorch's half-pixel sampling), and the other layers of TRANSLATE. The graph's inputs are the
Input nodes a forward pass reads (not the labels), batch dimension named "batch". A layer
without a translation is an error naming the node and its type.
"""

import math

import numpy as np

from snrt.errors import SnrtError

OPSET = 17
IR_VERSION = 9  # what opset 17 needs; older than the onnx package's newest, so runtimes of 2023 on read it


class _Emitter:
    """The ONNX graph being built: `op` appends a node, `tensor` an initializer."""

    def __init__(self, helper, numpy_helper, graph):
        self.helper, self.numpy_helper, self.graph = helper, numpy_helper, graph
        self.nodes, self.initializers = [], []

    def rank(self, name):
        """The rank of node `name`'s output, batch included."""
        return 1 + len(self.graph[name].shape)

    def constant(self, value, tname):
        """An fp32 (or int64, for an int `value` list) initializer of `value`."""
        dtype = np.int64 if isinstance(value, list) and all(isinstance(v, int) for v in value) else np.float32
        return self.tensor(np.asarray(value, dtype), tname)

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
        raise SnrtError("ONNX export needs onnx: pip install 'snrt[interop]'") from None
    emit, inputs, outputs = _Emitter(helper, numpy_helper, graph), [], []
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
        if "alpha" in attrs:  # a float attribute, whatever number the file gave
            attrs["alpha"] = float(attrs["alpha"])
        return emit.op(kind, xs if kind in ("Sum", "Concat") else xs[:1], name, **attrs)
    return translate


def _gelu(layer, xs, params, name, emit):
    x = xs[0]
    if layer.approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = emit.op("Mul", [emit.op("Mul", [x, x], f"{name}.x2"), x], f"{name}.x3")
        inner = emit.op("Add", [x, emit.op("Mul", [cube, emit.constant(0.044715, f"{name}.k")], f"{name}.kx3")],
                        f"{name}.inner")
        phi = emit.op("Tanh", [emit.op("Mul", [inner, emit.constant(math.sqrt(2 / math.pi), f"{name}.c")],
                                       f"{name}.scaled")], f"{name}.tanh")
    else:  # 0.5 x (1 + erf(x / sqrt 2))
        phi = emit.op("Erf", [emit.op("Div", [x, emit.constant(math.sqrt(2), f"{name}.root2")], f"{name}.z")],
                      f"{name}.erf")
    one_plus = emit.op("Add", [phi, emit.constant(1.0, f"{name}.one")], f"{name}.1p")
    return emit.op("Mul", [emit.op("Mul", [x, one_plus], f"{name}.x1p"), emit.constant(0.5, f"{name}.half")], name)


def _per_channel(params, p, rank):
    """Parameter `p` (C,) as (C, 1, ...) against an (N, C, ...) tensor of `rank`."""
    return params[p].reshape(-1, *[1] * (rank - 2))


def _normalized(emit, x, axes, eps, name):
    """(x - mean) / sqrt(var + eps), the statistics over `axes` (kept)."""
    mean = emit.op("ReduceMean", [x], f"{name}.mean", axes=axes, keepdims=1)
    centered = emit.op("Sub", [x, mean], f"{name}.centered")
    var = emit.op("ReduceMean", [emit.op("Mul", [centered, centered], f"{name}.sq")], f"{name}.var", axes=axes,
                  keepdims=1)
    std = emit.op("Sqrt", [emit.op("Add", [var, emit.constant(float(eps), f"{name}.eps")], f"{name}.vareps")],
                  f"{name}.std")
    return emit.op("Div", [centered, std], f"{name}.xhat")


def _affine(layer, x, params, name, emit, rank):
    scaled = emit.op("Mul", [x, emit.tensor(_per_channel(params, "weight", rank), f"{name}.weight")], f"{name}.w")
    return emit.op("Add", [scaled, emit.tensor(_per_channel(params, "bias", rank), f"{name}.bias")], name)


def _layernorm(layer, xs, params, name, emit):  # over the channels at every position
    rank = emit.rank(xs[0])
    return _affine(layer, _normalized(emit, xs[0], [1], layer.eps, name), params, name, emit, rank)


def _groupnorm(layer, xs, params, name, emit):
    grouped = emit.op("Reshape", [xs[0], emit.constant([0, layer.groups, -1], f"{name}.groups")], f"{name}.grouped")
    xhat = _normalized(emit, grouped, [2], layer.eps, name)
    back = emit.op("Reshape", [xhat, emit.op("Shape", xs[:1], f"{name}.shape")], f"{name}.ungrouped")
    return _affine(layer, back, params, name, emit, emit.rank(xs[0]))


def _mul(layer, xs, params, name, emit):  # a gate that leaves out trailing dims is broadcast over them
    x, gate = xs
    missing = emit.rank(x) - emit.rank(gate)
    if missing:
        axes = emit.constant(list(range(emit.rank(gate), emit.rank(x))), f"{name}.axes")
        gate = emit.op("Unsqueeze", [gate, axes], f"{name}.gate")
    return emit.op("Mul", [x, gate], name)


def _scale(layer, xs, params, name, emit):
    return emit.op("Mul", [xs[0], emit.tensor(_per_channel(params, "weight", emit.rank(xs[0])), f"{name}.weight")],
                   name)


def _upsample(layer, xs, params, name, emit):
    scales = emit.constant([1.0, 1.0, float(layer.scale[0]), float(layer.scale[1])], f"{name}.scales")
    if layer.mode == "nearest":
        attrs = dict(mode="nearest", nearest_mode="floor", coordinate_transformation_mode="asymmetric")
    else:  # sampled at (i + 0.5) / scale - 0.5, clamped at 0: PyTorch's align_corners=False
        attrs = dict(mode="linear", coordinate_transformation_mode="pytorch_half_pixel")
    return emit.op("Resize", [xs[0], "", scales], name, **attrs)


def _adaptive_pool(layer, xs, params, name, emit):
    h, w = emit.graph[xs[0]].shape[1:]
    (oh, ow) = layer.output if isinstance(layer.output, tuple) else (layer.output, layer.output)
    if (oh, ow) == (1, 1):
        return emit.op("GlobalAveragePool", xs[:1], name)
    if h % oh or w % ow:
        raise SnrtError(f"node {name!r} (AdaptiveAvgPool): output {oh}x{ow} of {h}x{w} has bins of several sizes, "
                        "which ONNX's pooling cannot express")
    return emit.op("AveragePool", xs[:1], name, kernel_shape=[h // oh, w // ow], strides=[h // oh, w // ow])


def _conv_transpose(layer, xs, params, name, emit):
    return emit.op("ConvTranspose", [xs[0], *_weights(params, name, emit, ("weight", "bias"))], name,
                   kernel_shape=list(layer.kernel), strides=list(layer.stride), pads=_pads(layer.padding),
                   output_padding=list(layer.output_padding), dilations=list(layer.dilation), group=layer.groups)


def _lrn(layer, xs, params, name, emit):  # the same window and scaling as torch.nn.LocalResponseNorm
    return emit.op("LRN", xs[:1], name, size=int(layer.size), alpha=float(layer.alpha), beta=float(layer.beta),
                   bias=float(layer.k))


def _reshape(layer, xs, params, name, emit):
    return emit.op("Reshape", [xs[0], emit.constant([0, *layer.shape], f"{name}.shape")], name)


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
    "ELU": _simple("Elu", alpha="alpha"),
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
    "GELU": _gelu,
    "LayerNorm": _layernorm,
    "GroupNorm": _groupnorm,
    "Mul": _mul,
    "Scale": _scale,
    "Upsample": _upsample,
    "AdaptiveAvgPool": _adaptive_pool,
    "ConvTranspose2d": _conv_transpose,
    "LRN": _lrn,
    "Reshape": _reshape,
}
