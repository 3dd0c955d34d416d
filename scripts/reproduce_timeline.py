"""Predicted against measured: ResNet-50's memory timeline under superneurons, and step times.

Trains ResNet-50 (224x224, batch 8; quick mode 112x112, batch 4; synthetic data) on this CPU for a few iterations under
every policy. For superneurons it draws the plan's device bytes per step (stacked by role)
with the bytes the executor measured at every step on top (`trainer.executor.measured_bytes`,
via `snrt.timeline.draw_timeline`), and checks them step by step. For every policy it tabulates
the plan's predicted seconds per iteration (`plan.predicted_s`, the CPU cost model) against
the measured median (the Trainer's executor time, after one warm-up iteration).

Writes results/timeline.{md,json} and results/timeline_resnet50_superneurons.png.

    python scripts/reproduce_timeline.py [--quick]
"""

import statistics

from reproduce_common import POLICIES, machine, meta_line, parse_args, save_json, save_markdown, synthetic_config, table
from timing import fit_seconds

from snrt.timeline import draw_timeline

NETWORK = "resnet50"
FULL, QUICK = (224, 8), (112, 4)  # (image size, batch)


def main():
    args = parse_args(__doc__).parse_args()
    meta = machine()
    timed = 1 if args.quick else 4
    image, batch = QUICK if args.quick else FULL
    rows, timeline = [], None
    for policy in POLICIES:
        trainer, seconds = fit_seconds(synthetic_config(NETWORK, image, batch, policy), timed)
        plan, measured = trainer.plan, list(trainer.executor.measured_bytes)
        predicted = list(plan.device_bytes)
        row = {"policy": policy, "predicted_s": plan.predicted_s,
               "measured_s": statistics.median(seconds), "iterations": len(seconds),
               "peak_bytes": plan.peak_bytes, "measured_peak_bytes": trainer.backend.arena.peak_bytes,
               "steps": len(plan.steps), "steps_equal": sum(p == m for p, m in zip(predicted, measured))}
        row["ratio"] = row["measured_s"] / row["predicted_s"]
        if policy == "superneurons":
            path = f"{args.out}/timeline_{NETWORK}_superneurons.png"
            draw_timeline(plan, path, measured=measured,
                          title=f"ResNet-50 {image}x{image}, batch {batch}, superneurons: predicted (stacked) "
                                f"and measured (dashed)")
            timeline = {"predicted_bytes": predicted, "measured_bytes": measured, "png": path}
        trainer.backend.close()
        print(f"{policy}: predicted {row['predicted_s']:.2f} s, measured {row['measured_s']:.2f} s, "
              f"{row['steps_equal']}/{row['steps']} steps with measured bytes = predicted", flush=True)
        rows.append(row)
    save_json(args.out, "timeline", {"meta": meta, "quick": args.quick, "network": NETWORK, "image": image,
                                     "batch": batch, "rows": rows, "superneurons_timeline": timeline})
    lines = ["# Predicted against measured", "", meta_line(meta, args.quick), "",
             f"ResNet-50 at {image}x{image}, batch {batch}, trained on this CPU. Memory: the plan's device "
             "bytes at every step against the live arena bytes the executor measured there. Time: "
             f"`plan.predicted_s` (CPU cost model) against the median executor seconds of {timed} "
             "iteration(s) after one warm-up.", "",
             "![timeline](timeline_resnet50_superneurons.png)", ""]
    lines += table(["policy", "predicted s/it", "measured s/it", "measured / predicted", "planned peak (B)",
                    "measured peak (B)", "steps where measured bytes = predicted"], [
        [r["policy"], f"{r['predicted_s']:.2f}", f"{r['measured_s']:.2f}", f"{r['ratio']:.2f}", r["peak_bytes"],
         r["measured_peak_bytes"], f"{r['steps_equal']} / {r['steps']}"] for r in rows])
    save_markdown(args.out, "timeline", lines)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
