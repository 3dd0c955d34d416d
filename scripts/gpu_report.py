"""The report of scripts/gpu_check.sh: reads what its stages left in the work folder and writes
OUT.md and OUT.json (default results/gpu_check.*), then prints a short table.

    python scripts/gpu_report.py /tmp/snrt-gpu-check --out results/gpu_check

The work folder holds stages.txt (one line per stage: name, exit status or -1 when the
check's time ran out before it, seconds, limit),
environment.json, the pytest runs' JUnit XML (tests-backends.xml, tests-rest.xml), bench_gpu's
JSON (bench-snrt.json in fp32, bench-snrt-stepwise.json without the CUDA graph,
bench-snrt-tf32.json, bench-snrt-bf16.json, bench-snrt-nondeterministic.json,
bench-snrt-unfused.json, bench-snrt-auto.json), the
ResNet-2500 run folder
(resnet2500/summary.json) and bench_torch's JSON (bench-torch.json). A stage that did not leave
its file is reported as missing, with its exit status: the report is written whatever failed.

The report opens with the targets of the GPU work (`targets`): each with its goal, what was
measured (None where its stage left nothing, or where the work it measures is not built) and
whether it is met. It shows the streams figures bench_gpu left beside it (gpu_streams_*.png).
"""

import argparse
import json
import statistics
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

GIB = 2 ** 30


def read_json(path):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def read_stages(work):
    """{name: {"exit": rc, "seconds": s, "limit": s}} (exit 124 or 137: out of time; -1: not
    started, the check's time spent)."""
    stages = {}
    path = work / "stages.txt"
    for line in path.read_text().splitlines() if path.exists() else []:
        name, rc, seconds, limit = line.split()
        stages[name] = {"exit": int(rc), "seconds": int(seconds), "limit": int(limit)}
    return stages


def read_tests(path):
    """Counts of a JUnit XML file and the ids of the tests that failed, or None."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    passed, failed, skipped = [], [], {}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        if outcome is None:
            counts["passed"] += 1
            passed.append(name)
        elif outcome.tag == "skipped":
            counts["skipped"] += 1
            reason = (outcome.get("message") or "").strip()
            skipped[reason] = skipped.get(reason, 0) + 1
        else:
            counts["failed"] += 1
            failed.append(f"{name}: {(outcome.get('message') or '').splitlines()[0][:200] if outcome.get('message') else ''}")
    return {**counts, "passed_ids": passed, "failures": failed, "skip_reasons": skipped}


STEADY_AFTER = 2  # iterations of a training run before its steady state: the first builds and times, the second is captured


def read_resnet2500(folder):
    """The ResNet-2500 run's summary with its iterations' seconds and `steady_images_per_s`:
    images/s at the median of the iterations after the first STEADY_AFTER (`steady_seconds`;
    the summary's mean of every iteration after the first where there are no such)."""
    summary = read_json(folder / "summary.json")
    if summary is None:
        return None
    metrics = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    seconds = [m["seconds"] for m in metrics]
    steady = seconds[STEADY_AFTER:]
    steady_s = statistics.median(steady) if steady else None
    images_per_s = summary["batch"] / steady_s if steady else summary["mean_images_per_s"]
    return {**summary, "seconds_per_iteration": seconds, "steady_seconds": steady_s, "steady_images_per_s": images_per_s}


def collect(work):
    return {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": read_json(work / "environment.json"),
        "stages": read_stages(work),
        "tests": {name: read_tests(work / f"{name}.xml") for name in ("tests-backends", "tests-rest")},
        "snrt_resnet50": read_json(work / "bench-snrt.json"),
        "snrt_resnet50_tf32": read_json(work / "bench-snrt-tf32.json"),
        "snrt_resnet50_bf16": read_json(work / "bench-snrt-bf16.json"),
        "snrt_resnet50_nondeterministic": read_json(work / "bench-snrt-nondeterministic.json"),
        "snrt_resnet50_unfused": read_json(work / "bench-snrt-unfused.json"),
        "snrt_resnet50_stepwise": read_json(work / "bench-snrt-stepwise.json"),
        "snrt_resnet50_auto": read_json(work / "bench-snrt-auto.json"),
        "resnet2500": read_resnet2500(work / "resnet2500"),
        "resnet2500_liveness": read_resnet2500(work / "resnet2500-liveness"),
        "torch_resnet50": read_json(work / "bench-torch.json"),
    }


PAPER_RESNET2500_IMAGES_PER_S = 6.2  # snrt's first GPU run of ResNet-2500 at the paper's settings
EXACTNESS_TEST = "test_training_under_every_policy_matches_the_cpu"  # tests/backends/test_cuda_device.py


def rows_by(bench, key):
    """{row[key]: row} of a bench file's rows (without the failed ones), {} when it is missing."""
    return {row[key]: row for row in (bench or {}).get("rows", []) if "error" not in row}


def _ratio(numerator, denominator):
    return None if numerator is None or not denominator else numerator / denominator


def _get(row, key):
    return None if row is None else row.get(key)


def graph_overhead_us(row):
    """Microseconds per plan step that a replayed iteration of `row` (a bench_gpu row) took
    beyond its steps' GPU time (from its profiled iteration); None unless it was replayed, and
    None where the replayed iteration was the shorter: the steps timed one by one carry the
    events between them, so what is left is below what this method resolves (on an H200,
    ResNet-50's replay took 13.5 us a step less than its steps timed so)."""
    if not row or not row.get("cuda_graph") or not row.get("steps"):
        return None
    gpu_s = sum(seconds for _, seconds, _ in row["steps"])
    overhead = (row["seconds_per_iteration"] - gpu_s) / row["plan_steps"] * 1e6
    return overhead if overhead >= 0 else None


def worst_prediction(report):
    """The largest |predicted / measured - 1| of an iteration's time over ResNet-50's fp32 rows
    (every policy) and ResNet-2500's steady iterations; None when neither left a time."""
    pairs = [(row.get("predicted_s"), row["seconds_per_iteration"])
             for row in rows_by(report["snrt_resnet50"], "policy").values()]
    r2500 = report["resnet2500"] or {}
    pairs.append((r2500.get("predicted_iteration_s"), r2500.get("steady_seconds")))
    errors = [abs(predicted / measured - 1) for predicted, measured in pairs if predicted and measured]
    return max(errors, default=None)


def targets(report):
    """[{"target", "goal", "measured", "met"}] of the GPU work's targets from the report's
    parts; `measured` is None where its stage left nothing or the work is not built."""
    snrt = rows_by(report["snrt_resnet50"], "policy")
    tf32 = rows_by(report.get("snrt_resnet50_tf32"), "policy")
    bf16 = {policy: _get(row, "seconds_per_iteration")
            for policy, row in rows_by(report.get("snrt_resnet50_bf16"), "policy").items()}
    auto = rows_by(report.get("snrt_resnet50_auto"), "policy").get("auto")
    anything = rows_by(report.get("snrt_resnet50_nondeterministic"), "policy")
    torch = rows_by(report["torch_resnet50"], "mode")
    none, sn = snrt.get("none"), snrt.get("superneurons")
    ms = {name: _get(row, "seconds_per_iteration") for name, row in (("none", none), ("superneurons", sn))}
    torch_ms = {mode: row["ms_per_iteration"] / 1e3 for mode, row in torch.items()}
    sn_peak = _get(sn, "measured_peak_bytes")
    r2500 = report["resnet2500"]
    tests = report["tests"].get("tests-backends") or {}
    exact = [name for name in tests.get("passed_ids", []) if EXACTNESS_TEST in name]
    exact_failed = [failure for failure in tests.get("failures", []) if EXACTNESS_TEST in failure]
    rows = [
        ("ResNet-50 b32 fp32: snrt none speed / PyTorch fp32 (cudnn.benchmark, TF32 off)", ">=", 1.0,
         _ratio(torch_ms.get("fp32"), ms["none"])),
        ("ResNet-50 b32 fp32, non-deterministic engines admitted: snrt none speed / PyTorch fp32", ">=", 1.0,
         _ratio(torch_ms.get("fp32"), _get(anything.get("none"), "seconds_per_iteration"))),
        ("superneurons / none iteration time", "<=", 1.10, _ratio(ms["superneurons"], ms["none"])),
        ("superneurons: share of the copy time hidden behind kernels", ">=", 0.90,
         _get(_get(sn, "copies"), "hidden")),
        ("superneurons speed / PyTorch fp32 + checkpoint_sequential(4)", ">=", 1.0,
         _ratio(torch_ms.get("fp32+checkpoint"), ms["superneurons"])),
        ("superneurons peak / PyTorch fp32 + checkpoint_sequential(4) peak", "<=", 0.5,
         _ratio(sn_peak, _get(torch.get("fp32+checkpoint"), "peak_bytes"))),
        ("snrt auto in half checkpoint_sequential's memory: speed / PyTorch fp32 + checkpoint_sequential(4)", ">=",
         1.0, _ratio(torch_ms.get("fp32+checkpoint"), _get(auto, "seconds_per_iteration"))),
        ("moonshot: superneurons speed / PyTorch fp32", ">=", 1.0, _ratio(torch_ms.get("fp32"), ms["superneurons"])),
        ("moonshot: superneurons peak / PyTorch fp32 peak", "<=", 1 / 3,
         _ratio(sn_peak, _get(torch.get("fp32"), "peak_bytes"))),
        ("ResNet-2500 (batch 16, 227x227, superneurons) images/s", ">=", 3 * PAPER_RESNET2500_IMAGES_PER_S,
         _get(r2500, "steady_images_per_s")),
        ("ResNet-2500 measured peak (GiB; inside 12 GiB and equal to the plan's)", "<=", 12.0,
         None if r2500 is None or r2500["measured_peak_device_bytes"] != r2500["predicted_peak_device_bytes"]
         else r2500["measured_peak_device_bytes"] / GIB),
        ("executor overhead with the CUDA graph (us per step: ResNet-50 none's replayed iteration less its steps' "
         "GPU time)", "<=", 5.0, graph_overhead_us(none)),
        ("every policy bit-identical to none, measured peak = planned (device tests passed, of 2 networks)", ">=", 2,
         len(exact) if exact or exact_failed else None),
        ("ResNet-50 b32 tf32: snrt none speed / PyTorch defaults (TF32)", ">=", 1.0,
         _ratio(torch_ms.get("defaults"), _get(tf32.get("none"), "seconds_per_iteration"))),
        ("ResNet-50 b32 bf16: snrt none speed / PyTorch bf16 autocast, channels_last", ">=", 1.0,
         _ratio(torch_ms.get("bf16"), bf16.get("none"))),
        ("superneurons / none iteration time in bf16", "<=", 1.10, _ratio(bf16.get("superneurons"), bf16.get("none"))),
        ("cost model: largest |predicted / measured - 1| of the iteration time (ResNet-50 fp32, every policy; "
         "ResNet-2500)", "<=", 0.15, worst_prediction(report)),
    ]
    return [{"target": name, "goal": f"{sign} {goal:.2f}", "measured": measured,
             "met": measured is not None and (measured >= goal if sign == ">=" else measured <= goal)}
            for name, sign, goal, measured in rows]


def gib(nbytes):
    return "" if nbytes is None else f"{nbytes / GIB:.2f} GiB"


def speed_rows(report):
    """(what, ms per iteration, images/s, peak) of every ResNet-50 row, snrt's then PyTorch's."""
    rows = []
    for part, label in (("snrt_resnet50", ""), ("snrt_resnet50_tf32", " tf32"), ("snrt_resnet50_bf16", " bf16"),
                        ("snrt_resnet50_nondeterministic", " non-deterministic"),
                        ("snrt_resnet50_unfused", " unfused (--no-fuse)"), ("snrt_resnet50_auto", ""),
                        ("snrt_resnet50_stepwise", " step by step (--no-cuda-graph)")):
        for row in (report.get(part) or {}).get("rows", []):
            seconds = row["seconds_per_iteration"]
            hidden = f", copies {row['copies']['hidden']:.0%} hidden" if row.get("copies") else ""
            within = f" ({row.get('plan_policy', '?')} within {gib(row['budget'])})" if row.get("budget") else ""
            rows.append((f"snrt {row['policy']}{label}{within}", f"{seconds * 1e3:.1f}", f"{row['images_per_s']:.0f}",
                         f"{gib(row['measured_peak_bytes'])} (plan {gib(row['planned_peak_bytes'])}){hidden}"))
    for row in (report["torch_resnet50"] or {}).get("rows", []):
        if "error" in row:
            rows.append((f"PyTorch {row['mode']}", "failed", "", row["error"][:80]))
        else:
            rows.append((f"PyTorch {row['mode']}", f"{row['ms_per_iteration']:.1f}", f"{row['images_per_s']:.0f}",
                         gib(row["peak_bytes"])))
    return rows


def target_rows(report):
    """(target, goal, measured, met) of every target, as text."""
    return [(t["target"], t["goal"], "not measured" if t["measured"] is None else f"{t['measured']:.2f}",
             "yes" if t["met"] else "no") for t in report["targets"]]


def markdown(report, figures=()):
    env = report["environment"] or {}
    lines = ["# GPU check", "", f"Written by `bash scripts/gpu_check.sh` on {report['when']}.", "",
             f"- device and CUDA software: {env.get('device', 'unknown (the environment stage failed)')}",
             f"- Python {env.get('python', '?')}, {env.get('platform', '?')}",
             f"- PyTorch (comparison only): {env.get('torch', '?')}", "", "## Targets", "",
             "| target | goal | measured | met |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in target_rows(report)]
    lines += ["", "## Stages", "",
             "| stage | exit | seconds | limit |", "| --- | --- | --- | --- |"]
    for name, stage in report["stages"].items():
        status = ("out of time" if stage["exit"] in (124, 137) else
                  "skipped: the check's time was spent" if stage["exit"] == -1 else stage["exit"])
        lines.append(f"| {name} | {status} | {stage['seconds']} | {stage['limit']} |")
    lines += ["", "## Tests", ""]
    for name, tests in report["tests"].items():
        if tests is None:
            lines.append(f"- {name}: no results")
            continue
        lines.append(f"- {name}: {tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped")
        lines += [f"  - failed: `{failure}`" for failure in tests["failures"]]
        lines += [f"  - skipped ({count}): {reason}" for reason, count in tests["skip_reasons"].items()]
    snrt50 = report["snrt_resnet50"] or {}
    torch50 = report["torch_resnet50"] or {}
    batch = next((row["batch"] for row in snrt50.get("rows", [])), torch50.get("batch", "?"))
    lines += ["", f"## ResNet-50, batch {batch}, 224x224, fp32, tf32 and bf16 (median of 5 iterations)", "",
              f"PyTorch {torch50.get('torch', '?')}, cuDNN {torch50.get('cudnn', '?')}, on {torch50.get('device', '?')}.", "",
              "| | ms/iteration | img/s | peak |", "| --- | --- | --- | --- |"]
    lines += [f"| {' | '.join(row)} |" for row in speed_rows(report)]
    for name in figures:
        lines += ["", f"![{name}]({name})"]
    r2500 = report["resnet2500"]
    lines += ["", "## snrt train configs/resnet2500.yaml --backend cuda --iterations 5", ""]
    if r2500 is None:
        lines.append("No summary: see the stage's exit status above.")
    else:
        seconds = ", ".join(f"{s:.2f}" for s in r2500["seconds_per_iteration"])
        lines += [f"- batch {r2500['batch']}, policy {r2500['policy']}, final loss {r2500['final_loss']:.4f}",
                  f"- seconds per iteration: {seconds} (predicted {r2500.get('predicted_iteration_s', 0):.2f} s)",
                  f"- images/s, median of the iterations after the second (each a replayed CUDA graph): "
                  f"{r2500['steady_images_per_s']:.2f}",
                  f"- measured peak {gib(r2500['measured_peak_device_bytes'])}, planned "
                  f"{gib(r2500['predicted_peak_device_bytes'])}"]
    bound = report.get("resnet2500_liveness")
    if bound is not None and bound["steady_seconds"]:
        lines += [f"- the same network under liveness (no memory policy to speak of, peak "
                  f"{gib(bound['measured_peak_device_bytes'])}): {bound['steady_seconds']:.2f} s an iteration, "
                  f"{bound['steady_images_per_s']:.2f} images/s, what compute alone allows it"]
    return "\n".join(lines) + "\n"


def short_table(report):
    out = [f"{'met' if met == 'yes' else 'NOT met':8s} {measured:>12s} (goal {goal}) {target}"
           for target, goal, measured, met in target_rows(report)]
    for name, tests in report["tests"].items():
        out.append(f"{name:24s} " + ("no results" if tests is None else
                                     f"{tests['passed']} passed, {tests['failed']} failed, {tests['skipped']} skipped"))
    for what, ms, images, peak in speed_rows(report):
        out.append(f"{what:24s} {ms:>8s} ms {images:>6s} img/s  {peak}")
    r2500 = report["resnet2500"]
    if r2500:
        seconds = r2500["steady_seconds"] or statistics.median(r2500["seconds_per_iteration"])
        out.append(f"{'snrt ResNet-2500':24s} {seconds:8.2f} s/iteration, peak {gib(r2500['measured_peak_device_bytes'])}")
    return "\n".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", type=Path)
    parser.add_argument("--out", type=Path, default=Path("results/gpu_check"))
    args = parser.parse_args()
    report = collect(args.work)
    report["targets"] = targets(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    figures = sorted(path.name for path in args.out.parent.glob("gpu_streams_*.png"))  # bench_gpu --figures
    args.out.with_suffix(".md").write_text(markdown(report, figures))
    print(f"wrote {args.out.with_suffix('.md')} and {args.out.with_suffix('.json')}")
    print(short_table(report))


if __name__ == "__main__":
    main()
