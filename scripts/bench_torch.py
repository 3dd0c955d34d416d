"""Time PyTorch's own training iteration of torchvision's ResNet-50, the baseline that snrt's
GPU timings (scripts/bench_gpu.py) are compared against. PyTorch and torchvision are needed
by this script only; the snrt package never imports them.

Five modes, each one row: `fp32` (TF32 off for convolutions and matmuls), `fp32+checkpoint`
(the same, the forward pass through torch.utils.checkpoint.checkpoint_sequential in
`--segments` segments), `defaults` (PyTorch's TF32 settings as it ships them: on for cuDNN
convolutions, off for matmuls), `defaults+checkpoint`, and `bf16` (the mixed-precision
recipe: PyTorch's defaults, the forward pass under bf16 autocast, model and images
channels_last). cudnn.benchmark is on in all of them. Each mode builds a fresh resnet50(weights=None) trained with SGD (lr 0.01, momentum 0.9)
and cross-entropy on fixed random float32 data: one untimed warm-up iteration, then the median
of `--iterations` timed ones (the device synchronized around each), images/s, and the peak of
torch.cuda.max_memory_allocated() over the timed iterations. A mode that fails (out of memory,
say) is recorded with its error and the others still run. Writes results/bench_torch.json.

    python scripts/bench_torch.py                          # ResNet-50, 224x224, batch 32, all modes
    python scripts/bench_torch.py --batch 64 --modes fp32 defaults
    python scripts/bench_torch.py --device cpu --batch 2 --image-size 64 --iterations 1 --out /tmp/bt.json
"""

import argparse
import gc
import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.utils.checkpoint import checkpoint_sequential

ROOT = Path(__file__).resolve().parent.parent
CLASSES = 1000
# mode -> (PyTorch's default TF32 settings rather than none, checkpointed forward, bf16 autocast
# with channels_last)
MODES = {
    "fp32": (False, False, False),
    "fp32+checkpoint": (False, True, False),
    "defaults": (True, False, False),
    "defaults+checkpoint": (True, True, False),
    "bf16": (True, False, True),
}
# PyTorch's TF32 settings as it ships them, read before any mode changes them
DEFAULT_TF32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)


def positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive, default=32)
    parser.add_argument("--image-size", type=positive, default=224)
    parser.add_argument("--iterations", type=positive, default=5, help="timed iterations, after one warm-up")
    parser.add_argument("--segments", type=positive, default=4, help="checkpoint_sequential segments")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench_torch.json")
    parser.add_argument("--device", default="cuda", help='"cuda" (default) or "cpu" for a smoke test')
    parser.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    return parser.parse_args()


def set_precision(pytorch_defaults):
    matmul_tf32, cudnn_tf32 = DEFAULT_TF32 if pytorch_defaults else (False, False)
    torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    torch.backends.cudnn.allow_tf32 = cudnn_tf32
    torch.backends.cudnn.benchmark = True


def as_sequential(model):
    """ResNet's children in order, the flatten that its forward does inserted before fc, and
    the stem's ReLU out of place: in place, at the start of a checkpointed segment (as with 4
    segments), it overwrites the segment's saved input and the backward pass fails."""
    *body, fc = model.children()
    body = [nn.ReLU() if isinstance(child, nn.ReLU) else child for child in body]
    return nn.Sequential(*body, nn.Flatten(1), fc)


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode, device, batch, image_size, iterations, segments):
    pytorch_defaults, checkpointed, bf16 = MODES[mode]
    set_precision(pytorch_defaults)
    torch.manual_seed(0)
    layout = torch.channels_last if bf16 else torch.contiguous_format
    model = torchvision.models.resnet50(weights=None, num_classes=CLASSES).to(device, memory_format=layout).train()
    layers = as_sequential(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(batch, 3, image_size, image_size, device=device).to(memory_format=layout)
    labels = torch.randint(0, CLASSES, (batch,), device=device)

    def step():
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if checkpointed:
                output = checkpoint_sequential(layers, segments, images, use_reentrant=False)
            else:
                output = model(images)
            loss = F.cross_entropy(output, labels)
        loss.backward()
        optimizer.step()

    step()  # warm-up: cuDNN autotuning (cudnn.benchmark) and the allocator's first blocks
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for _ in range(iterations):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    del model, layers, optimizer, images, labels
    median = statistics.median(seconds)
    return {"mode": mode, "ms_per_iteration": median * 1e3, "images_per_s": batch / median,
            "peak_bytes": peak}


def free_memory():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def describe(error):
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def format_row(row):
    if "error" in row:
        return f"{row['mode']:<20}failed: {row['error']}"
    peak = "n/a" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**30:.2f} GiB"
    return (f"{row['mode']:<20}{row['ms_per_iteration']:7.1f} ms/iter"
            f"{row['images_per_s']:9.1f} img/s  peak {peak}")


def main():
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"bench_torch: --device {args.device} but torch.cuda.is_available() is False; nothing written")
        return
    rows = []
    for mode in args.modes:
        try:
            row = run_mode(mode, device, args.batch, args.image_size, args.iterations, args.segments)
        except Exception as error:  # out of memory, say: record it, go on with the other modes
            row = {"mode": mode, "error": describe(error)}
        free_memory()
        print(format_row(row), flush=True)
        rows.append(row)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "torchvision": torchvision.__version__,
        "cudnn": torch.backends.cudnn.version(),
        "batch": args.batch,
        "image_size": args.image_size,
        "iterations": args.iterations,
        "segments": args.segments,
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
