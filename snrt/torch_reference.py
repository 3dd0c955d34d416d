"""An independent PyTorch interpreter for snrt graphs: the oracle of tests and benchmarks.

Imports torch (the test and bench extras); nothing in the training path imports this module.

`TorchNet(graph, params, state)` evaluates the same graph with torch.nn.functional ops and
torch-owned parameters, so a whole training run can be compared with PyTorch's autograd and
torch.optim.SGD.

`torchvision()` imports torchvision (its models and transforms), on PyTorch's CPU build too.
"""

import sys
import types

import torch
import torch.nn.functional as F

from snrt.optim import make_optimizer


def torchvision():
    """The torchvision package. PyTorch's CPU build cannot load the compiled operators of
    torchvision's PyPI wheel (detection ops such as nms, which no classifier or transform
    uses); then its pure-Python models and transforms are imported without registering them."""
    try:
        import torchvision
    except RuntimeError:  # "operator torchvision::nms does not exist"
        for name in [m for m in sys.modules if m.split(".")[0] == "torchvision"]:
            del sys.modules[name]
        sys.modules["torchvision._meta_registrations"] = types.ModuleType("torchvision._meta_registrations")
        import torchvision
    return torchvision


def _pool_args(layer):
    return dict(kernel_size=layer.kernel, stride=layer.stride, padding=layer.padding, ceil_mode=layer.ceil_mode)


def _batch_norm(layer, x, p, s, training):
    return F.batch_norm(x, s["running_mean"], s["running_var"], p.get("weight"), p.get("bias"), training,
                        layer.momentum, layer.eps)


def _channel_layer_norm(x, p, eps):
    """LayerNorm over axis 1 (channels first), through torch's over the last axis."""
    last = x.movedim(1, -1)
    return F.layer_norm(last, last.shape[-1:], p["weight"], p["bias"], eps).movedim(-1, 1)


OPS = {
    "Conv2d": lambda l, xs, p, s, t: F.conv2d(xs[0], p["weight"], p.get("bias"), l.stride, l.padding, l.dilation, l.groups),
    "ConvTranspose2d": lambda l, xs, p, s, t: F.conv_transpose2d(xs[0], p["weight"], p.get("bias"), l.stride, l.padding,
                                                                 l.output_padding, l.groups, l.dilation),
    "BatchNorm": lambda l, xs, p, s, t: _batch_norm(l, xs[0], p, s, t),
    "ReLU": lambda l, xs, p, s, t: F.relu(xs[0]),
    "ReLU6": lambda l, xs, p, s, t: F.relu6(xs[0]),
    "LeakyReLU": lambda l, xs, p, s, t: F.leaky_relu(xs[0], l.slope),
    "Sigmoid": lambda l, xs, p, s, t: torch.sigmoid(xs[0]),
    "Tanh": lambda l, xs, p, s, t: torch.tanh(xs[0]),
    "SiLU": lambda l, xs, p, s, t: F.silu(xs[0]),
    "ELU": lambda l, xs, p, s, t: F.elu(xs[0], l.alpha),
    "GELU": lambda l, xs, p, s, t: F.gelu(xs[0], approximate=l.approximate),
    "Identity": lambda l, xs, p, s, t: xs[0],
    "Softmax": lambda l, xs, p, s, t: torch.softmax(xs[0], dim=l.axis),
    "Reshape": lambda l, xs, p, s, t: xs[0].reshape(xs[0].shape[0], *l.shape),
    "AdaptiveAvgPool": lambda l, xs, p, s, t: F.adaptive_avg_pool2d(xs[0], l.output),
    "GroupNorm": lambda l, xs, p, s, t: F.group_norm(xs[0], l.groups, p["weight"], p["bias"], l.eps),
    "LayerNorm": lambda l, xs, p, s, t: _channel_layer_norm(xs[0], p, l.eps),
    "Upsample": lambda l, xs, p, s, t: F.interpolate(xs[0], scale_factor=l.scale, mode=l.mode,
                                                     **({"align_corners": False} if l.mode == "bilinear" else {})),
    "Scale": lambda l, xs, p, s, t: xs[0] * p["weight"].reshape(1, -1, *([1] * (xs[0].dim() - 2))),
    "Mul": lambda l, xs, p, s, t: xs[0] * xs[1].reshape(xs[1].shape + (1,) * (xs[0].dim() - xs[1].dim())),
    "MaxPool": lambda l, xs, p, s, t: F.max_pool2d(xs[0], **_pool_args(l)),
    "AvgPool": lambda l, xs, p, s, t: F.avg_pool2d(xs[0], count_include_pad=l.count_include_pad, **_pool_args(l)),
    "GlobalAvgPool": lambda l, xs, p, s, t: xs[0].mean(dim=(2, 3)),
    "Linear": lambda l, xs, p, s, t: F.linear(xs[0].flatten(1), p["weight"], p.get("bias")),
    "Flatten": lambda l, xs, p, s, t: xs[0].flatten(1),
    "Add": lambda l, xs, p, s, t: sum(xs[1:], xs[0]),
    "Concat": lambda l, xs, p, s, t: torch.cat(xs, dim=l.axis),
    "LRN": lambda l, xs, p, s, t: F.local_response_norm(xs[0], l.size, l.alpha, l.beta, l.k),
    "SoftmaxCrossEntropy": lambda l, xs, p, s, t: F.cross_entropy(xs[0], xs[1], reduction="none").reshape(
        len(xs[0]), -1).mean(dim=1),
}


class TorchNet(torch.nn.Module):
    """The graph as a torch module; parameters named "node:param", state as buffers.

    Dropout in training draws other masks than snrt's, so it raises unless `torch_dropout`
    (for benchmarks that time rather than compare): then torch's own dropout runs."""

    def __init__(self, graph, params, state, torch_dropout=False):
        super().__init__()
        self.graph, self.torch_dropout = graph, torch_dropout
        self.params = torch.nn.ParameterDict(
            {f"{n}:{k}".replace(".", "/"): torch.nn.Parameter(torch.tensor(v)) for (n, k), v in params.items()})
        self.state = {(n, k): torch.tensor(v) for (n, k), v in state.items()}

    def forward(self, feed):
        """Per-sample losses (the weighted sum over the loss nodes), given {"data": x, "label": y}."""
        values, total = {}, 0
        for node in self.graph.nodes.values():
            if node.layer.type_name == "Input":
                values[node.name] = torch.as_tensor(feed[node.name])
                continue
            layer = node.layer
            if layer.type_name in ("Dropout", "Dropout2d") and self.training:
                if not self.torch_dropout:
                    raise NotImplementedError("dropout masks differ from torch's; compare without Dropout")
                drop = F.dropout if layer.type_name == "Dropout" else F.dropout2d
                values[node.name] = drop(values[node.inputs[0]], layer.p, training=True)
                continue
            p = {k: self.params[f"{node.name}:{k}".replace(".", "/")] for k in layer.param_specs(
                self.graph.in_shapes(node.name, 1))}
            s = {k: v for (n, k), v in self.state.items() if n == node.name}
            values[node.name] = OPS[layer.type_name](layer, [values[i] for i in node.inputs], p, s, self.training)
            if layer.type_name == "SoftmaxCrossEntropy":
                total = total + layer.weight * values[node.name]
        return total

    def param(self, node, name):
        return self.params[f"{node}:{name}".replace(".", "/")]


def torch_sgd(net, graph, optimizer):
    """The torch.optim optimizer over `net`'s parameters with snrt's semantics of `optimizer` (a
    config's train.optimizer: SGD, Adam or AdamW): one torch parameter group per (weight decay,
    learning rate) that snrt's parameter groups give (by default no decay for the parameters
    whose spec says so: biases and norm scales)."""
    settings = make_optimizer(optimizer).settings
    by_setting = {}
    for node, specs in graph.param_specs().items():
        for name, spec in specs.items():
            by_setting.setdefault(settings(f"{node}:{name}", spec.decay), []).append(net.param(node, name))
    groups = [{"params": params, "weight_decay": decay, "lr": optimizer.lr * scale}
              for (decay, scale), params in by_setting.items()]
    if optimizer.type == "sgd":
        return torch.optim.SGD(groups, lr=optimizer.lr, momentum=optimizer.momentum, nesterov=optimizer.nesterov)
    adam = torch.optim.Adam if optimizer.type == "adam" else torch.optim.AdamW
    return adam(groups, lr=optimizer.lr, betas=(optimizer.beta1, optimizer.beta2), eps=optimizer.eps)
