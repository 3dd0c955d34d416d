"""The GPU check's parts that run anywhere: without a GPU it says so in one line and does
nothing else, and its report is written from whatever the stages left."""

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
    (work / "stages.txt").write_text("environment 0 3 60\ntests-backends 1 40 200\nbench-snrt 124 150 150\n")
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
    assert "tests-backends: 1 passed, 1 failed, 1 skipped" in text and "tests.a::test_bad: assert 1 == 2" in text
    assert "| PyTorch fp32 | 40.0 | 800 | 3.00 GiB |" in text and "| PyTorch defaults | failed |" in text
    assert "No summary" in text  # ResNet-2500 left nothing
    report = json.loads(out.with_suffix(".json").read_text())
    assert report["tests"]["tests-rest"] is None and report["stages"]["tests-backends"]["exit"] == 1
    assert result.stdout.splitlines()[-1].startswith("PyTorch defaults")  # the short table comes last
