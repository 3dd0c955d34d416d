"""The image-folder pipeline against torchvision's: training batches per second decoded and
augmented from a folder of ImageNet-sized JPEGs, by snrt's worker processes
(snrt/workers.py) and by torchvision's ImageFolder in a DataLoader with the same number of
workers, side by side in one run; then how long a training run on that folder waits for data.

Both pipelines do the same work per image: decode, RandomResizedCrop to 224x224 (scale 8-100%,
ratio 3/4-4/3), horizontal flip, per-channel normalization, into float32 (B, 3, 224, 224)
batches. Each is timed from its first batch (process start-up is reported apart) over
`--batches` batches, `--repeats` times, the configurations taking turns; the median counts.

Writes results/pipeline.{md,json}.

    python scripts/bench_pipeline.py [--images 512] [--batches 30] [--repeats 3] [--batch 32] [--workers 1 2]
"""

import argparse
import tempfile
import time
from pathlib import Path

import timing  # noqa: F401  (before numpy: the BLAS threads)
import numpy as np
from bench_decode import photo
from reproduce_common import RESULTS, machine, meta_line, save_json, save_markdown, table

import snrt
from snrt.config import DataConfig
from snrt.data import Batches, load_datasets
from snrt.torch_reference import torchvision
from snrt.workers import WorkerBatches

CLASSES = 4
WIDTH, HEIGHT, SIZE = 500, 375, 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def image_folder(root, images):
    """`images` JPEGs of WIDTHxHEIGHT (quality 90) in CLASSES class folders of root/train."""
    data = photo(WIDTH, HEIGHT)
    for k in range(images):
        folder = root / "train" / f"class{k % CLASSES}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{k:05d}.jpg").write_bytes(data)
    return root


def timed(batches, count):
    """(start-up seconds until the first batch, batches per second over the next `count`)."""
    start = time.perf_counter()
    stream = iter(batches)
    next(stream)
    first = time.perf_counter()
    for _ in range(count):
        next(stream)
    return first - start, count / (time.perf_counter() - first)


def snrt_pipeline(root, batch, workers, count):
    train, _ = load_datasets(DataConfig(type="folder", path=str(root), flip=True), (3, SIZE, SIZE), CLASSES, seed=0)
    batches = Batches(train, batch, 0, MEAN, STD, flip=True, prefetch=not workers)
    with (WorkerBatches(batches, workers) if workers else batches) as stream:
        return timed(stream, count)


def torchvision_pipeline(root, batch, workers, count):
    import torch
    transforms = torchvision().transforms
    dataset = torchvision().datasets.ImageFolder(str(root / "train"), transform=transforms.Compose([
        transforms.RandomResizedCrop(SIZE), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(MEAN, STD)]))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True, num_workers=workers,
                                         drop_last=True, persistent_workers=workers > 0)
    return timed(_endless(loader), count)


def _endless(loader):
    while True:
        yield from loader


def data_wait(root, batch, iterations):
    """(mean iteration seconds, mean data wait seconds, workers) of training MobileNetV2 on the
    folder (the default workers), after one warm-up iteration."""
    config = snrt.load_config(timing.ROOT / "configs" / "mobilenet_v2.yaml", {
        "input.classes": CLASSES, "train.batch": batch, "train.data": {"type": "folder", "path": str(root),
                                                                       "flip": True}})
    trainer = snrt.Trainer(config)
    history = trainer.fit(iterations=iterations + 1)[1:]
    return (float(np.mean([m.seconds for m in history])), float(np.mean([m.data_wait_s for m in history])),
            trainer.workers)


def _row(name, workers, runs):
    """The table row of one pipeline and worker count from its runs [(start-up s, images/s)]."""
    return {"pipeline": name, "workers": workers, "startup_s": float(np.median([s for s, _ in runs])),
            "images_per_s": float(np.median([r for _, r in runs])), "images_per_s_runs": [r for _, r in runs]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--train-iterations", type=int, default=4)
    args = parser.parse_args()
    meta, runs = machine(), {}
    pipelines = {"snrt": snrt_pipeline, "torchvision": torchvision_pipeline}
    with tempfile.TemporaryDirectory() as tmp:
        root = image_folder(Path(tmp), args.images)
        for repeat in range(args.repeats):
            for workers in args.workers:
                for name, pipeline in pipelines.items():
                    startup, rate = pipeline(root, args.batch, workers, args.batches)
                    runs.setdefault((name, workers), []).append((startup, rate * args.batch))
                    print(f"{repeat}: {name:12s} {workers} workers: {rate * args.batch:6.0f} images/s "
                          f"(first batch after {startup:.1f} s)", flush=True)
        seconds, wait, used = data_wait(root, args.batch, args.train_iterations)
        print(f"MobileNetV2 b{args.batch}: {seconds:.2f} s/iteration, {wait * 1e3:.1f} ms data wait "
              f"({100 * wait / seconds:.1f}%), {used} workers", flush=True)
    rows = [_row(name, workers, runs[name, workers]) for workers in args.workers for name in pipelines]
    rate = {(r["pipeline"], r["workers"]): r["images_per_s"] for r in rows}
    training = {"network": "mobilenet_v2", "batch": args.batch, "iteration_s": seconds, "data_wait_s": wait,
                "workers": used}
    save_json(RESULTS, "pipeline", {"meta": meta, "args": vars(args), "rows": rows, "training": training})
    lines = [
        "# Image-folder pipeline: snrt's worker processes against torchvision's DataLoader", "",
        meta_line(meta, False), "",
        f"`python scripts/bench_pipeline.py --images {args.images} --batches {args.batches} --batch {args.batch} "
        f"--repeats {args.repeats} --workers {' '.join(map(str, args.workers))}`: {args.images} JPEGs of "
        f"{WIDTH}x{HEIGHT} (quality 90) in {CLASSES} classes; RandomResizedCrop to {SIZE}, flip, normalization, float32 batches of {args.batch}; "
        f"images/s over {args.batches} batches after the first, the median of {args.repeats} runs.", "",
        *table(["pipeline", "workers", "images/s", "runs", "first batch after (s)", "vs torchvision"],
               [[r["pipeline"], r["workers"], f"{r['images_per_s']:.0f}",
                 " ".join(f"{v:.0f}" for v in r["images_per_s_runs"]), f"{r['startup_s']:.1f}",
                 f"{r['images_per_s'] / rate['torchvision', r['workers']]:.2f}x"] for r in rows]), ""]
    if len(args.workers) > 1:
        low, high = min(args.workers), max(args.workers)
        lines += [f"snrt with {high} workers against {low}: {rate['snrt', high] / rate['snrt', low]:.2f}x; "
                  f"torchvision: {rate['torchvision', high] / rate['torchvision', low]:.2f}x.", ""]
    lines += [f"Training MobileNetV2 (224x224, batch {args.batch}, fp32, `none`) on the folder with the default "
              f"{used} workers: {seconds:.2f} s per iteration, of which {wait * 1e3:.1f} ms "
              f"({100 * wait / seconds:.1f}%) waiting for data (mean of {args.train_iterations} iterations after "
              "one warm-up)."]
    save_markdown(RESULTS, "pipeline", lines)


if __name__ == "__main__":
    main()
