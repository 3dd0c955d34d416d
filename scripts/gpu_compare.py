"""Two versions of snrt side by side on one GPU: bench_gpu's files of the code before and after a
change, run one after the other on the same machine, and PyTorch's (bench_torch) beside them.
Writes OUT.md and OUT.json (the three files as read, and the step times compared).

    python scripts/bench_gpu.py --policies none superneurons --out after.json       # this checkout
    (cd BEFORE && python scripts/bench_gpu.py --policies none --out before.json)    # the older one
    python scripts/bench_torch.py --modes fp32 --out torch.json
    python scripts/gpu_compare.py before.json after.json --torch torch.json \
        --engines ~/.cache/snrt/cudnn-engines.json --out results/gpu_kernels

With --engines (the after run's cudnn-engines.json), a table of the operations an alternative
(cuBLAS GEMMs, CUDA kernels) was timed against cuDNN's engine for, and which ran them.

The step table compares the GPU seconds per step kind and layer type of each version's
profiled iteration (one more iteration with every step between CUDA events; launch gaps
inside a step count in it), for the policies both ran.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from gpu_report import GIB, rows_by


def speed_table(before, after, torch):
    """Markdown lines: ms/iteration, images/s and peaks of each version's policies and PyTorch's modes."""
    lines = ["| | ms/iteration | img/s | predicted ms | peak (planned) |", "| --- | --- | --- | --- | --- |"]
    for name, bench in (("before", before), ("after", after)):
        for policy, row in rows_by(bench, "policy").items():
            lines.append(f"| snrt {policy}, {name} | {row['seconds_per_iteration'] * 1e3:.1f} | "
                         f"{row['images_per_s']:.0f} | {row['predicted_s'] * 1e3:.1f} | "
                         f"{row['measured_peak_bytes'] / GIB:.2f} GiB ({row['planned_peak_bytes'] / GIB:.2f}) |")
    for row in (torch or {}).get("rows", []):
        if "error" not in row:
            lines.append(f"| PyTorch {row['mode']} | {row['ms_per_iteration']:.1f} | {row['images_per_s']:.0f} | | "
                         f"{row['peak_bytes'] / GIB:.2f} GiB |")
    return lines


def step_table(before, after, policy):
    """Markdown lines: each step kind and layer type's GPU ms before and after (largest after first)."""
    old = {what: (s, n) for what, s, n in rows_by(before, "policy")[policy]["steps"]}
    new = {what: (s, n) for what, s, n in rows_by(after, "policy")[policy]["steps"]}
    lines = [f"| {policy}: step | before ms | after ms | steps |", "| --- | --- | --- | --- |"]
    for what in sorted(set(old) | set(new), key=lambda w: -max(new.get(w, (0, 0))[0], old.get(w, (0, 0))[0])):
        b, a = old.get(what, (0.0, 0)), new.get(what, (0.0, 0))
        lines.append(f"| {what} | {b[0] * 1e3:.2f} | {a[0] * 1e3:.2f} | {max(b[1], a[1])} |")
    return lines


def alternatives_table(engines, device):
    """Markdown lines: per operation, how many graphs of `device` an alternative was timed
    for, how many it ran, and the median time of the one that ran against cuDNN's engine."""
    found = {}
    for key, entry in engines.items():
        parts = key.split(" | ")
        if "kernel" not in entry or not device.startswith(parts[0].split(" sm_")[0]):
            continue
        operation = " ".join(parts[3].split(" ")[:2])
        found.setdefault(operation, []).append(entry)
    lines = ["| operation | timed | run instead | median of its time / cuDNN's |", "| --- | --- | --- | --- |"]
    for operation, entries in sorted(found.items()):
        taken = [e for e in entries if e["kernel"] != "cudnn"]
        ratios = [e["seconds"][e["kernel"]] / e["seconds"]["cudnn"] for e in taken]
        names = sorted({e["kernel"] for e in taken})
        lines.append(f"| {operation} | {len(entries)} | {len(taken)} ({', '.join(names)}) | "
                     f"{statistics.median(ratios):.2f} |" if ratios else f"| {operation} | {len(entries)} | 0 | |")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--torch")
    parser.add_argument("--engines", help="the after run's cudnn-engines.json")
    parser.add_argument("--out", default="results/gpu_compare")
    args = parser.parse_args()
    before, after = (json.loads(Path(p).read_text()) for p in (args.before, args.after))
    torch = json.loads(Path(args.torch).read_text()) if args.torch else None
    both = [p for p in rows_by(after, "policy") if p in rows_by(before, "policy")]
    lines = [f"# snrt before and after, {after['device']}", "",
             f"Written by `python scripts/gpu_compare.py {' '.join(sys.argv[1:])}`.", "",
             f"Config {Path(after['config']).name}, batch {after['rows'][0]['batch']}, {after['precision']}; "
             f"median of each version's timed iterations (before at {before['when']}, after at {after['when']}).", ""]
    lines += speed_table(before, after, torch)
    for policy in both:
        lines += ["", *step_table(before, after, policy)]
    if args.engines:
        engines = json.loads(Path(args.engines).read_text())
        lines += ["", "Alternatives to cuDNN, each timed once on buffers of its shapes against the graph's "
                  "engine (every shape timed on this device, the tests' small ones included):", "",
                  *alternatives_table(engines, after["device"])]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.md").write_text("\n".join(lines) + "\n")
    Path(f"{args.out}.json").write_text(json.dumps({"before": before, "after": after, "torch": torch}, indent=1) + "\n")
    print("\n".join(lines))
    print(f"wrote {args.out}.md and {args.out}.json")


if __name__ == "__main__":
    main()
