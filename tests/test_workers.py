"""Worker processes (snrt/workers.py): the same batches for any number of workers, and a worker
that dies, hangs or cannot decode a file stops the run in one line naming it, checkpoint saved."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from snrt import images, workers
from snrt.checkpoint import load_checkpoint
from snrt.cli import main
from snrt.data import Batches, Dataset
from snrt.workers import DataError, WorkerBatches
from tests.test_images import datasets, make_folder

ZERO, ONE = np.zeros(3), np.ones(3)
ROOT = Path(__file__).resolve().parent.parent


class Failing(Dataset):
    """Its fifth sample ends the process that reads it (`fate` "dies", as a decoder crash would)
    or never finishes ("hangs"), after reporting `path` as the file it opened."""

    fate = path = None

    def take(self, idx, rngs=None):
        if 5 in list(np.atleast_1d(np.arange(len(self))[idx])):
            images.on_open and images.on_open(self.path)
            if self.fate == "dies":
                os._exit(3)
            time.sleep(3600)
        return super().take(idx, rngs)


class Dying(Failing):
    fate, path = "dies", "/data/train/cat/broken.jpg"


class Hanging(Failing):
    fate, path = "hangs", "/data/train/dog/stuck.png"


def numbered(cls, n=12):
    x = np.arange(n, dtype=np.float32).reshape(n, 1, 1, 1) * np.ones((1, 3, 2, 2), np.float32)
    return cls(x, np.arange(n) % 3, 3, "numbered")


@pytest.mark.parametrize("count", [1, 2, 4])
def test_the_batches_are_those_of_one_process_for_any_number_of_workers(tmp_path, count):
    train, _ = datasets(make_folder(tmp_path))
    expected = Batches(train, 4, 3, ZERO, ONE, flip=True, start=2, prefetch=False)
    with WorkerBatches(Batches(train, 4, 3, ZERO, ONE, flip=True, start=2, prefetch=False), count) as made:
        for i, (x, y) in zip(range(2, 9), made):
            ex, ey = expected.get(i)
            np.testing.assert_array_equal(x, ex)
            np.testing.assert_array_equal(y, ey)


def test_a_worker_reads_a_file_whose_name_is_not_utf8(tmp_path):
    root = make_folder(tmp_path)
    image = root / "train" / "cat" / "0.png"
    image.rename(image.with_name(os.fsdecode(b"caf\xe9.png")))  # a Latin-1 name: byte 0xE9 is not UTF-8
    train, _ = datasets(root)
    expected = Batches(train, len(train), 0, ZERO, ONE, prefetch=False).get(0)
    with WorkerBatches(Batches(train, len(train), 0, ZERO, ONE, prefetch=False), 1) as made:
        np.testing.assert_array_equal(next(iter(made))[0], expected[0])


def test_a_worker_that_dies_is_named_with_the_file_it_was_reading():
    batches = Batches(numbered(Dying), 2, 0, ZERO, ONE, prefetch=False)  # sample 5: in the first epoch
    with WorkerBatches(batches, 1) as made, pytest.raises(DataError) as error:
        list(zip(range(12), made))
    assert "data worker 0 died (exit code 3) while reading /data/train/cat/broken.jpg" in str(error.value)


def test_a_script_without_a_main_guard_is_told_why_its_workers_die(tmp_path):
    script = tmp_path / "train_script.py"  # spawn imports it again in the worker, which starts workers itself
    script.write_text("import numpy as np\nfrom snrt.data import Dataset, Batches\nfrom snrt.workers import WorkerBatches\n"
                      "data = Dataset(np.zeros((8, 1, 2, 2), np.float32), np.zeros(8, np.int64), 2, 'zeros')\n"
                      "with WorkerBatches(Batches(data, 2, 0, [0.0], [1.0], prefetch=False), 1) as made:\n"
                      "    next(iter(made))\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode != 0
    assert "data worker 0 died (exit code 1) before any batch was made" in run.stderr
    assert 'if __name__ == "__main__":' in run.stderr


def test_a_worker_that_hangs_is_named_with_the_file_it_was_reading(monkeypatch):
    monkeypatch.setattr(workers, "HANG_S", 1.0)
    batches = Batches(numbered(Hanging), 2, 0, ZERO, ONE, prefetch=False)
    with WorkerBatches(batches, 1) as made, pytest.raises(DataError) as error:
        list(zip(range(12), made))
    assert "data worker 0 made no batch in 1 s while reading /data/train/dog/stuck.png" in str(error.value)


@pytest.mark.parametrize("count", ["1", "0"], ids=["a worker process", "the loader thread"])
def test_a_file_that_cannot_be_decoded_stops_the_run_with_its_checkpoint(tmp_path, capsys, count):
    root = make_folder(tmp_path / "images")
    jpeg = root / "train" / "dog" / "1.jpg"
    noise = np.random.default_rng(0).integers(0, 256, (40, 40, 3), np.uint8)
    Image.fromarray(noise).save(jpeg)
    jpeg.write_bytes(jpeg.read_bytes()[:int(jpeg.stat().st_size * 0.8)])  # truncated: it opens, but does not decode
    train, _ = datasets(root)
    broken = train.files.index(jpeg)
    seed = next(s for s in range(20) if broken not in Batches(train, 4, s, ZERO, ONE, prefetch=False).indices(0))
    # a seed whose first batch does not hold it (an iteration runs first), and no normalization
    # statistics (measuring them would decode it before the run starts, and stop there)
    (tmp_path / "net.yaml").write_text(
        "name: tiny\ninput: {shape: [3, 16, 16], classes: 3}\n"
        f"train: {{batch: 4, iterations: 12, seed: {seed}, data: {{type: folder, path: {root}, normalize: false}}}}\n"
        "network:\n  - {type: Conv2d, out_channels: 4, kernel: 3, padding: 1}\n  - {type: ReLU}\n"
        "  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: 3}\n  - {type: SoftmaxCrossEntropy}\n")
    code = main(["train", str(tmp_path / "net.yaml"), "--workers", count, "--out", str(tmp_path / "run"),
                 "--no-progress"])
    err = " ".join(capsys.readouterr().err.split())
    assert code == 2 and "Traceback" not in err
    assert str(jpeg) in err and "cannot decode this image" in err
    done = [json.loads(line)["iteration"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert done and load_checkpoint(tmp_path / "run" / "checkpoint.npz")[1]["iteration"] == len(done)


def test_a_run_resumed_with_other_workers_ends_where_an_uninterrupted_one_does(tmp_path):
    root = make_folder(tmp_path / "images")
    (tmp_path / "net.yaml").write_text(
        "name: tiny\ninput: {shape: [3, 16, 16], classes: 3}\n"
        f"train: {{batch: 4, iterations: 4, data: {{type: folder, path: {root}, flip: true}}}}\n"
        "network:\n  - {type: Conv2d, out_channels: 4, kernel: 3, padding: 1}\n  - {type: ReLU}\n"
        "  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: 3}\n  - {type: SoftmaxCrossEntropy}\n")

    def train(out, *flags):
        assert main(["train", str(tmp_path / "net.yaml"), "--out", str(tmp_path / out), "--no-progress", "--no-eval",
                     *flags]) == 0
        return np.load(tmp_path / out / "checkpoint.npz")

    whole = train("whole", "--workers", "2")
    train("parts", "--workers", "0", "--iterations", "2")
    resumed = train("parts", "--workers", "1", "--resume")
    assert sorted(whole.files) == sorted(resumed.files)
    for name in whole.files:
        np.testing.assert_array_equal(whole[name], resumed[name], err_msg=name)


def test_more_workers_than_this_machine_can_run_is_one_error_before_any_starts(tmp_path, capsys, monkeypatch):
    from snrt import train

    monkeypatch.setattr(train, "usable_cores", lambda: 2)
    assert main(["train", "configs/lenet.yaml", "--workers", "13", "--iterations", "1", "--no-progress",
                 "--out", str(tmp_path / "run")]) == 2
    assert ("train.data.workers: 13 worker processes on a machine with 2 usable cores; expected at most 12"
            in capsys.readouterr().err)


def test_ctrl_c_at_a_terminal_stops_a_run_with_workers_cleanly(tmp_path):
    root = make_folder(tmp_path / "images")
    (tmp_path / "net.yaml").write_text(
        "name: tiny\ninput: {shape: [3, 16, 16], classes: 3}\n"
        f"train: {{batch: 4, iterations: 100000, data: {{type: folder, path: {root}, workers: 2}}}}\n"
        "network:\n  - {type: GlobalAvgPool}\n  - {type: Linear, out_features: 3}\n  - {type: SoftmaxCrossEntropy}\n")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "snrt", "train", str(tmp_path / "net.yaml"), "--out", str(out),
                             "--no-progress", "--no-eval"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    metrics, deadline = out / "metrics.jsonl", time.time() + 120
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the trainer and its workers, one process group
    output = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGINT, output
    assert "interrupted at iteration" in output and "Traceback" not in output and "KeyboardInterrupt" not in output


def test_workers_end_themselves_when_their_trainer_is_killed(tmp_path):
    script = tmp_path / "trainer.py"  # a trainer that starts two workers, says their ids, then waits to be killed
    script.write_text("import os, sys, time\nimport numpy as np\nfrom snrt.data import Dataset, Batches\n"
                      "from snrt.workers import WorkerBatches\nif __name__ == '__main__':\n"
                      "    data = Dataset(np.zeros((8, 1, 2, 2), np.float32), np.zeros(8, np.int64), 2, 'zeros')\n"
                      "    made = WorkerBatches(Batches(data, 2, 0, [0.0], [1.0], prefetch=False), 2)\n"
                      "    next(iter(made))\n"
                      "    print(*[p.pid for p in made.processes], flush=True)\n    time.sleep(600)\n")
    trainer = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=ROOT,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    pids = [int(p) for p in trainer.stdout.readline().split()]
    trainer.kill()
    trainer.wait()

    def running(pid):  # a zombie is done: whoever adopted it has not reaped it yet
        try:
            return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return False
    deadline = time.time() + 30
    while time.time() < deadline and any(running(p) for p in pids):
        time.sleep(0.1)
    alive = [p for p in pids if running(p)]
    for p in alive:  # not to leave them behind when the test fails
        os.kill(p, signal.SIGKILL)
    assert len(pids) == 2 and not alive
