"""`mpiexec -n 2 snrt train`: processes on MPI (the `mpi` extra; the test extra installs it).

Exactness: N ranks' run equals, bit for bit, one process that runs the N micro-batches
(each with its own BatchNorm statistics, one thread each) and sums their gradients in rank
order (tests/threadgroup.py), and two runs are bit-identical.
"""

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from snrt.checkpoint import load_checkpoint
from snrt.cli import _overrides, build_parser
from snrt.config import load_config
from snrt.train import Trainer
from tests.threadgroup import run_ranks

MPIEXEC = Path(sys.executable).with_name("mpiexec")
REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not MPIEXEC.exists() or importlib.util.find_spec("mpi4py") is None,
                                reason="needs mpi4py and MPICH's mpiexec (pip install -e '.[mpi]')")
CONFIG = str(REPO / "configs" / "cifar_resnet20.yaml")
FLAGS = ["--batch", "8", "--image-size", "16", "--threads", "1", "--no-progress", "--no-eval"]


def mpi_train(ranks, out, *extra, timeout=180):
    return subprocess.run([str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "snrt", "train", CONFIG, *FLAGS,
                           "--out", str(out), *extra], capture_output=True, text=True, timeout=timeout, cwd=REPO)


def checkpoint_of(out):
    arrays, meta = load_checkpoint(out / "checkpoint.npz")
    return arrays, meta


def losses_of(out):
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def reference(iterations, ranks=2):
    """Rank 0's (losses, tensors) of the same run, the ranks being threads of this process."""
    args = build_parser().parse_args(["train", CONFIG, *FLAGS, "--iterations", str(iterations)])
    config = load_config(CONFIG, _overrides(args))

    def work(group):
        trainer = Trainer(config, group=group)
        history = trainer.fit()
        tensors = {f"{node}:{name}": fetch() for node, name, fetch in
                   trainer.runtime.persistent_tensors(("parameter", "optimizer_state", "state"))}
        return [m.loss for m in history], tensors
    with threadpool_limits(1):
        return run_ranks(ranks, work)[0]


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_equal_the_rank_order_reference_bit_for_bit_and_repeat_exactly(ranks, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for out in (first, second):
        done = mpi_train(ranks, out, "--iterations", "3")
        assert done.returncode == 0, done.stderr
    assert f"{ranks} ranks, batch {8 // ranks} each" in done.stdout
    assert done.stdout.count("summary") == 1  # rank 0 alone prints
    losses, tensors = reference(3, ranks)
    arrays, meta = checkpoint_of(first)
    again, _ = checkpoint_of(second)
    assert meta["iteration"] == 3 and meta["batch"] == 8
    assert losses_of(first) == losses == losses_of(second)
    assert sorted(arrays) == sorted(tensors)
    for key, value in tensors.items():
        assert np.array_equal(arrays[key], value), key
        assert np.array_equal(again[key], value), key


def test_a_two_rank_checkpoint_resumes_exactly_with_two_ranks_and_runs_on_with_one(tmp_path):
    straight, resumed, alone = tmp_path / "straight", tmp_path / "resumed", tmp_path / "alone"
    assert mpi_train(2, straight, "--iterations", "4").returncode == 0
    assert mpi_train(2, resumed, "--iterations", "2").returncode == 0
    (alone).mkdir()
    (alone / "checkpoint.npz").write_bytes((resumed / "checkpoint.npz").read_bytes())
    done = mpi_train(2, resumed, "--iterations", "4", "--resume")
    assert done.returncode == 0, done.stderr
    a, _ = checkpoint_of(straight)
    b, meta = checkpoint_of(resumed)
    assert meta["iteration"] == 4
    assert all(np.array_equal(a[k], b[k]) for k in a)
    one = subprocess.run([sys.executable, "-m", "snrt", "train", CONFIG, *FLAGS, "--out", str(alone), "--resume",
                          "--iterations", "3"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert one.returncode == 0, one.stderr
    assert "resumed from" in one.stdout and checkpoint_of(alone)[1]["iteration"] == 3


def test_bad_input_is_reported_once_by_rank_0(tmp_path):
    missing = subprocess.run([str(MPIEXEC), "-n", "2", sys.executable, "-m", "snrt", "train", str(tmp_path / "no.yaml"),
                              "--out", str(tmp_path / "run")], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert missing.returncode == 2
    assert missing.stderr.count("error:") == 1 and "no.yaml" in missing.stderr
    uneven = mpi_train(2, tmp_path / "uneven", "--batch", "7", "--iterations", "1")
    assert uneven.returncode == 2
    assert uneven.stderr.count("error:") == 1
    assert "must split evenly over the 2 ranks" in " ".join(uneven.stderr.split())  # as wrapped for the terminal


@pytest.mark.parametrize("whom, signum", [("mpiexec", signal.SIGINT), ("rank 1", signal.SIGTERM)])
def test_a_signal_stops_every_rank_after_the_same_iteration_with_a_checkpoint(whom, signum, long_job):
    out, job = long_job
    # mpiexec forwards a signal to every rank; a batch system may also stop just one process
    os.kill(job.pid if whom == "mpiexec" else _rank_pid(out, 1), signum)
    stdout, _ = job.communicate(timeout=60)
    assert job.returncode == 128 + signum
    assert "interrupted at iteration" in stdout
    _, meta = checkpoint_of(out)
    assert meta["iteration"] == len(losses_of(out))


def test_a_killed_rank_ends_the_whole_job_instead_of_hanging(long_job):
    out, job = long_job
    os.kill(_rank_pid(out, 1), signal.SIGKILL)
    job.communicate(timeout=60)  # a hang would time out here
    assert job.returncode != 0


@pytest.fixture
def long_job(tmp_path):
    """(run folder, Popen) of `mpiexec -n 2 snrt train` for many iterations, started and past its
    first one. Whatever of it still runs when the test ends is killed, so a failing test leaves
    no rank behind to load the machine."""
    out = tmp_path / "run"
    job = subprocess.Popen([str(MPIEXEC), "-n", "2", sys.executable, "-m", "snrt", "train", CONFIG, *FLAGS, "--out",
                            str(out), "--iterations", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, cwd=REPO)
    try:
        _wait_for_metrics(out, job)
        yield out, job
    finally:
        if job.poll() is None:
            job.kill()
        for pid in _processes_with(str(out)):  # the ranks, should mpiexec have left them
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        job.communicate()


def _rank_pid(out, rank):
    """The process id of rank `rank` of the run writing into `out`."""
    return next(pid for pid in _processes_with(str(out)) if _environment(pid).get("PMI_RANK") == str(rank))


def _wait_for_metrics(out, job, timeout=120):
    deadline = time.monotonic() + timeout
    while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
        assert job.poll() is None, job.communicate()
        assert time.monotonic() < deadline, "no iteration finished"
        time.sleep(0.2)


def _processes_with(text):
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    yield int(entry.name)
            except OSError:
                continue


def _environment(pid):
    try:
        pairs = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return {}
    return dict(p.decode(errors="replace").split("=", 1) for p in pairs if b"=" in p)
