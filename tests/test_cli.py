"""The command line as a user meets it: inspect, plan, train, eval, Ctrl-C and resume."""

import errno
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import snrt

from snrt.backends import cuda_available
from snrt.cli import main
from snrt.config import with_settings

LENET = "configs/lenet.yaml"
SYNTHETIC = ["--data", "synthetic"]


def test_inspect_json_reports_the_published_parameter_count(capsys):
    assert main(["inspect", "configs/resnet50.yaml", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == 25_557_032
    assert report["layers"] == sum(t["layers"] for t in report["by_type"])
    assert {t["type"] for t in report["by_type"]} >= {"Conv2d", "BatchNorm", "ReLU", "Add", "Linear"}


def test_inspect_json_with_layers_lists_every_node(capsys):
    assert main(["inspect", LENET, "--json"]) == 0
    totals = json.loads(capsys.readouterr().out)
    assert main(["inspect", LENET, "--json", "--layers"]) == 0
    report = json.loads(capsys.readouterr().out)
    nodes = report.pop("nodes")
    assert report == totals
    graph = snrt.load_config(LENET).graph
    assert [n["name"] for n in nodes] == list(graph.nodes) and len(nodes) == report["layers"]
    assert sum(n["params"] for n in nodes) == report["params"]
    assert nodes[-1]["inputs"] == list(graph[nodes[-1]["name"]].inputs) and nodes[0]["shape"] == [1, 8, 8]


def test_plan_prints_every_policy_and_writes_a_timeline(tmp_path, capsys):
    png = tmp_path / "timeline.png"
    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--policy", "superneurons",
                 "--png", str(png), "--json", "--layers"]) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)  # the JSON alone: the note on the picture goes to stderr
    assert f"timeline written to {png}" in captured.err
    assert [r["policy"] for r in report["policies"]] == ["none", "liveness", "recompute", "offload", "superneurons"]
    chosen = report["chosen"]
    assert chosen["policy"] == "superneurons" and chosen["copied_to_host_bytes"] > 0
    assert {"recompute", "offload", "unsaved"} <= set(chosen["layers"].values()) <= {"keep", "recompute", "offload",
                                                                                      "unsaved"}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


PLAN, TUNE = ["plan", LENET, "--policy", "liveness"], ["tune", LENET, "--budget", "2MiB", "--max-batch", "16",
                                                 "--overwrite"]


@pytest.mark.parametrize("command, flag, writes", [(PLAN, "--save", "write_text"), (PLAN, "--png", "savefig"),
                                                   (TUNE, "--out", "write_text"), (TUNE, "--png", "savefig")])
def test_an_output_on_a_full_disk_is_named_and_an_earlier_one_kept(tmp_path, capsys, monkeypatch, command, flag,
                                                                    writes):
    import matplotlib.figure

    path = tmp_path / ("picture.png" if flag == "--png" else "out.yaml")
    path.write_text("earlier")
    monkeypatch.setattr(*(("pathlib.Path.write_text", no_space) if writes == "write_text" else
                          (matplotlib.figure.Figure, "savefig", no_space)))
    out = ["--out", str(tmp_path / "tuned.yaml")] if command is TUNE and flag != "--out" else []
    assert main([*command, *out, flag, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}: cannot write (No space left on device)") and err.count("\n") == 1
    assert path.read_text() == "earlier" and set(tmp_path.iterdir()) <= {path, tmp_path / "tuned.yaml"}


@pytest.mark.parametrize("command, flag", [(PLAN, "--save"), (PLAN, "--png"), (TUNE, "--out"), (TUNE, "--png")])
def test_an_output_inside_a_file_is_named_as_asked_not_by_its_temporary(tmp_path, capsys, command, flag):
    (tmp_path / "file").write_text("")
    path = tmp_path / "file" / ("picture.png" if flag == "--png" else "out.yaml")
    out = ["--out", str(tmp_path / "tuned.yaml")] if command is TUNE and flag != "--out" else []
    assert main([*command, *out, flag, str(path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {path}: cannot write (Not a directory)")


@pytest.mark.parametrize("argv", [["inspect", LENET], ["inspect", LENET, "--json"], PLAN, [*PLAN, "--json"]])
def test_standard_output_on_a_full_disk_is_named(argv):
    """`snrt plan --json > out.json` on a full disk: /dev/full answers every write with ENOSPC."""
    proc = subprocess.run([sys.executable, "-m", "snrt", *argv], stdout=open("/dev/full", "w"), stderr=subprocess.PIPE,
                          text=True)
    assert proc.returncode == 2 and proc.stderr == "error: standard output: No space left on device\n"


def test_a_reader_of_standard_output_that_goes_away_ends_the_command_quietly():
    """`snrt inspect --json | head -1`: the rest of the output has nowhere to go, and no error to report."""
    proc = subprocess.Popen([sys.executable, "-m", "snrt", "inspect", "configs/resnet2500.yaml", "--json", "--layers"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "{\n"
    proc.stdout.close()
    assert proc.wait(timeout=120) == 1 and proc.stderr.read() == ""


def test_plan_json_with_steps_holds_the_steps_the_text_prints(capsys):
    args = ["plan", LENET, "--policy", "offload", "--steps"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert main([*args, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["chosen"]["steps"]
    printed = " ".join(printed.split())  # the console folds long lines
    assert len(steps) > 10 and all(" ".join(step.split()) in printed for step in steps)


def test_plan_under_a_budget_shows_the_plan_training_runs(capsys):
    from snrt.cli import policy_row
    from snrt.runtime import backend_planning
    from snrt.scheduler.planner import make_plan

    config, batch = snrt.load_config("configs/cifar_resnet56.yaml"), 8
    cpu = backend_planning("cpu")  # the CPU kernels' workspaces and measured times, as training plans with
    own = make_plan(config.graph, batch, "superneurons", **cpu)
    budget = 2 * own.arena_bytes  # room to grow into: the budgeted plan is another plan than the policy's own
    trained = policy_row(make_plan(config.graph, batch, "superneurons", budget=budget, **cpu), budget)
    assert trained["arena_bytes"] != own.arena_bytes
    assert main(["plan", "configs/cifar_resnet56.yaml", "--batch", str(batch), "--policy", "superneurons",
                 "--budget", str(budget), "--json", "--backend", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chosen"] == trained
    assert report["policies"][-1] == trained


def test_plan_shows_the_plan_a_training_run_makes_on_its_backend(capsys):
    """Every row is the plan `snrt train` makes on the same backend: sized for the kernels that
    backend runs (the CPU's compiled kernels take other workspaces than the layers' own code)."""
    from snrt.train import Trainer

    config = with_settings(snrt.load_config("configs/cifar_resnet20.yaml"), train={"batch": 8})
    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--json", "--backend", "cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and report["estimate"] is None
    for row in report["policies"]:
        trained = Trainer.plan_for(with_settings(config, memory={"policy": row["policy"]}), backend="cpu")
        assert (row["peak_bytes"], row["arena_bytes"], row["predicted_s"]) == \
            (trained.peak_bytes, trained.arena_bytes, trained.predicted_s), row["policy"]


@pytest.mark.skipif(cuda_available(), reason="this machine has a GPU: the plan is the device's, not an estimate")
def test_a_cuda_plan_without_a_gpu_is_an_estimate_and_says_so(capsys):
    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--json", "--backend", "cuda"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["backend"] == "cuda" and "estimate of the CUDA plan" in report["estimate"]
    assert err.startswith("note: no GPU to plan for here")
    cpu = report["policies"][0]["predicted_s"]
    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--json", "--backend", "cpu"]) == 0
    assert json.loads(capsys.readouterr().out)["policies"][0]["predicted_s"] > 5 * cpu  # the CUDA rates: faster


def test_plan_of_policy_auto_without_a_budget_is_refused_before_any_planning(capsys, monkeypatch):
    from snrt.scheduler import planner

    monkeypatch.setattr(planner, "each_plan", lambda *args, **kwargs: pytest.fail("planned the table first"))
    assert main(["plan", LENET, "--policy", "auto"]) == 2
    err = capsys.readouterr().err
    assert f"{LENET}: memory.budget: policy 'auto' picks the fastest plan within a budget" in err
    assert "Traceback" not in err


def test_plan_with_an_infeasible_budget_says_what_would_work(capsys):
    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--policy", "auto", "--budget", "4MiB"]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "smallest budget that works is" in err and "largest batch" in err
    assert err.startswith("error: configs/cifar_resnet20.yaml: memory.budget: budget 4.0 MiB is too small")


def test_train_writes_metrics_checkpoint_summary_and_timeline(tmp_path):
    out = tmp_path / "run"
    assert main(["train", LENET, *SYNTHETIC, "--iterations", "3", "--batch", "8", "--out", str(out),
                 "--no-progress", "--policy", "superneurons"]) == 0
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [0, 1, 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["measured_peak_device_bytes"] == summary["predicted_peak_device_bytes"]
    assert 0 <= summary["heldout_accuracy"] <= 1
    assert (out / "checkpoint.npz").stat().st_size > 0
    assert (out / "memory.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["eval", LENET, *SYNTHETIC, "--batch", "8", "--checkpoint", str(out / "checkpoint.npz")]) == 0


@pytest.mark.parametrize("forced, expected", [
    ("direct", "direct kernel for 2 of the 2 dense convolutions' forwards, 2 of their backwards "
               "(SNRT_CPU_KERNELS=direct)"),
    ("im2col", "direct kernel for 0 of the 2 dense convolutions' forwards, 0 of their backwards "
               "(SNRT_CPU_KERNELS=im2col)"),
])
def test_train_says_which_kernel_runs_the_convolutions(tmp_path, capsys, monkeypatch, forced, expected):
    monkeypatch.setenv("SNRT_CPU_KERNELS", forced)
    assert main(["train", LENET, *SYNTHETIC, "--iterations", "1", "--batch", "4", "--out", str(tmp_path / "run"),
                 "--no-progress", "--no-eval"]) == 0
    assert expected in " ".join(capsys.readouterr().out.split())


def test_nondeterministic_reaches_the_backends_kernel_choice_for_training_and_evaluation(tmp_path, monkeypatch):
    """--nondeterministic (train.deterministic false) is what the training and held-out plans
    ask the backend's kernel choice for; without it, deterministic; a non-boolean is refused."""
    from snrt.backends.numpy_backend import NumpyBackend
    from snrt.errors import ConfigError

    asked, choose = [], NumpyBackend.kernel_choice.__func__
    monkeypatch.setattr(NumpyBackend, "kernel_choice", classmethod(
        lambda cls, precision="fp32", deterministic=True: asked.append(deterministic) or choose(cls, precision)))
    for flags, expected in ((["--nondeterministic"], False), ([], True)):
        asked.clear()
        assert main(["train", LENET, *SYNTHETIC, "--iterations", "1", "--batch", "4", "--no-progress", *flags,
                     "--out", str(tmp_path / f"run{expected}")]) == 0
        assert len(asked) >= 3 and set(asked) == {expected}  # the plan, the run and the held-out evaluation
    with pytest.raises(ConfigError, match="train.deterministic"):
        snrt.load_config(LENET, {"train.deterministic": "sometimes"})


def test_ctrl_c_saves_a_checkpoint_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, "-m", "snrt.cli", "train", LENET, *SYNTHETIC, "--iterations", "100000",
               "--batch", "8", "--out", str(out), "--no-progress", "--no-eval"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 3):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, output
    assert "interrupted at iteration" in output and "Traceback" not in output
    done = len(metrics.read_text().splitlines())
    assert main(["train", LENET, *SYNTHETIC, "--iterations", str(done + 2), "--batch", "8", "--out", str(out),
                 "--no-progress", "--no-eval", "--resume"]) == 0
    iterations = [json.loads(line)["iteration"] for line in metrics.read_text().splitlines()]
    assert iterations == list(range(done + 2))


@pytest.mark.parametrize("argv, words", [
    (["train", "configs/nope.yaml"], "file not found"),
    (["train", LENET, "--data", "cifar10:/no/such/folder"], "/no/such/folder"),
    (["eval", LENET, *SYNTHETIC, "--checkpoint", "/no/such.npz"], "checkpoint not found"),
    (["train", LENET, "--data", "npz:/no/such.npz"], "/no/such.npz"),
    (["train", "configs/inceptionv4.yaml", "--image-size", "75", "--batch", "1"], "'reduction_b0.b0.batchnorm0'"),
])
def test_user_errors_are_one_line_without_a_traceback(argv, words, capsys, tmp_path):
    assert main([*argv, "--no-progress"] + (["--out", str(tmp_path)] if argv[0] == "train" else [])) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


@pytest.mark.parametrize("command", [["plan"], ["tune", "--budget", "1GiB"], ["train", "--iterations", "1"]])
def test_image_size_on_a_network_of_vectors_is_refused(command, tmp_path, capsys):
    """--image-size sets an image's height and width; a vector input has neither, so it is an
    error naming input.shape, not a plan or run of the network on 16x8x8 inputs."""
    network = tmp_path / "mlp.yaml"
    network.write_text("input: {shape: [16], classes: 3}\n"
                       "network: [{type: Linear, out_features: 3}, {type: SoftmaxCrossEntropy}]\n")
    out = ["--out", str(tmp_path / "out")] if command[0] != "plan" else []
    assert main([command[0], str(network), "--image-size", "8", *command[1:], *out]) == 2
    err = capsys.readouterr().err
    assert "input.shape: --image-size" in err and "[16]" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    peaks = []
    for size in ([], ["--image-size", "16"]):  # an image network's (1, 8, 8) input made (1, 16, 16)
        assert main(["plan", LENET, "--json", *size]) == 0
        peaks.append(json.loads(capsys.readouterr().out)["chosen"]["peak_bytes"])
    assert peaks[1] > peaks[0]


def test_train_reports_its_thread_pools_capped_at_threads(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "snrt.cli", "train", LENET, *SYNTHETIC, "--iterations", "1",
                           "--batch", "4", "--out", str(out), "--no-progress", "--no-eval", "--threads", "1"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    pools = json.loads((out / "summary.json").read_text())["thread_pools"]
    # numpy's BLAS, and any other pool loaded (scipy's, an OpenMP runtime): every one at 1 thread
    assert "openblas 1 thread" in pools and all(pool.endswith(" 1 thread") for pool in pools.split(", ")), pools
    assert re.search(r"thread pools: (\w+ 1 thread, )*openblas 1 thread(, \w+ 1 thread)* \(", proc.stdout), proc.stdout


def test_plan_rows_planned_in_a_second_process_equal_those_planned_in_one(capsys, monkeypatch):
    from snrt import cli

    args = ["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--policy", "superneurons", "--json"]
    assert main(args) == 0  # superneurons and offload here, the others shared with a forked process
    split = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(cli, "usable_cores", lambda: 1)
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out) == split


def test_this_process_and_a_forked_one_claim_each_group_of_policies_once():
    from snrt.scheduler.policies import POLICIES, planning_groups
    from snrt.threads import Claims, in_a_child

    groups = planning_groups(list(POLICIES))
    assert groups[0] == ["superneurons", "offload"]  # planned together (offload's plan is superneurons' cap)
    assert sorted(p for g in groups for p in g) == sorted(POLICIES)
    claims = Claims(groups)
    theirs = in_a_child(lambda: list(claims))
    ours = list(claims)
    assert sorted(ours + theirs()) == sorted(groups)


def test_an_error_in_the_second_process_is_raised_in_the_first():
    from snrt.threads import in_a_child

    with pytest.raises(ZeroDivisionError):
        in_a_child(lambda: 1 / 0)()
    assert in_a_child(lambda: {"rows": [1, 2]})() == {"rows": [1, 2]}


@pytest.mark.parametrize("spec", ["digits:/tmp", "synthetic:/x"])
def test_a_path_for_a_data_set_that_reads_no_files_is_refused(spec, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", LENET, "--data", spec])
    assert exit_.value.code == 2 and "reads no files" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["inspect", ""], ["train", LENET, "--out", ""], ["train", LENET, "--init-from", ""],
                                  ["plan", LENET, "--save", ""], ["plan", LENET, "--png", ""], ["tune", LENET, "--out", ""],
                                  ["eval", LENET, "--checkpoint", ""], ["report", ""], ["export", ""],
                                  ["export", "run", "--out", ""]])
def test_an_empty_path_is_refused_not_read_as_the_default_or_the_current_folder(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and "expected a path, got an empty string" in capsys.readouterr().err


def test_weights_to_start_from_and_a_checkpoint_to_resume_are_not_asked_for_together(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", LENET, "--out", str(tmp_path / "run"), "--resume", "--init-from", str(tmp_path / "w.pt")])
    assert exit_.value.code == 2
    assert "argument --init-from: not allowed with argument --resume" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_eval_and_resume_take_a_run_folder_for_its_checkpoint(tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--batch", "8", "--no-progress", "--no-eval"]
    assert main(["train", LENET, *flags, "--iterations", "1", "--out", str(run)]) == 0
    assert main(["eval", LENET, "--batch", "8", "--checkpoint", str(run)]) == 0
    assert "lenet at iteration 1: held-out loss" in capsys.readouterr().out
    assert main(["train", LENET, *flags, "--iterations", "2", "--out", str(tmp_path / "next"), "--resume",
                 str(run)]) == 0
    assert f"resumed from {run / 'checkpoint.npz'} at iteration 1" in " ".join(capsys.readouterr().out.split())


def test_streaming_under_policy_none_says_the_parameters_stay_on_the_device(tmp_path, capsys):
    assert main(["train", "configs/lenet.yaml", "--data", "synthetic", "--batch", "8", "--iterations", "1",
                 "--no-progress", "--no-eval", "--policy", "none", "--stream-parameters", "--out",
                 str(tmp_path / "run")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("note: policy none keeps every tensor on the device, so the parameters are not streamed "
            "(memory.stream_parameters); a policy that frees streams them: liveness, recompute, offload, "
            "superneurons or auto") in out


@pytest.mark.parametrize("flag", ["--save", "--png"])
def test_plan_never_writes_over_the_network_file_it_reads(tmp_path, capsys, flag):
    network = tmp_path / "lenet.yaml"
    network.write_bytes(Path("configs/lenet.yaml").read_bytes())
    assert main(["plan", str(network), flag, str(network)]) == 2
    assert f"{network}: {flag} names the network file this command reads" in " ".join(capsys.readouterr().err.split())
    assert network.read_bytes() == Path("configs/lenet.yaml").read_bytes()
