"""Time the layer families of the zoo, as the CPU backend runs them, next to PyTorch.

Not a test. For each (layer, input shape): forward and backward of the kernel the CPU backend
runs for it (`NumpyBackend.kernel_choice().kernel_for(layer, in_shapes)`: the layer's own
NumPy code, or a compiled kernel from snrt/backends/cpu_kernels.py), with its buffers and
planned workspace allocated once, against PyTorch's (forward under no_grad; backward =
`torch.autograd.grad` of the output with respect to every input and parameter, each gradient
made contiguous: snrt writes every gradient into a buffer of its own, the form the next
layer's backward reads, where autograd may hand back a view that the next layer's kernel
copies before reading it (Concat's gradients are slices of gy); for a contiguous gradient
that is a no-op), both with
as many threads as cores (`--threads`). PyTorch runs each layer of images (4-D input) twice:
in NCHW and in channels-last (its 4-D inputs, parameters and output gradient converted to
torch.channels_last beforehand, as a model and batch moved to that format give them; its 4-D
gradients made contiguous in that format), and the tables give snrt's speed against both and
against the faster of the two. Timing as in bench_conv.py (one warm-up, then `--repeats` rounds,
best time kept, median in the JSON, each framework in a phase of its own), but kernels run
back to back as in training: no wait for idle CPUs before a round by default (after an idle
pause every call starts with parked threads and cold caches, which inflates small kernels
several times). Shapes: CIFAR ResNet layers at batch 32, ResNet-50 layers at batch 8, and the
newer layers as MobileNetV2, SE-ResNet-50, ConvNeXt-T (batch 8, 224x224 input) and U-Net
(batch 4, 256x256) use them, and the deep small maps of EfficientNet-B0 and ConvNeXt-T at
64x64. PyTorch's side is snrt.torch_reference's function of each layer. The convolutions'
kernel choices (snrt/backends/cpu_choice.py) are made first, before PyTorch runs, and snrt is
imported before numpy and torch, as the `snrt` command does: OpenBLAS's threads would
otherwise spin for about 0.1 s after each call of im2col's GEMMs, taking the cores from the
direct kernel's threads while the chooser times it (a 64@56 b8 forward measured 17 ms against
11 that way).
Writes results/bench_layers.{json,md}. `--threads 1` times both frameworks on one thread: on
this shared 2-core machine two-thread times swing up to 2x with the other tenant, one-thread
times repeat to about 2% (results/bench_layers_1thread.{json,md}).

    python scripts/bench_layers.py [--repeats 7] [--out results/bench_layers] [--only TEXT ...]
    python scripts/bench_layers.py --threads 1 --out results/bench_layers_1thread
"""

import os

CORES = os.cpu_count() or 1
DEFAULT_OUT = "results/bench_layers"
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, str(CORES))  # before numpy loads its BLAS

import snrt  # noqa: E402, F401  (before numpy and torch: it shortens OpenBLAS's spin, results/blas_timeout.md)
import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_conv import time_rounds  # noqa: E402
from reproduce_common import machine, table  # noqa: E402

from snrt.backends.numpy_backend import NumpyBackend  # noqa: E402
from snrt.layers.activation import ELU, GELU, ReLU, ReLU6, Sigmoid, SiLU, Softmax  # noqa: E402
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved  # noqa: E402
from snrt.layers.conv import Conv2d, ConvTranspose2d  # noqa: E402
from snrt.layers.dropout import Dropout  # noqa: E402
from snrt.layers.fused import AddReLU, BatchNormReLU  # noqa: E402
from snrt.layers.join import Add, Concat, Mul, Scale  # noqa: E402
from snrt.layers.linear import Linear  # noqa: E402
from snrt.layers.loss import SoftmaxCrossEntropy  # noqa: E402
from snrt.layers.norm import LRN, BatchNorm, GroupNorm, LayerNorm  # noqa: E402
from snrt.layers.pool import AdaptiveAvgPool, AvgPool, GlobalAvgPool, MaxPool, Upsample  # noqa: E402
from snrt.torch_reference import OPS  # noqa: E402


def conv(**options):
    return Conv2d(bias=False, **options)


# name, layer, input shapes (one per input)
CASES = [
    ("conv 3x3 16->16 @32 b32", conv(out_channels=16, kernel=3, padding=1), [(32, 16, 32, 32)]),
    ("conv 3x3 32->32 @16 b32", conv(out_channels=32, kernel=3, padding=1), [(32, 32, 16, 16)]),
    ("conv 3x3 64->64 @8 b32", conv(out_channels=64, kernel=3, padding=1), [(32, 64, 8, 8)]),
    ("conv 3x3/2 16->32 @32 b32", conv(out_channels=32, kernel=3, stride=2, padding=1), [(32, 16, 32, 32)]),
    ("conv 1x1 64->16 @32 b32", conv(out_channels=16, kernel=1), [(32, 64, 32, 32)]),
    ("conv 7x7/2 3->64 @224 b8", conv(out_channels=64, kernel=7, stride=2, padding=3), [(8, 3, 224, 224)]),
    ("conv 3x3 64->64 @56 b8", conv(out_channels=64, kernel=3, padding=1), [(8, 64, 56, 56)]),
    ("conv 1x1 256->64 @56 b8", conv(out_channels=64, kernel=1), [(8, 256, 56, 56)]),
    ("conv 3x3 256->256 @14 b8", conv(out_channels=256, kernel=3, padding=1), [(8, 256, 14, 14)]),
    ("conv 1x1 512->2048 @7 b8", conv(out_channels=2048, kernel=1), [(8, 512, 7, 7)]),
    ("batchnorm 16 @32 b32", BatchNorm(), [(32, 16, 32, 32)]),
    ("batchnorm 64 @8 b32", BatchNorm(), [(32, 64, 8, 8)]),
    ("batchnorm 64 @112 b8", BatchNorm(), [(8, 64, 112, 112)]),
    ("batchnorm 256 @56 b8", BatchNorm(), [(8, 256, 56, 56)]),
    ("maxpool 3x3/2 64 @112 b8", MaxPool(kernel=3, stride=2, padding=1), [(8, 64, 112, 112)]),
    ("relu 16 @32 b32", ReLU(), [(32, 16, 32, 32)]),
    ("relu 256 @56 b8", ReLU(), [(8, 256, 56, 56)]),
    ("add 16 @32 b32", Add(), [(32, 16, 32, 32)] * 2),
    ("add 256 @56 b8", Add(), [(8, 256, 56, 56)] * 2),
    # the fused nodes (snrt/scheduler/fuse.py) against PyTorch's two layers
    ("batchnorm+relu 16 @32 b32", BatchNormReLU(), [(32, 16, 32, 32)]),
    ("batchnorm+relu 64 @112 b8", BatchNormReLU(), [(8, 64, 112, 112)]),
    ("add+relu 16 @32 b32", AddReLU(), [(32, 16, 32, 32)] * 2),
    ("add+relu 256 @56 b8", AddReLU(), [(8, 256, 56, 56)] * 2),
    # the newer layers, at the sizes of the zoo networks that use them
    ("depthwise 3x3 144 @56 b8", conv(out_channels=144, kernel=3, padding=1, groups=144), [(8, 144, 56, 56)]),
    ("depthwise 7x7 96 @56 b8", conv(out_channels=96, kernel=7, padding=3, groups=96), [(8, 96, 56, 56)]),
    ("depthwise 5x5 672 @4 b8", conv(out_channels=672, kernel=5, padding=2, groups=672), [(8, 672, 4, 4)]),
    ("depthwise 5x5 1152 @2 b8", conv(out_channels=1152, kernel=5, padding=2, groups=1152), [(8, 1152, 2, 2)]),
    ("conv 1x1 384->1536 @4 b8", conv(out_channels=1536, kernel=1), [(8, 384, 4, 4)]),
    ("conv 1x1 3072->768 @2 b8", conv(out_channels=768, kernel=1), [(8, 3072, 2, 2)]),
    ("convtranspose 2x2/2 128->64 @128 b4", ConvTranspose2d(out_channels=64, kernel=2, stride=2, bias=False),
     [(4, 128, 128, 128)]),
    ("batchnorm affine false 64 @112 b8", BatchNorm(affine=False), [(8, 64, 112, 112)]),
    ("groupnorm 32 groups 256 @56 b8", GroupNorm(groups=32), [(8, 256, 56, 56)]),
    ("layernorm 96 @56 b8", LayerNorm(), [(8, 96, 56, 56)]),
    ("relu6 144 @56 b8", ReLU6(), [(8, 144, 56, 56)]),
    ("silu 144 @56 b8", SiLU(), [(8, 144, 56, 56)]),
    ("gelu 384 @56 b8", GELU(), [(8, 384, 56, 56)]),
    ("gelu tanh 384 @56 b8", GELU(approximate="tanh"), [(8, 384, 56, 56)]),
    ("elu 144 @56 b8", ELU(), [(8, 144, 56, 56)]),
    ("softmax channels 64 @56 b8", Softmax(), [(8, 64, 56, 56)]),
    ("mul gate 256 @56 b8", Mul(), [(8, 256, 56, 56), (8, 256)]),
    ("scale 96 @56 b8", Scale(), [(8, 96, 56, 56)]),
    ("upsample nearest 2x 128 @64 b4", Upsample(scale=2), [(4, 128, 64, 64)]),
    ("upsample bilinear 2x 128 @64 b4", Upsample(scale=2, mode="bilinear"), [(4, 128, 64, 64)]),
    ("adaptiveavgpool 7 512 @14 b8", AdaptiveAvgPool(output=7), [(8, 512, 14, 14)]),
    ("sigmoid 144 @56 b8", Sigmoid(), [(8, 144, 56, 56)]),
    ("avgpool 2x2/2 256 @28 b8", AvgPool(kernel=2, stride=2), [(8, 256, 28, 28)]),
    ("globalavgpool 2048 @7 b8", GlobalAvgPool(), [(8, 2048, 7, 7)]),
    ("lrn 5 96 @55 b8", LRN(size=5, alpha=1e-4, beta=0.75, k=1.0), [(8, 96, 55, 55)]),
    ("concat 128+32 @28 b8", Concat(), [(8, 128, 28, 28), (8, 32, 28, 28)]),
    ("linear 2048->1000 b8", Linear(out_features=1000), [(8, 2048)]),
    ("linear 9216->4096 b8", Linear(out_features=4096), [(8, 9216)]),
    ("dropout 0.5 4096 b8", Dropout(p=0.5), [(8, 4096)]),
    ("softmax cross-entropy 1000 b8", SoftmaxCrossEntropy(), [(8, 1000), (8,)]),  # the labels: integers
    ("softmax cross-entropy 10 b128", SoftmaxCrossEntropy(), [(128, 10), (128,)]),
]


def differentiated(layer, index):
    """Whether the layer takes a gradient for its input `index` (a loss's labels do not)."""
    return layer.differentiable_inputs is None or index in layer.differentiable_inputs


def make_inputs(layer, in_shapes, rng):
    """The layer's inputs: float32 normal values, or for an input it takes no gradient for,
    class labels below the first input's dimension 1."""
    return [rng.standard_normal(shape).astype(np.float32) if differentiated(layer, i)
            else rng.integers(0, in_shapes[0][1], shape) for i, shape in enumerate(in_shapes)]


def snrt_kernels(layer, xs, params, rng):
    """(forward, backward) closures running the CPU backend's kernel for `layer` on
    preallocated buffers and workspace, in training mode."""
    in_shapes = [x.shape for x in xs]
    kernel = NumpyBackend.kernel_choice().kernel_for(layer, in_shapes)
    y = np.empty(layer.infer_shape(in_shapes), np.float32)
    gy = rng.standard_normal(y.shape).astype(np.float32)
    aux = {k: np.empty(s.shape, np.float32 if s.dtype == "compute" else s.dtype)
           for k, s in layer.aux_specs(in_shapes).items()}
    state = {k: np.full(s.shape, s.fill, np.float32) for k, s in layer.state_specs(in_shapes).items()}
    # as the planner hands them out (snrt/scheduler/order.py): in a residual network every input
    # gradient of a layer that passes gy on (Add) is gy's own buffer, which the kernel leaves as it
    # is, and those of one that computes them over gy in place (AddReLU) are gy's buffer, masked
    def gradient(i, x):
        if not differentiated(layer, i) or layer.passes_gradient and x.shape == y.shape:
            return None
        return gy if layer.gradient_in_place and x.shape == y.shape else np.empty_like(x)

    gxs = [gradient(i, x) for i, x in enumerate(xs)]
    gparams = {k: np.empty_like(v) for k, v in params.items()}
    workspace = {phase: np.zeros(kernel.workspace_bytes(in_shapes, phase, 4), np.uint8) for phase in (FORWARD, BACKWARD)}
    saves = layer.saves
    saved = Saved(tuple(x if i in saves.inputs else None for i, x in enumerate(xs)), y if saves.output else None)

    def forward():
        kernel.forward(KernelContext(np, workspace=workspace[FORWARD]), xs, params, state, y, aux)

    def backward():
        kernel.backward(KernelContext(np, workspace=workspace[BACKWARD]), gy, saved, params, aux, gxs, gparams)

    forward()  # aux (BatchNorm statistics, MaxPool argmax) for backward
    if hasattr(kernel, "chosen"):  # measured per phase: "forward's/backward's"
        name = "/".join(getattr(kernel.chosen(in_shapes, phase), "name", "im2col") for phase in (FORWARD, BACKWARD))
        return forward, backward, name
    return forward, backward, getattr(kernel, "name", "numpy")


# PyTorch's side of layers whose values snrt.torch_reference does not compare (other random masks),
# and of the fused nodes, which a network file never names: PyTorch's two layers
TIMED_ONLY = {"Dropout": lambda l, xs, p, s, t: torch.nn.functional.dropout(xs[0], l.p, training=True),
              "BatchNormReLU": lambda l, xs, p, s, t: torch.relu(OPS["BatchNorm"](l, xs, p, s, t)),
              "AddReLU": lambda l, xs, p, s, t: torch.relu(sum(xs))}


def torch_function(layer, in_shapes):
    """The PyTorch function of `layer` in training mode (snrt.torch_reference.OPS):
    f(inputs, params) -> output; BatchNorm's running statistics are torch tensors of its own."""
    state = {k: torch.full(s.shape, s.fill) for k, s in layer.state_specs(in_shapes).items()}
    op = OPS.get(layer.type_name) or TIMED_ONLY[layer.type_name]
    return lambda xs, p: op(layer, xs, p, state, True)


def torch_kernels(layer, xs, params, rng, memory_format=None):
    """(forward, backward) closures of PyTorch on the same values; with a `memory_format`
    (torch.channels_last), its 4-D inputs, parameters and output gradient in that layout, as
    `model.to(memory_format=...)` and a converted batch give them, and its 4-D gradients made
    contiguous in it."""
    f = torch_function(layer, [x.shape for x in xs])

    def laid_out(t):
        return t.contiguous(memory_format=memory_format) if memory_format is not None and t.dim() == 4 else t.contiguous()

    txs = [laid_out(torch.from_numpy(x)).requires_grad_(differentiated(layer, i)) for i, x in enumerate(xs)]
    tps = {k: laid_out(torch.from_numpy(v)).requires_grad_() for k, v in params.items()}
    leaves = [t for t in txs if t.requires_grad] + list(tps.values())
    out = f(txs, tps)
    gy = laid_out(torch.from_numpy(rng.standard_normal(tuple(out.shape)).astype(np.float32)))

    def forward():
        with torch.no_grad():
            f(txs, tps)

    def backward():
        for grad in torch.autograd.grad(out, leaves, gy, retain_graph=True):
            laid_out(grad)

    return forward, backward


def faster_speed(row, phase):
    """PyTorch's ms in the faster of its layouts (channels-last timed for 4-D inputs only) /
    snrt's ms for `phase` ("forward" or "backward")."""
    return min(row[f"torch_{phase}_ms"], row.get(f"torch_cl_{phase}_ms", float("inf"))) / row[f"snrt_{phase}_ms"]


def phase_cells(row, phase):
    """The table's cells of one phase: snrt ms, PyTorch NCHW ms, channels-last ms ("-" where
    not timed), speed against NCHW, speed against the faster layout."""
    ms = row[f"snrt_{phase}_ms"]
    cl = row.get(f"torch_cl_{phase}_ms")
    return [f"{ms:.2f}", f"{row[f'torch_{phase}_ms']:.2f}", "-" if cl is None else f"{cl:.2f}",
            f"{row[f'torch_{phase}_ms'] / ms:.2f}x", f"{faster_speed(row, phase):.2f}x"]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs per kernel, after one warm-up")
    parser.add_argument("--out", default=DEFAULT_OUT, help="path without suffix for .json and .md")
    parser.add_argument("--only", nargs="+", metavar="TEXT", help="time only the layers whose name contains a TEXT")
    parser.add_argument("--settle", action=argparse.BooleanOptionalAction, default=False,
                        help="wait for idle CPUs before each timing round (Linux; off: kernels run back to back)")
    parser.add_argument("--threads", type=int, default=CORES,
                        help="threads of both frameworks (default: every core); one thread is this shared "
                             "machine's stable measure of the kernels themselves")
    args = parser.parse_args(argv)
    snrt.limit_threads(args.threads)  # snrt's kernel threads and the BLAS pools
    torch.set_num_threads(args.threads)
    meta = machine()
    start = time.perf_counter()
    cases = [case for case in CASES if not args.only or any(text in case[0] for text in args.only)]
    for _, layer, in_shapes in cases:  # kernel choices first, measured before PyTorch's threads exist
        kernel = NumpyBackend.kernel_choice().kernel_for(layer, in_shapes)
        for phase in (FORWARD, BACKWARD):
            kernel.workspace_bytes(in_shapes, phase, 4)
    rows = []
    for name, layer, in_shapes in cases:
        rng = np.random.default_rng(0)
        xs = make_inputs(layer, in_shapes, rng)
        params = {k: (rng.standard_normal(s.shape) * 0.05 + (1 if s.init in ("ones", "constant") else 0))
                  .astype(np.float32) for k, s in layer.param_specs(in_shapes).items()}  # norm scales near 1
        snrt_f, snrt_b, kernel = snrt_kernels(layer, xs, params, rng)
        phases = [{"snrt_forward": snrt_f, "snrt_backward": snrt_b},
                  dict(zip(("torch_forward", "torch_backward"), torch_kernels(layer, xs, params, rng)))]
        if len(in_shapes[0]) == 4:  # images: PyTorch's channels-last layout too
            phases.append(dict(zip(("torch_cl_forward", "torch_cl_backward"),
                                   torch_kernels(layer, xs, params, rng, torch.channels_last))))
        timed, others = time_rounds(phases, args.repeats, args.settle)
        row = {"layer": name, "kernel": kernel, "inputs": [list(s) for s in in_shapes], "other_processes_cpu_share": others}
        for key, (best, median) in timed.items():
            row[f"{key}_ms"], row[f"{key}_median_ms"] = best * 1e3, median * 1e3
        rows.append(row)
        print(f"{name:28s} {kernel:6s} " + "   ".join(
            f"{phase} {row[f'snrt_{phase}_ms']:7.2f} vs {row[f'torch_{phase}_ms']:7.2f}"
            + (f" / {row[f'torch_cl_{phase}_ms']:7.2f}" if f"torch_cl_{phase}_ms" in row else "") + " ms"
            for phase in ("forward", "backward")), flush=True)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta.update({"repeats": args.repeats, "settle": args.settle, "threads": args.threads,
                 "seconds": time.perf_counter() - start, "snrt": snrt.__version__,
                 "openblas_thread_timeout": os.environ.get("OPENBLAS_THREAD_TIMEOUT")})
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = ["# Layers on this CPU: snrt's CPU kernels against PyTorch", "",
             f"Generated {meta['date']} on {meta['platform']} ({meta['cpu_model']}, {meta['cores']} cores), "
             f"NumPy {meta['numpy']}, "
             f"PyTorch {meta['torch']}; load average {meta['load_average'][0]:.2f} when it started. "
             f"`python scripts/bench_layers.py{'' if args.threads == CORES else f' --threads {args.threads}'}"
             f"{'' if args.repeats == 7 else f' --repeats {args.repeats}'}"
             f"{'' if not args.only else ' --only ' + ' '.join(repr(t) for t in args.only)}"
             f"{'' if args.out == DEFAULT_OUT else f' --out {args.out}'}` ({args.threads} thread"
             f"{'s' if args.threads != 1 else ''} each; best of {args.repeats} after a warm-up, ms; "
             "speed = PyTorch ms / snrt ms, above 1 snrt is faster, against PyTorch in NCHW and against the "
             "faster of NCHW and channels-last (CL: inputs, parameters and gradients in "
             "torch.channels_last, for layers of images); kernel = what the CPU backend runs: "
             "numpy = the layer's own code, numba = snrt/backends/cpu_kernels.py; for dense "
             "convolutions forward's/backward's as measured here: im2col = the layer's, "
             "direct = snrt/backends/cpu_conv.py).", ""]
    lines += table(["layer", "kernel", "snrt fwd", "torch fwd", "torch CL fwd", "fwd speed", "vs faster",
                    "snrt bwd", "torch bwd", "torch CL bwd", "bwd speed", "vs faster"],
                   [[r["layer"], r["kernel"]] + [cell for phase in ("forward", "backward") for cell in phase_cells(r, phase)]
                    for r in rows])
    lows = {phase: min(rows, key=lambda r: faster_speed(r, phase)) for phase in ("forward", "backward")}
    lines += ["", "Lowest speed against PyTorch's faster layout: " + "; ".join(
        f"{phase} {faster_speed(r, phase):.2f}x ({r['layer']})" for phase, r in lows.items()) + "."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}.json and {out}.md")


if __name__ == "__main__":
    main()
