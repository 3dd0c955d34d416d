"""`snrt tune` on ResNet-50 and VGG-16 in 12 GiB (224x224): the largest batch each policy
fits, found from the plans, the images/s the CPU and the CUDA cost models predict there, and
the recommendation. Writes results/tune.{md,json} and results/tune_<network>.png.

    python scripts/reproduce_tune.py [--quick]
"""

import time
from pathlib import Path

from reproduce_common import GIB, machine, meta_line, parse_args, save_json, save_markdown, table

import snrt
from snrt.optim import make_optimizer
from snrt.scheduler import cost
from snrt.scheduler.policies import POLICIES
from snrt import tune

ROOT = Path(__file__).resolve().parent.parent
NETWORKS = ["resnet50", "vgg16"]
BUDGET = 12 * GIB


def tune_network(name, device, limit):
    config = snrt.load_config(ROOT / "configs" / f"{name}.yaml")
    options = {**make_optimizer(config.train.optimizer).plan_options,
               "cost_model": {"cpu": cost.CPU, "cuda": cost.CUDA}[device]}
    start = time.perf_counter()
    points = [p for policy in POLICIES for p in tune.sweep(config.graph, policy, BUDGET, limit, **options)]
    best = tune.recommend(points)
    train = tune.scaled_train(config.train, best.batch)
    return config, points, best, train, time.perf_counter() - start


def main():
    args = parse_args(__doc__).parse_args()
    out = args.out or ("results/quick" if args.quick else "results")
    meta = machine()
    limit = 256 if args.quick else 4096
    rows, report = [], {"meta": meta, "budget_bytes": BUDGET, "networks": {}}
    for name in NETWORKS:
        for device in ("cpu", "cuda"):
            config, points, best, train, seconds = tune_network(name, device, limit)
            largest = tune.largest(points)
            report["networks"][f"{name}/{device}"] = {
                "largest_batch": largest, "points": [{"policy": p.policy, "batch": p.batch, "arena_bytes": p.arena_bytes,
                                                      "images_per_s": p.images_per_s} for p in points],
                "recommended": {"policy": best.policy, "batch": best.batch, "images_per_s": best.images_per_s,
                                "lr": train["optimizer"]["lr"], "warmup": train["schedule"]["warmup"]},
                "seconds": seconds}
            rows.append([name, device, *(largest.get(p, 0) for p in POLICIES), best.policy, best.batch,
                         f"{best.images_per_s:.1f}", f"{train['optimizer']['lr']:g}", f"{seconds:.0f}"])
            print(f"{name} ({device} cost model): largest batch {largest}; recommended {best.policy} at "
                  f"{best.batch}, {best.images_per_s:.1f} images/s predicted ({seconds:.0f} s)", flush=True)
            if device == "cpu":
                tune.draw_throughput(points, Path(out) / f"tune_{name}.png",
                                     f"{name}: predicted images/s in 12 GiB (CPU cost model)")
    save_json(out, "tune", report)
    lines = ["# snrt tune: ResNet-50 and VGG-16 in 12 GiB", "", meta_line(meta, args.quick), "",
             "`python scripts/reproduce_tune.py`: the largest batch each policy fits in 12 GiB at 224x224, from "
             "the plans (doubling, then bisection, up to 4096), and the batch and policy with the most images/s "
             "the cost model predicts (CPU: this machine's calibrated model; CUDA: the fixed GPU model of "
             "snrt/scheduler/cost.py, not measured). The learning rate is the config's scaled linearly.", ""]
    lines += table(["network", "cost model", *POLICIES, "recommended", "batch", "images/s", "lr", "search s"], rows)
    lines += ["", *(f"![{n}](tune_{n}.png)" for n in NETWORKS)]
    save_markdown(out, "tune", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
