"""Time snrt's Conv2d kernels (im2col + BLAS GEMM on numpy) against PyTorch's CPU convolution.

Not a test. For each shape it times forward and backward (weight, bias and data gradients)
of `snrt.layers.conv.Conv2d` with buffers and planned workspace allocated once, and
`torch.nn.functional.conv2d` / `aten.convolution_backward` on the same shapes, both with as
many threads as there are cores. Each framework's two kernels are timed in a phase of their
own (see `time_rounds`), `--repeats` rounds after one warm-up, and the best time is reported
(the median goes to the JSON as well); on a shared machine `--settle` (the default where
/proc/stat exists) waits before each round until other processes leave the CPUs idle. Prints a table and writes `results/bench_conv.json`.

    python scripts/bench_conv.py [--batch 8] [--repeats 5] [--out results/bench_conv.json]
"""

import os

CORES = os.cpu_count() or 1
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, str(CORES))  # before numpy loads its BLAS

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import snrt  # noqa: E402,F401  (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
import numpy as np  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved  # noqa: E402
from snrt.layers.conv import Conv2d  # noqa: E402

# name, (C, H, W), Conv2d options: ResNet-50 layers and its stem.
SHAPES = [
    ("stem 7x7/2 3->64 @224", (3, 224, 224), dict(out_channels=64, kernel=7, stride=2, padding=3)),
    ("3x3 64->64 @56", (64, 56, 56), dict(out_channels=64, kernel=3, padding=1)),
    ("1x1 256->64 @56", (256, 56, 56), dict(out_channels=64, kernel=1)),
    ("3x3 128->128 @28", (128, 28, 28), dict(out_channels=128, kernel=3, padding=1)),
    ("3x3 256->256 @28", (256, 28, 28), dict(out_channels=256, kernel=3, padding=1)),
    ("3x3 256->256 @14", (256, 14, 14), dict(out_channels=256, kernel=3, padding=1)),
    ("1x1/2 512->1024 @28", (512, 28, 28), dict(out_channels=1024, kernel=1, stride=2)),
]


HAVE_PROC = os.path.exists("/proc/stat")


def _cpu_seconds():
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat (Linux)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    return (sum(fields) - fields[3] - fields[4]) / ticks, sum(fields) / ticks


def _busy_fraction(interval=0.2):
    """Fraction of CPU time spent busy (by anyone) over `interval` seconds."""
    busy0, total0 = _cpu_seconds()
    time.sleep(interval)
    busy1, total1 = _cpu_seconds()
    return (busy1 - busy0) / max(1e-9, total1 - total0)


def settle(max_wait=30.0, threshold=0.1):
    """Wait (at most `max_wait` s) until the CPUs are idle: other jobs skew every timing."""
    deadline = time.monotonic() + max_wait
    while _busy_fraction() > threshold and time.monotonic() < deadline:
        pass


PAUSE_S = 0.5  # longer than OpenBLAS's and OpenMP's spin-wait after a call


def time_rounds(phases, repeats, wait):
    """Time each phase's kernels ({name: fn}, one framework's) apart from the other phases:
    after a pause (the previous framework's threads stop spinning; on 2 cores OpenBLAS's and
    PyTorch's OpenMP threads spinning beside the other's kernels slow both several times),
    every kernel once (warm-up), then `repeats` rounds of the phase's kernels in turn.

    Returns ({name: (best, median)} wall seconds, the largest share of the machine's CPU time
    other processes took during a phase's timed rounds, or None without /proc/stat).
    """
    timed, shares = {}, []
    for kernels in phases:
        time.sleep(PAUSE_S)
        for fn in kernels.values():
            fn()
        times = {name: [] for name in kernels}
        others = total = 0.0
        for _ in range(repeats):
            if wait:
                settle()
            own0, (busy0, total0) = sum(os.times()[:2]), _cpu_seconds() if HAVE_PROC else (0.0, 0.0)
            for name, fn in kernels.items():
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
            if HAVE_PROC:
                busy1, total1 = _cpu_seconds()
                others += max(0.0, (busy1 - busy0) - (sum(os.times()[:2]) - own0))
                total += total1 - total0
        timed.update({name: (min(t), statistics.median(t)) for name, t in times.items()})
        shares.append(others / total if HAVE_PROC and total > 0 else None)
    return timed, (None if None in shares else max(shares))


def snrt_kernels(layer, x, params):
    """(forward, backward, workspace bytes by phase) closures over preallocated buffers."""
    in_shapes = [x.shape]
    y = np.empty(layer.infer_shape(in_shapes), x.dtype)
    gy = np.random.default_rng(1).standard_normal(y.shape).astype(x.dtype)
    gxs = [np.empty_like(x)]
    gparams = {k: np.empty_like(v) for k, v in params.items()}
    workspaces = {
        phase: np.zeros(layer.workspace_bytes(in_shapes, phase, x.itemsize), np.uint8)
        for phase in (FORWARD, BACKWARD)
    }
    saved = Saved(xs=(x,))

    def forward():
        layer.forward(KernelContext(np, workspace=workspaces[FORWARD]), [x], params, {}, y, {})

    def backward():
        layer.backward(KernelContext(np, workspace=workspaces[BACKWARD]), gy, saved, params, {}, gxs, gparams)

    return forward, backward, {phase: int(ws.nbytes) for phase, ws in workspaces.items()}


def torch_kernels(layer, x, params):
    """(forward, backward) closures calling PyTorch's CPU convolution kernels directly."""
    tx = torch.from_numpy(x)
    tw = torch.from_numpy(params["weight"])
    tb = torch.from_numpy(params["bias"]) if "bias" in params else None
    args = (list(layer.stride), list(layer.padding), list(layer.dilation))
    with torch.no_grad():
        y = torch.nn.functional.conv2d(tx, tw, tb, *args, layer.groups)
    gy = torch.from_numpy(np.random.default_rng(1).standard_normal(tuple(y.shape)).astype(x.dtype))
    bias_sizes = [tb.shape[0]] if tb is not None else None

    def forward():
        with torch.no_grad():
            torch.nn.functional.conv2d(tx, tw, tb, *args, layer.groups)

    def backward():
        torch.ops.aten.convolution_backward(gy, tx, tw, bias_sizes, *args, False, [0, 0], layer.groups,
                                            [True, True, tb is not None])

    return forward, backward


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8, help="batch size (default 8)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per kernel, after one warm-up")
    parser.add_argument("--out", default="results/bench_conv.json", help="where to write the numbers")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--settle", action=argparse.BooleanOptionalAction,
                        default=HAVE_PROC,
                        help="wait for idle CPUs before each timing round (Linux)")
    args = parser.parse_args(argv)
    torch.set_num_threads(CORES)
    rng = np.random.default_rng(0)

    table = Table(title=f"Conv2d, batch {args.batch}, {args.dtype}, {CORES} threads "
                        f"(best of {args.repeats}: ms and GFLOP/s)")
    for column in ("layer", "snrt fwd ms", "GFLOP/s", "torch fwd ms", "GFLOP/s",
                   "snrt bwd ms", "GFLOP/s", "torch bwd ms", "GFLOP/s", "snrt workspace MiB", "others %"):
        table.add_column(column, justify="left" if column == "layer" else "right")
    rows = []
    for name, (c, h, w), options in SHAPES:
        layer = Conv2d(**options)
        shape = (args.batch, c, h, w)
        x = rng.standard_normal(shape).astype(args.dtype)
        params = {k: (rng.standard_normal(s.shape) * 0.05).astype(args.dtype)
                  for k, s in layer.param_specs([shape]).items()}
        snrt_f, snrt_b, workspace = snrt_kernels(layer, x, params)
        torch_f, torch_b = torch_kernels(layer, x, params)
        timed, others = time_rounds([{"snrt_forward": snrt_f, "snrt_backward": snrt_b},
                                     {"torch_forward": torch_f, "torch_backward": torch_b}], args.repeats, args.settle)
        flops = {"forward": layer.cost([shape], FORWARD).flops, "backward": layer.cost([shape], BACKWARD).flops}
        row = {"layer": name, "input": list(shape), "options": layer.options(),
               "flops_forward": flops["forward"], "flops_backward": flops["backward"],
               "workspace_bytes": workspace, "other_processes_cpu_share": others}
        cells = [name]
        for phase in ("forward", "backward"):
            for who in ("snrt", "torch"):
                best, median = timed[f"{who}_{phase}"]
                row[f"{who}_{phase}_ms"] = best * 1e3
                row[f"{who}_{phase}_median_ms"] = median * 1e3
                row[f"{who}_{phase}_gflops"] = flops[phase] / best / 1e9
                cells += [f"{best * 1e3:.1f}", f"{flops[phase] / best / 1e9:.0f}"]
        cells.append(f"{max(workspace.values()) / 2**20:.1f}")
        cells.append("?" if others is None else f"{100 * others:.0f}")
        rows.append(row)
        table.add_row(*cells)
    table.caption = ("others %: CPU share other processes took while the row was timed "
                     "(the machine is shared; a large share skews that row)")
    Console(width=170).print(table)
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"batch": args.batch, "repeats": args.repeats, "dtype": args.dtype, "threads": CORES,
            "settle": args.settle, "numpy": np.__version__, "torch": torch.__version__,
            "gemm_columns": Conv2d.gemm_columns, "tap_elements": Conv2d.tap_elements}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
