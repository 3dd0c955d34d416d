"""The GPU check's parts that run anywhere: without a GPU it says so in one line and does
nothing else, and its report is written from whatever the stages left."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from snrt.backends import cuda_available

ROOT = Path(__file__).resolve().parent.parent


def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_0(tmp_path):
    if cuda_available():
        pytest.skip("this machine has a GPU: the check would run")
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                            env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = (result.stdout + result.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no GPU here, nothing checked: "), lines
    assert list(tmp_path.iterdir()) == []  # no stage ran


def test_the_report_is_written_from_what_the_stages_left(tmp_path):
    work = tmp_path / "work"
    (work / "resnet2500").mkdir(parents=True)
    (work / "stages.txt").write_text("environment 0 3 60\ntests-backends 1 40 200\nbench-snrt 124 150 150\n"
                                     "bench-torch -1 0 90\n")
    (work / "tests-backends.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="assert 1 == 2">x</failure></testcase>'
        '<testcase classname="tests.a" name="test_skip"><skipped message="needs a GPU"/></testcase>'
        '</testsuite></testsuites>')
    (work / "bench-torch.json").write_text(json.dumps({
        "device": "GPU X", "torch": "2.x", "cudnn": 91900, "batch": 32,
        "rows": [{"mode": "fp32", "ms_per_iteration": 40.0, "images_per_s": 800.0, "peak_bytes": 3 * 2 ** 30},
                 {"mode": "defaults", "error": "CUDA out of memory"}]}))
    out = tmp_path / "results" / "gpu_check"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_report.py"), str(work), "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    text = out.with_suffix(".md").read_text()
    assert "| bench-snrt | out of time | 150 | 150 |" in text
    assert "| bench-torch | skipped: the check's time was spent | 0 | 90 |" in text
    assert "tests-backends: 1 passed, 1 failed, 1 skipped" in text and "tests.a::test_bad: assert 1 == 2" in text
    assert "| PyTorch fp32 | 40.0 | 800 | 3.00 GiB |" in text and "| PyTorch defaults | failed |" in text
    assert "No summary" in text  # ResNet-2500 left nothing
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["tests"]["tests-rest"] is None and report["stages"]["tests-backends"]["exit"] == 1
    assert result.stdout.splitlines()[-1].startswith("PyTorch defaults")  # the short table comes last


def test_the_report_opens_with_the_targets_each_measured_or_said_to_be_missing(tmp_path):
    """Each target's measurement comes from the stage that measures it; a stage that left
    nothing, and work not built, read 'not measured' and count as not met."""
    work = tmp_path / "work"
    (work / "resnet2500").mkdir(parents=True)
    gib = 2 ** 30
    (work / "bench-snrt.json").write_text(json.dumps({"rows": [
        {"policy": "none", "batch": 32, "seconds_per_iteration": 0.040, "images_per_s": 800.0,
         "measured_peak_bytes": 3 * gib, "planned_peak_bytes": 3 * gib, "copies": None, "cuda_graph": True,
         "plan_steps": 500, "steps": [["backward Conv2d", 0.025, 53], ["forward Conv2d", 0.0135, 53]]},
        {"policy": "superneurons", "batch": 32, "seconds_per_iteration": 0.046, "images_per_s": 696.0,
         "predicted_s": 0.0345,
         "measured_peak_bytes": gib, "planned_peak_bytes": gib, "copies": {"hidden": 0.95}}]}))
    (work / "bench-torch.json").write_text(json.dumps({"batch": 32, "rows": [
        {"mode": "fp32", "ms_per_iteration": 40.0, "images_per_s": 800.0, "peak_bytes": 3 * gib},
        {"mode": "fp32+checkpoint", "ms_per_iteration": 50.0, "images_per_s": 640.0, "peak_bytes": 2.5 * gib},
        {"mode": "defaults", "error": "CUDA out of memory"},
        {"mode": "bf16", "ms_per_iteration": 20.0, "images_per_s": 1600.0, "peak_bytes": 2 * gib}]}))
    (work / "bench-snrt-bf16.json").write_text(json.dumps({"rows": [
        {"policy": policy, "batch": 32, "seconds_per_iteration": seconds, "images_per_s": 32 / seconds,
         "measured_peak_bytes": gib, "planned_peak_bytes": gib, "copies": None}
        for policy, seconds in (("none", 0.025), ("superneurons", 0.03125))]}))
    (work / "bench-snrt-auto.json").write_text(json.dumps({"rows": [
        {"policy": "auto", "plan_policy": "auto:optimal(offload)", "budget": 1.25 * gib, "batch": 32,
         "seconds_per_iteration": 0.0625, "images_per_s": 512.0, "measured_peak_bytes": 1.2 * gib,
         "planned_peak_bytes": 1.2 * gib, "copies": {"hidden": 0.5}}]}))
    (work / "resnet2500" / "summary.json").write_text(json.dumps({
        "batch": 16, "policy": "superneurons", "final_loss": 6.9, "mean_images_per_s": 12.0,
        "measured_peak_device_bytes": 11 * gib, "predicted_peak_device_bytes": 11 * gib,
        "predicted_iteration_s": 0.72}))
    (work / "resnet2500" / "metrics.jsonl").write_text(  # built, captured, then replayed: 20 img/s
        "".join(f'{{"seconds": {s}}}\n' for s in (2.5, 1.9, 0.8, 0.9, 0.7)))
    (work / "resnet2500-liveness").mkdir()
    (work / "resnet2500-liveness" / "summary.json").write_text(json.dumps({
        "batch": 16, "policy": "liveness", "final_loss": 6.9, "mean_images_per_s": 20.0,
        "measured_peak_device_bytes": 43 * gib, "predicted_peak_device_bytes": 43 * gib}))
    (work / "resnet2500-liveness" / "metrics.jsonl").write_text(
        "".join(f'{{"seconds": {s}}}\n' for s in (2.0, 1.5, 0.5, 0.3)))
    exactness = "tests.backends.test_cuda_device"
    (work / "tests-backends.xml").write_text(
        f'<testsuites><testsuite><testcase classname="{exactness}" '
        f'name="test_training_under_every_policy_matches_the_cpu[small_resnet]"/>'
        f'<testcase classname="{exactness}" name="test_training_under_every_policy_matches_the_cpu[concat_net]">'
        '<failure message="losses differ">x</failure></testcase></testsuite></testsuites>')
    out = tmp_path / "gpu_check"
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_report.py"), str(work), "--out", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    found = {t["target"].split(" (")[0]: t for t in json.loads(out.with_suffix(".json").read_text())["targets"]}
    expected = {  # target (to its first parenthesis): (measured, met)
        "ResNet-50 b32 fp32: snrt none speed / PyTorch fp32": (1.0, True),
        "ResNet-50 b32 fp32, non-deterministic engines admitted: snrt none speed / PyTorch fp32": (None, False),
        "superneurons / none iteration time": (1.15, False),
        "superneurons: share of the copy time hidden behind kernels": (0.95, True),
        "superneurons speed / PyTorch fp32 + checkpoint_sequential(4)": (50 / 46, True),
        "superneurons peak / PyTorch fp32 + checkpoint_sequential(4) peak": (0.4, True),
        "snrt auto in half checkpoint_sequential's memory: speed / PyTorch fp32 + checkpoint_sequential(4)":
            (50 / 62.5, False),
        "moonshot: superneurons speed / PyTorch fp32": (40 / 46, False),
        "moonshot: superneurons peak / PyTorch fp32 peak": (1 / 3, True),
        "ResNet-2500": (20.0, True),
        "ResNet-2500 measured peak": (11.0, True),
        "executor overhead with the CUDA graph": (3.0, True),  # (40 - 38.5) ms over 500 steps
        "every policy bit-identical to none, measured peak = planned": (1, False),  # one of the two failed
        "ResNet-50 b32 tf32: snrt none speed / PyTorch defaults": (None, False),  # no tf32 run, PyTorch failed
        "ResNet-50 b32 bf16: snrt none speed / PyTorch bf16 autocast, channels_last": (0.8, False),
        "superneurons / none iteration time in bf16": (1.25, False),
        "cost model: largest |predicted / measured - 1| of the iteration time": (0.25, False),  # superneurons'
    }
    assert set(found) == set(expected)
    for name, (measured, met) in expected.items():
        assert found[name]["met"] is met, name
        assert found[name]["measured"] == (None if measured is None else pytest.approx(measured)), name
    text = out.with_suffix(".md").read_text()
    assert "| superneurons / none iteration time | <= 1.10 | 1.15 | no |" in text
    assert "| snrt none bf16 | 25.0 | 1280 | 1.00 GiB (plan 1.00 GiB) |" in text
    assert "| snrt auto (auto:optimal(offload) within 1.25 GiB) | 62.5 | 512 | 1.20 GiB (plan 1.20 GiB)" in text
    assert "| executor overhead with the CUDA graph (us per step: ResNet-50 none's replayed iteration less its " \
           "steps' GPU time) | <= 5.00 | 3.00 | yes |" in text
    assert ("- the same network under liveness (no memory policy to speak of, peak 43.00 GiB): 0.40 s an iteration, "
            "40.00 images/s, what compute alone allows it") in text  # the median after the second: 0.5 and 0.3
    assert result.stdout.splitlines()[1].startswith("met ")  # the targets come first in the short table


def test_an_overhead_below_what_the_step_timings_resolve_is_not_measured():
    """A replayed iteration shorter than its steps timed one by one (their events add time of
    their own) leaves no overhead to report: not measured, rather than a negative number met."""
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "scripts" / "gpu_report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    row = {"cuda_graph": True, "plan_steps": 400, "steps": [["backward Conv2d", 0.030, 53], ["forward Conv2d", 0.012, 53]]}
    assert report.graph_overhead_us({**row, "seconds_per_iteration": 0.044}) == pytest.approx(5.0)
    assert report.graph_overhead_us({**row, "seconds_per_iteration": 0.040}) is None
    assert report.graph_overhead_us({**row, "cuda_graph": False, "seconds_per_iteration": 0.044}) is None
