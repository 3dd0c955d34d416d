"""Nothing lost: divergence, shared and reused output folders, signals, full disks, checkpoints
of other networks, and bad input that once ended in a traceback."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import snrt
import snrt.backends
from snrt.checkpoint import CheckpointError, NonFiniteError, load_checkpoint
from snrt.cli import main
from snrt.errors import DivergenceError
from snrt.runfolder import RunFolder, RunFolderError
from snrt.train import Trainer
from tests.test_data import DAMAGED_ZIP_HEADERS, damage_zip_header
from tests.test_train import SMALL_RESNET, small_config

LENET = "configs/lenet.yaml"
RUN = ["--data", "synthetic", "--batch", "8", "--no-progress", "--no-eval"]


def train(out, *extra):
    return main(["train", LENET, *RUN, "--out", str(out), *extra])


def iterations_in(out):
    return [json.loads(line)["iteration"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---- divergence ---------------------------------------------------------------------------
def test_divergence_stops_the_run_names_the_iteration_and_keeps_the_good_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "3") == 0
    good = (out / "checkpoint.npz").read_bytes()
    assert train(out, "--iterations", "200", "--resume", "--lr", "1e6") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "training diverged at iteration" in err and "the last good one is kept" in err
    assert "Traceback" not in err and "RuntimeWarning" not in err
    assert (out / "checkpoint.npz").read_bytes() == good
    assert max(iterations_in(out)) < 199  # stopped early
    assert all(np.isfinite(json.loads(line)["loss"]) for line in (out / "metrics.jsonl").read_text().splitlines())


def test_trainer_raises_divergence_and_never_saves_non_finite_values(tmp_path):
    trainer = Trainer(snrt.load_config(SMALL_RESNET, {"train.optimizer.lr": 1e8}))
    path = tmp_path / "ckpt.npz"
    with pytest.raises(DivergenceError, match="diverged at iteration"):
        trainer.fit(iterations=100, checkpoint=path)
    assert not path.exists()
    with pytest.raises(NonFiniteError, match="NaN or infinite"):
        trainer.save(path)  # the state the divergence left is refused too
    assert not path.exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("flag, value", [("--lr", "nan"), ("--lr", "inf"), ("--lr", "-inf")])
def test_non_finite_learning_rates_are_rejected(tmp_path, capsys, flag, value):
    assert train(tmp_path / "run", f"{flag}={value}") == 2
    assert "expected a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("key", ["train.optimizer.momentum", "train.optimizer.weight_decay", "train.schedule.gamma"])
def test_every_float_setting_rejects_nan_and_inf(key):
    for value in (float("nan"), float("inf")):
        with pytest.raises(snrt.ConfigError, match="expected a finite number"):
            snrt.load_config(LENET, {key: value})


def test_an_all_nan_checkpoint_is_refused_by_eval(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1") == 0
    with np.load(out / "checkpoint.npz") as data:
        arrays = {k: data[k] for k in data.files}
    arrays = {k: (np.full_like(v, np.nan) if k.endswith("weight") else v) for k, v in arrays.items()}
    np.savez(out / "nan.npz", **arrays)
    assert main(["eval", LENET, *RUN[:4], "--checkpoint", str(out / "nan.npz")]) == 2
    assert "NaN or infinite" in capsys.readouterr().err


# ---- output folders -----------------------------------------------------------------------
def test_an_earlier_run_is_never_overwritten_without_being_asked(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "4") == 0
    before = (out / "checkpoint.npz").read_bytes()
    assert train(out, "--iterations", "2") == 2
    assert "holds an earlier run (4 iterations" in " ".join(capsys.readouterr().err.split())
    assert (out / "checkpoint.npz").read_bytes() == before
    assert train(out, "--iterations", "2", "--overwrite") == 0
    assert iterations_in(out) == [0, 1]
    assert load_checkpoint(out / "checkpoint.npz")[1]["iteration"] == 2


@pytest.mark.parametrize("mistake, says", [
    (["--data", "npz:missing.npz"], "missing.npz: train.data.path: no such file"),
    (["--init-from", "missing.pt"], "missing.pt: no such weights file"),
], ids=["data", "weights"])
def test_overwrite_keeps_the_earlier_run_when_the_new_one_cannot_start(tmp_path, capsys, mistake, says):
    out = tmp_path / "run"
    assert train(out, "--iterations", "2") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"}
    capsys.readouterr()
    assert train(out, "--iterations", "2", "--overwrite", *mistake) == 2
    assert says in " ".join(capsys.readouterr().err.split())
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".lock"} == before


def test_resuming_another_run_into_a_folder_that_holds_one_starts_it_over_only_when_asked(tmp_path, capsys):
    source, out = tmp_path / "source", tmp_path / "run"
    assert train(source, "--iterations", "2") == 0
    assert train(out, "--iterations", "4") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    for asked in ("2", "3"):  # nothing to do, or a run: the folder's own run is kept either way
        assert train(out, "--iterations", asked, "--resume", str(source)) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"{out}: holds an earlier run (4 iterations in metrics.jsonl), not the one of {source / 'checkpoint.npz'}" \
               " that --resume continues; start over here with --overwrite" in err
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    capsys.readouterr()
    assert train(out, "--iterations", "2", "--resume", str(source), "--overwrite") == 0  # nothing to do: kept
    said = " ".join(capsys.readouterr().out.split())
    assert f"nothing to do: the run of {source / 'checkpoint.npz'} is at iteration 2 already" in said
    assert f"({out} is left as it was)" in said
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert train(out, "--iterations", "3", "--resume", str(source), "--overwrite") == 0
    assert iterations_in(out) == [2] and load_checkpoint(out / "checkpoint.npz")[1]["iteration"] == 3


def test_resume_and_overwrite_of_the_same_run_are_refused_together(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "2") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for resume in ([], [str(out)], [str(out / "checkpoint.npz")]):
        assert train(out, "--iterations", "3", "--overwrite", "--resume", *resume) == 2
        assert "--overwrite would delete the checkpoint that --resume continues" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_folder_in_use_by_another_run_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    with RunFolder(out):
        assert train(out, "--iterations", "1") == 2
        assert f"another snrt run (process {os.getpid()})" in " ".join(capsys.readouterr().err.split())
        with pytest.raises(RunFolderError, match="another snrt run"):
            RunFolder(out)
    assert train(out, "--iterations", "1") == 0  # free again once the first let go


def test_a_folder_on_a_file_system_without_locks_is_not_called_in_use(tmp_path, capsys, monkeypatch):
    import fcntl

    def no_locks(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert train(tmp_path / "run", "--iterations", "1") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / 'run'}: cannot lock this output folder (.lock: No locks available)" in err
    assert "another snrt run" not in err


def test_resume_cuts_metrics_back_to_the_checkpoint_so_no_iteration_repeats(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--iterations", "4") == 0
    with (out / "metrics.jsonl").open("a") as f:  # iterations a killed run logged after its checkpoint
        f.write(json.dumps({"iteration": 4, "loss": 1.0}) + "\n" + '{"iteration": 5, "lo')
    assert train(out, "--iterations", "6", "--resume") == 0
    assert iterations_in(out) == list(range(6))


def test_a_damaged_byte_in_metrics_costs_its_own_line_on_resume_not_the_others(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--iterations", "3") == 0
    with (out / "metrics.jsonl").open("ab") as f:
        f.write(b'{"iteration": 1, "loss": \xff}\n')
    assert train(out, "--iterations", "4", "--resume") == 0
    assert iterations_in(out) == [0, 1, 2, 3]


def test_resuming_a_run_already_at_its_iterations_leaves_the_folder_as_it_was(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "2") == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    for iterations in ("1", "2"):
        assert train(out, "--iterations", iterations, "--resume") == 0
        out_text = " ".join(capsys.readouterr().out.split())
        assert f"nothing to do: the run of {out / 'checkpoint.npz'} is at iteration 2 already" in out_text
        assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_stale_checkpoint_temporaries_are_removed_when_a_run_starts(tmp_path):
    out = tmp_path / "run"
    assert train(out, "--iterations", "2") == 0
    stale = out / ".checkpoint.npz.k1ll3d.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert train(out, "--iterations", "3", "--resume") == 0
    assert not stale.exists()


@pytest.mark.parametrize("case", ["a file", "cannot create"])
def test_unusable_output_folders_are_one_clear_error(tmp_path, capsys, monkeypatch, case):
    out = tmp_path / "out"
    if case == "a file":
        out.write_text("not a folder")
        words = "is an existing file"
    else:
        def refuse(self, *args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        monkeypatch.setattr(type(out), "mkdir", refuse)
        words = "cannot use this output folder (Permission denied)"
    assert train(out, "--iterations", "1") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert words in err and "Traceback" not in err


# ---- signals ------------------------------------------------------------------------------
def _start(out, iterations="100000"):
    command = [sys.executable, "-m", "snrt", "train", LENET, *RUN, "--out", str(out), "--iterations", iterations]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=60):
    """The output of `proc` once it exits; a failure with the output so far if it does not."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"still running {timeout} s after the signal; its output:\n{proc.communicate()[0][-3000:]}")


def _wait_for_iterations(out, count, timeout=60):
    metrics, deadline = out / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < count):
        time.sleep(0.05)


def test_sigterm_saves_a_checkpoint_and_exits_143(tmp_path):
    out = tmp_path / "run"
    proc = _start(out)
    _wait_for_iterations(out, 3)
    proc.send_signal(signal.SIGTERM)
    output = _finish(proc)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "interrupted at iteration" in output and "Traceback" not in output
    done = load_checkpoint(out / "checkpoint.npz")[1]["iteration"]
    assert done >= 3 and iterations_in(out) == list(range(done))


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_start_up_exits_quietly(tmp_path, signum):
    proc = _start(tmp_path / "run")
    time.sleep(0.5)  # the command is still loading its modules or building the plan
    proc.send_signal(signum)
    output = _finish(proc)
    assert proc.returncode == 128 + signum, output
    assert "Traceback" not in output and "KeyboardInterrupt" not in output


# ---- disks --------------------------------------------------------------------------------
def test_a_full_disk_while_taking_the_output_folder_is_named(tmp_path, capsys, monkeypatch):
    import snrt.runfolder

    class Full:
        """The lock file of a full disk: opened, but its note of the owner cannot be written."""

        def __init__(self, path, mode):
            self.file = open(path, mode)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def flush(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(snrt.runfolder, "open", Full, raising=False)
    assert train(tmp_path / "run", "--iterations", "1") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {tmp_path / 'run'}: cannot use this output folder (.lock: No space left on device)")
    assert "Traceback" not in err


def test_a_full_disk_while_writing_metrics_stops_with_the_checkpoint_saved(tmp_path, capsys, monkeypatch):
    class FillsUp:
        def __init__(self, file):
            self.file, self.lines = file, 0

        def write(self, text):
            self.lines += 1
            if self.lines > 2:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.file.write(text)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    open_metrics = RunFolder.open_metrics
    monkeypatch.setattr(RunFolder, "open_metrics", lambda self: FillsUp(open_metrics(self)))
    out = tmp_path / "run"
    assert train(out, "--iterations", "50") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "cannot write metrics (No space left on device)" in err and "continue with --resume" in err
    assert load_checkpoint(out / "checkpoint.npz")[1]["iteration"] == 3
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == []


def failing_path_method(monkeypatch, method, chosen, error, partial=None):
    """Path.`method` (read_text or write_text) raises OSError `error` (errno, text) for the paths
    `chosen(path)` picks, after writing `partial` to them when given (a disk filling up)."""
    original = getattr(Path, method)

    def fault(self, *args, **kwargs):
        if not chosen(self):
            return original(self, *args, **kwargs)
        if partial is not None:
            original(self, partial)
        raise OSError(*error, str(self))
    monkeypatch.setattr(Path, method, fault)


@pytest.mark.parametrize("method, chosen, error, partial, says", [
    ("write_text", lambda p: p.name.startswith(".metrics.jsonl"), (errno.ENOSPC, "No space left on device"),
     '{"iteration": 0', "metrics.jsonl: cannot write (No space left on device); the run is as it was, at iteration 3"),
    ("read_text", lambda p: p.name == "metrics.jsonl", (errno.EIO, "Input/output error"), None,
     "metrics.jsonl: cannot read it to cut it back to iteration 3 (Input/output error); the run is as it was"),
], ids=["full disk", "unreadable"])
def test_metrics_that_cannot_be_cut_back_on_resume_are_kept_whole(tmp_path, capsys, monkeypatch, method, chosen,
                                                                   error, partial, says):
    out = tmp_path / "run"
    assert train(out, "--iterations", "3") == 0
    before = (out / "metrics.jsonl").read_bytes()
    failing_path_method(monkeypatch, method, chosen, error, partial)
    assert train(out, "--iterations", "5", "--resume") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{out / says}" in err
    assert "Traceback" not in err and ".tmp" not in err
    monkeypatch.undo()
    assert (out / "metrics.jsonl").read_bytes() == before
    assert sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp")) == []


def test_a_full_disk_while_writing_a_checkpoint_keeps_the_previous_one(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    assert train(out, "--iterations", "2") == 0
    before = (out / "checkpoint.npz").read_bytes()

    def full(file, array, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(np.lib.format, "write_array", full)
    assert train(out, "--iterations", "4", "--resume") == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "cannot write the checkpoint (No space left on device)" in err and "previous checkpoint is kept" in err
    assert (out / "checkpoint.npz").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_full_disk_with_no_checkpoint_names_each_file_and_says_nothing_was_kept(tmp_path, capsys, monkeypatch):
    """As a real full disk does: a metrics line goes into the file's buffer, its flush fails and
    so does the flush at close; then the checkpoint cannot be written either."""
    class FullDisk:
        def __init__(self, file):
            self.file, self.lines, self.unflushed = file, 0, False

        def write(self, text):
            self.lines += 1
            self.unflushed = self.lines > 2
            return len(text) if self.unflushed else self.file.write(text)

        def flush(self):
            if self.unflushed:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.file.flush()

        def close(self):
            self.file.close()
            self.flush()

    def full(file, array, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    open_metrics = RunFolder.open_metrics
    monkeypatch.setattr(RunFolder, "open_metrics", lambda self: FullDisk(open_metrics(self)))
    monkeypatch.setattr(np.lib.format, "write_array", full)
    out = tmp_path / "run"
    assert train(out, "--iterations", "50") == 2
    expected = (f"{out / 'metrics.jsonl'}: cannot write metrics (No space left on device); {out / 'checkpoint.npz'}: "
                "cannot write the checkpoint (No space left on device); there was no earlier checkpoint: nothing is "
                "kept; the run had reached iteration 3")
    assert "".join(expected.split()) in "".join(capsys.readouterr().err.split())  # the console wraps long lines
    assert not (out / "checkpoint.npz").exists() and not [p for p in out.iterdir() if p.name.endswith(".tmp")]


def test_a_summary_that_cannot_be_written_names_itself_and_the_checkpoint_kept(tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    failing_path_method(monkeypatch, "write_text", lambda p: "summary" in p.name,
                        (errno.ENOSPC, "No space left on device"))
    assert train(out, "--iterations", "2") == 2
    expected = (f"{out / 'summary.json'}: cannot write (No space left on device); the checkpoint of iteration 2 is "
                f"saved to {out / 'checkpoint.npz'}")
    assert "".join(expected.split()) in "".join(capsys.readouterr().err.split())
    assert load_checkpoint(out / "checkpoint.npz")[1]["iteration"] == 2 and not list(out.glob(".*.tmp"))


def test_errors_about_the_command_come_before_errors_about_the_output_folder(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1") == 0
    capsys.readouterr()
    assert train(out, "--iterations", "1", "--budget", "1KiB") == 2  # the budget, not the earlier run
    err = " ".join(capsys.readouterr().err.split())
    assert "memory.budget" in err and "earlier run" not in err
    if not snrt.backends.cuda_available():
        assert train(out, "--iterations", "1", "--backend", "cuda") == 2  # the missing GPU
        err = " ".join(capsys.readouterr().err.split())
        assert "the cuda backend is not available" in err and "earlier run" not in err


def test_a_heldout_evaluation_that_is_not_finite_is_one_line_not_a_number(tmp_path, capsys):
    """BatchNorm running statistics after one iteration at batch 2 overflow ResNet-50's held-out
    loss: no NumPy warning, one line with the cause, null in summary.json; eval says the same."""
    import warnings

    out = tmp_path / "run"
    shape = ["--image-size", "8", "--batch", "2"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "configs/resnet50.yaml", *shape, "--iterations", "1", "--no-progress",
                     "--out", str(out)]) == 0
        printed = capsys.readouterr().out
        assert main(["eval", "configs/resnet50.yaml", *shape, "--checkpoint", str(out / "checkpoint.npz")]) == 2
    assert [str(w.message) for w in caught] == []
    note = "the held-out evaluation is not finite (loss nan): the running statistics of its normalization layers"
    assert f"note: {note}" in " ".join(printed.split())
    assert note in " ".join(capsys.readouterr().err.split())

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    summary = json.loads((out / "summary.json").read_text(), parse_constant=refuse)
    assert summary["heldout_loss"] is None and summary["heldout_accuracy"] is None
    assert summary["heldout_note"].startswith(note) and "train longer or with a larger batch" in summary["heldout_note"]


# ---- checkpoints bound to their network ---------------------------------------------------
def test_a_checkpoint_of_another_structure_with_the_same_tensors_is_refused(tmp_path):
    path = tmp_path / "ckpt.npz"
    Trainer(small_config()).save(path)
    layers = [dict(entry) for entry in SMALL_RESNET["network"]]
    layers[0] = {**layers[0], "stride": 2}  # the first Conv2d: the same weights, another function
    other = {**SMALL_RESNET, "network": layers}
    with pytest.raises(CheckpointError, match="made for another network"):
        Trainer(snrt.load_config(other)).restore(path)


def test_resuming_at_another_batch_or_seed_says_what_changes(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "2") == 0
    assert main(["train", LENET, *RUN[:2], "--batch", "4", *RUN[4:], "--out", str(out), "--iterations", "3",
                 "--resume"]) == 0
    assert "trained at batch 8, resuming at batch 4" in " ".join(capsys.readouterr().out.split())
    assert train(out, "--iterations", "4", "--resume", "--seed", "5") == 0  # and back at batch 8
    assert ("trained at batch 4, resuming at batch 8: 2x as many samples per iteration; and trained with seed 0, "
            "resuming with seed 5: another order of the data") in " ".join(capsys.readouterr().out.split())


def test_resuming_in_another_precision_says_so(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1", "--precision", "bf16") == 0
    assert load_checkpoint(out / "checkpoint.npz")[1]["precision"] == "bf16"
    assert train(out, "--iterations", "2", "--resume") == 0
    assert ("note: the checkpoint was trained in bf16, resuming in fp32: other rounding, and a result that differs "
            "from an uninterrupted run") in " ".join(capsys.readouterr().out.split())


def test_checkpoint_saving_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """The write fetches a tensor only after the previous one is written."""
    trainer = Trainer(small_config())
    events = []
    runtime_tensors = trainer.runtime.persistent_tensors

    def traced(roles):
        for node, name, fetch in runtime_tensors(roles):
            yield node, name, lambda fetch=fetch, key=f"{node}:{name}": (events.append(("fetch", key)), fetch())[1]

    write_array = np.lib.format.write_array

    def write(file, array, **kwargs):
        events.append(("write", None))
        write_array(file, array, **kwargs)

    monkeypatch.setattr(trainer.runtime, "persistent_tensors", traced)
    monkeypatch.setattr(np.lib.format, "write_array", write)
    trainer.save(tmp_path / "ckpt.npz")
    kinds = [kind for kind, _ in events]
    assert kinds[0] == "write"  # the metadata
    assert kinds[1:] == ["fetch", "write"] * ((len(kinds) - 1) // 2) and len(kinds) > 3


# ---- bad input that once ended in a traceback ---------------------------------------------
def test_a_npy_file_given_as_a_checkpoint_is_refused(tmp_path, capsys):
    np.save(tmp_path / "weights.npy", np.zeros(3))
    assert main(["eval", LENET, *RUN[:4], "--checkpoint", str(tmp_path / "weights.npy")]) == 2
    assert "single array" in capsys.readouterr().err


@pytest.mark.parametrize("offset, value", DAMAGED_ZIP_HEADERS, ids=["unknown compression", "encrypted"])
def test_a_checkpoint_with_a_damaged_zip_header_is_refused_in_one_line(tmp_path, offset, value):
    path = tmp_path / "checkpoint.npz"
    np.savez(path, weights=np.zeros(3))
    damage_zip_header(path, offset, value)
    with pytest.raises(CheckpointError, match="checkpoint.npz: not a readable checkpoint"):
        load_checkpoint(path)


@pytest.mark.parametrize("name, content", [("weights.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      "),
                                           ("notes.txt", b"a text")])
def test_a_file_of_another_kind_given_as_a_checkpoint_never_suggests_unsafe_loading(tmp_path, capsys, name, content):
    (tmp_path / name).write_bytes(content)
    assert main(["eval", LENET, *RUN[:4], "--checkpoint", str(tmp_path / name)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{tmp_path / name}: not a readable checkpoint (not the .npz archive snrt train writes" in err
    assert "pickle" not in err and "unsafe" not in err


def rewritten(checkpoint, path, meta=None, **arrays):
    """A copy of `checkpoint` at `path`, its metadata updated with `meta`, its arrays with `arrays`."""
    saved, old = load_checkpoint(checkpoint)
    saved.update(arrays)
    np.savez(path, __meta__=np.frombuffer(json.dumps({**old, **(meta or {})}).encode(), np.uint8), **saved)
    return path


@pytest.mark.parametrize("meta, says", [({"batch": 0}, "batch is 0"), ({"batch": "8"}, "batch is '8'"),
                                        ({"seed": [1]}, "seed is [1]"), ({"iteration": 3.0}, "iteration is 3.0"),
                                        ({"loss_scale": {"scale": "x"}}, "loss_scale is {'scale': 'x'}")])
def test_a_checkpoint_whose_metadata_is_damaged_is_one_line(tmp_path, capsys, meta, says):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1") == 0
    damaged = rewritten(out / "checkpoint.npz", tmp_path / "damaged.npz", meta)
    assert main(["eval", LENET, *RUN[:4], "--checkpoint", str(damaged)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{damaged}: the metadata's {says}" in err and "Traceback" not in err


@pytest.mark.parametrize("dtype", ["int64", "bool", "complex64", "<U8", "datetime64[s]"])
def test_a_checkpoint_tensor_that_is_not_floating_point_is_refused_not_cast(tmp_path, capsys, dtype):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1") == 0
    weight = load_checkpoint(out / "checkpoint.npz")[0]["conv2d0:weight"]
    damaged = rewritten(out / "checkpoint.npz", tmp_path / "damaged.npz", **{"conv2d0:weight": weight.astype(dtype)})
    for command in (["eval", LENET, *RUN[:4], "--checkpoint", str(damaged)],
                    ["export", str(damaged), "--out", str(tmp_path / "w.safetensors")]):
        assert main(command) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert f"{damaged}: conv2d0:weight holds {np.dtype(dtype)} values, not the floating-point" in err
    assert not (tmp_path / "w.safetensors").exists()


@pytest.mark.parametrize("what, says", [("checkpoint", "not a readable checkpoint (Permission denied)"),
                                        ("data", "train.data.path: cannot read the file (Permission denied)"),
                                        ("weights", "cannot read the weights file (Permission denied)")])
def test_a_file_that_cannot_be_read_says_why_not_that_it_is_damaged(tmp_path, capsys, monkeypatch, what, says):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1") == 0
    path = {"checkpoint": out / "checkpoint.npz", "data": tmp_path / "data.npz", "weights": tmp_path / "w.pt"}[what]
    np.savez(tmp_path / "data.npz", x=np.zeros((16, 1, 8, 8)), y=np.zeros(16, int))
    assert main(["export", str(out), "--format", "torch", "--out", str(tmp_path / "w.pt")]) == 0
    real_open = open

    def unreadable(file, *args, **kwargs):  # as a file without read permission is to a user who is not root
        if os.fspath(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr("builtins.open", unreadable)
    command = {"checkpoint": ["eval", LENET, *RUN[:4], "--checkpoint", str(path)],
               "data": ["train", LENET, *RUN[2:], "--data", f"npz:{path}", "--out", str(tmp_path / "new")],
               "weights": ["train", LENET, *RUN, "--init-from", str(path), "--out", str(tmp_path / "new")]}[what]
    capsys.readouterr()
    assert main(command) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith(f"error: {path}: ") and says in err and "corrupt" not in err and "state dict" not in err


def npz_claiming(path, key, shape, **arrays):
    """An .npz at `path` of `arrays` and a member `key` whose header claims `shape` (float32), with
    a few bytes of data: an archive damaged where an array says its size."""
    import io
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        for name, array in arrays.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, array)
        header = io.BytesIO()
        np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
        archive.writestr(f"{key}.npy", header.getvalue() + b"\0" * 64)
    return path


def test_an_array_size_beyond_memory_in_a_damaged_file_names_the_file_not_the_run(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--iterations", "1") == 0
    arrays, meta = load_checkpoint(out / "checkpoint.npz")
    damaged = npz_claiming(tmp_path / "damaged.npz", "conv2d0:weight", (2**40,), **{k: v for k, v in arrays.items()
                                                                                     if k != "conv2d0:weight"},
                           __meta__=np.frombuffer(json.dumps(meta).encode(), np.uint8))
    data = npz_claiming(tmp_path / "data.npz", "x", (2**40, 1, 8, 8), y=np.zeros(16, int))
    capsys.readouterr()
    for command, path in ((["eval", LENET, *RUN[:4], "--checkpoint", str(damaged)], damaged),
                          (["train", LENET, *RUN[2:], "--data", f"npz:{data}", "--out", str(tmp_path / "new")], data)):
        assert main(command) == 2
        err = " ".join(capsys.readouterr().err.split())
        assert err.startswith(f"error: {path}: ") and "Unable to allocate" in err and "--batch" not in err


@pytest.mark.parametrize("budget", ["1e400", "99999999999EiB"])
def test_absurd_budgets_are_one_clear_error(tmp_path, capsys, budget):
    assert train(tmp_path / "run", "--budget", budget) == 2
    err = capsys.readouterr().err
    assert "memory.budget" in err and "Traceback" not in err


@pytest.mark.parametrize("arrays, words", [
    ({"x": np.zeros((0, 1, 8, 8)), "y": np.zeros(0, int), "x_test": np.zeros((4, 1, 8, 8)), "y_test": np.zeros(4, int)},
     "no samples to train on"),
    ({"x": np.zeros((8, 1, 8, 8)), "y": np.zeros(8, int), "x_test": np.zeros((0, 1, 8, 8)), "y_test": np.zeros(0, int)},
     "no samples to evaluate on"),
])
def test_empty_npz_splits_are_refused(tmp_path, arrays, words):
    np.savez(tmp_path / "data.npz", **arrays)
    config = snrt.load_config(LENET, {"input.shape": [1, 8, 8], "train.data": {"type": "npz", "path": str(tmp_path / "data.npz")}})
    with pytest.raises(snrt.ConfigError, match=words):
        Trainer(config)


def test_paths_are_printed_as_given_never_read_as_markup(tmp_path, capsys):
    folder = tmp_path / "runs[bold]" / "[red]x"
    folder.mkdir(parents=True)
    config = folder / "net[1].yaml"
    config.write_text("network: [")
    assert main(["train", str(config), "--no-progress"]) == 2
    assert str(config) in " ".join(capsys.readouterr().err.replace("\n", "").split())


def test_a_network_too_large_for_memory_is_one_clear_error(tmp_path, capsys):
    """snrt plan accepts a 10^12-channel layer (its plan says what it needs); training it is
    refused with the way out, not a MemoryError traceback."""
    config = tmp_path / "wide.yaml"
    config.write_text(open(LENET).read().replace("out_channels: 16", "out_channels: 1000000000000", 1))
    assert "1000000000000" in config.read_text()
    assert main(["plan", str(config)]) == 0
    assert main(["train", str(config), *RUN, "--out", str(tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not enough memory for this run" in err and "Traceback" not in err


def test_a_batch_whose_arena_no_machine_addresses_is_the_same_clear_error(tmp_path, capsys):
    """A batch of 10^23 plans an arena of 10^28 bytes, past what an allocator can be asked for
    (mmap's OverflowError, NumPy's ValueError): the backend refuses it as memory it cannot have."""
    from snrt.backends.numpy_backend import NumpyBackend

    for sizes in ((2**70, 0), (0, 2**70)):
        with pytest.raises(MemoryError, match="of this plan would hold 1,180,591,620,717,411,303,424 bytes, more than"):
            NumpyBackend(*sizes)
    assert main(["train", LENET, *RUN, "--batch", str(10**23), "--out", str(tmp_path / "run")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "not enough memory for this run" in err and "Traceback" not in err


def test_a_host_tensor_larger_than_the_machine_is_refused_before_numpy_is_asked(tmp_path):
    """On a host that overcommits memory NumPy hands out a 4 TB array and the kernel kills the
    process while it is being filled: the initial values refuse it first, naming the tensor."""
    from snrt.init import each_initial_state, initial_value
    from snrt.layers.base import ParamSpec

    with pytest.raises(MemoryError, match="conv1:weight needs 4000000000000 bytes of host memory"):
        initial_value(ParamSpec((10 ** 12,), "he_normal"), 0, "conv1", "weight")
    config = tmp_path / "wide.yaml"
    config.write_text(open(LENET).read().replace("out_channels: 16", "out_channels: 1000000000000", 1))
    with pytest.raises(MemoryError, match="running_mean needs 4000000000000 bytes"):
        dict(each_initial_state(snrt.load_config(config).graph))


def test_the_gpu_hint_keeps_its_brackets(tmp_path, capsys):
    """Console markup once ate '[gpu]' from the install hint."""
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here: the cuda backend's error is another one")
    except ImportError:
        pass
    assert main(["train", LENET, *RUN, "--backend", "cuda", "--out", str(tmp_path / "run")]) == 2
    assert "pip install 'snrt[gpu]'" in " ".join(capsys.readouterr().err.split())


def test_a_checkpoint_of_another_optimizer_is_refused(tmp_path):
    path = tmp_path / "ckpt.npz"
    Trainer(small_config()).save(path)
    with pytest.raises(CheckpointError, match="trained with sgd, this run uses adam"):
        Trainer(small_config(optimizer={"type": "adam", "lr": 0.001})).restore(path)


def test_a_checkpoint_of_another_optimizer_is_evaluated(tmp_path, capsys):
    """Evaluation reads the parameters and statistics alone: the optimizer that trained them
    does not matter (resuming still needs the same one)."""
    adam = tmp_path / "adam.yaml"
    adam.write_text(Path(LENET).read_text().replace(
        "optimizer: {type: sgd, lr: 0.1, momentum: 0.9, nesterov: false, weight_decay: 0.0001}",
        "optimizer: {type: adam, lr: 0.001}"))
    out = tmp_path / "run"
    assert main(["train", str(adam), *RUN, "--out", str(out), "--iterations", "1"]) == 0
    capsys.readouterr()
    assert main(["eval", LENET, *RUN[:4], "--checkpoint", str(out)]) == 0
    assert "lenet at iteration 1: held-out loss" in capsys.readouterr().out
    assert train(out, "--iterations", "2", "--resume") == 2
    assert "trained with adam, this run uses sgd" in capsys.readouterr().err


def test_a_run_that_cannot_start_leaves_no_output_folder_it_made(tmp_path, capsys):
    (tmp_path / "store").write_text("a file, not a folder")
    assert train(tmp_path / "run", "--host-store", str(tmp_path / "store"), "--policy", "offload") == 2
    assert "Traceback" not in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
    (tmp_path / "kept").mkdir()  # a folder that was there stays (with the lock file runs take)
    assert train(tmp_path / "kept", "--host-store", str(tmp_path / "store"), "--policy", "offload") == 2
    assert [p.name for p in (tmp_path / "kept").iterdir()] == [".lock"]
