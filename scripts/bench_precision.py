"""Accuracy and speed of each precision on the CPU: the same network trained from the same seed in
fp32, bf16 and fp16 (2-byte tensors staged in fp32, snrt/layers/staging.py; fp16 with dynamic
loss scaling), its held-out accuracy and loss at the end, images/s, the measured peak, and for
fp16 the updates its loss scaling skipped.

By default LeNet on scikit-learn's digits (configs/lenet.yaml, bundled: nothing is downloaded);
`--config configs/cifar_resnet20.yaml` with a local CIFAR-10 folder (train.data.path) for the
CIFAR ResNet-20 comparison, or with `--digits` to train that network on the bundled digits
instead (its input becomes 1x8x8: the stages see 8x8, 4x4 and 2x2 maps). Writes
results/precision_accuracy.{md,json} for LeNet, results/precision_accuracy_<network>.{md,json}
for another network.

    python scripts/bench_precision.py [--config F] [--digits] [--iterations N] [--quick]
"""

import argparse
import time

from reproduce_common import ROOT, machine, meta_line, save_json, save_markdown, table

import snrt
from snrt.train import Trainer

PRECISIONS = ("fp32", "bf16", "fp16")


DIGITS = {"train.data": {"type": "digits"}, "input.shape": [1, 8, 8], "input.classes": 10}


def train(config_path, precision, iterations, overrides=None):
    """The numbers of one run; `overrides` are more config keys (DIGITS)."""
    config = snrt.load_config(config_path, {"train.precision": precision, "train.iterations": iterations,
                                            **(overrides or {})})
    trainer = Trainer(config)
    start = time.perf_counter()
    history = trainer.fit()
    seconds = time.perf_counter() - start
    loss, accuracy = trainer.evaluate()
    timed = history[1:] or history
    return {"precision": precision, "iterations": iterations, "heldout_accuracy": accuracy, "heldout_loss": loss,
            "final_loss": history[-1].loss, "images_per_s": sum(m.images_per_s for m in timed) / len(timed),
            "seconds": seconds, "peak_bytes": trainer.backend.arena.peak_bytes,
            "skipped_updates": sum(m.skipped for m in history),
            "loss_scale": trainer.loss_scale.scale if trainer.loss_scale else None}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "lenet.yaml"))
    parser.add_argument("--digits", action="store_true",
                        help="train on scikit-learn's bundled 8x8 digits, whatever the config's data and input")
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="200 iterations, results/quick/")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    iterations = 200 if args.quick else args.iterations
    out = args.out or str(ROOT / "results" / ("quick" if args.quick else ""))
    meta = machine()
    rows = []
    for precision in PRECISIONS:
        rows.append(train(args.config, precision, iterations, DIGITS if args.digits else None))
        r = rows[-1]
        print(f"{precision}: held-out accuracy {r['heldout_accuracy']:.4f}, {r['images_per_s']:.0f} images/s, "
              f"{r['skipped_updates']} updates skipped", flush=True)
    fp32 = rows[0]
    name = snrt.load_config(args.config).name
    stem = "precision_accuracy" if name == "lenet" else f"precision_accuracy_{name}"
    save_json(out, stem, {"meta": meta, "config": args.config, "digits": args.digits, "runs": rows})
    data = " on scikit-learn's digits (input 1x8x8)" if args.digits else ""
    command = f"python scripts/bench_precision.py --config {args.config}{' --digits' * args.digits} --iterations {iterations}"
    lines = [f"# Precisions on the CPU: {name}{data}, {iterations} iterations from the same seed", "",
             meta_line(meta, args.quick), "",
             f"`{command}`. bf16 and fp16 "
             "store activations, their gradients and saved tensors in 2 bytes and compute in fp32 on copies staged "
             "in each step's workspace; fp16 scales its loss dynamically.", "",
             *table(["precision", "held-out accuracy", "vs fp32 (points)", "held-out loss", "images/s",
                     "vs fp32 speed", "measured peak (MiB)", "updates skipped", "final loss scale"],
                    [[r["precision"], f"{r['heldout_accuracy']:.4f}",
                      f"{100 * (r['heldout_accuracy'] - fp32['heldout_accuracy']):+.2f}", f"{r['heldout_loss']:.4f}",
                      f"{r['images_per_s']:.0f}", f"{r['images_per_s'] / fp32['images_per_s']:.2f}x",
                      f"{r['peak_bytes'] / 2**20:.1f}", r["skipped_updates"],
                      "-" if r["loss_scale"] is None else f"{r['loss_scale']:g}"] for r in rows])]
    save_markdown(out, stem, lines)


if __name__ == "__main__":
    main()
