"""snrt tune: the largest batch per policy from the plans, the recommendation, the scaled
learning rate, and the command as a user meets it."""

import json
import math
import signal

import pytest

import snrt
from snrt.cli import main
from snrt.scheduler.planner import BudgetError, make_plan
from snrt.scheduler.policies import POLICIES
from snrt.tune import Point, RangeTest, range_rates, range_test, recommend, scaled_train, sweep

LENET = "configs/lenet.yaml"
BUDGET = 2 * 2**20


@pytest.mark.parametrize("policy", POLICIES)
def test_sweep_finds_the_largest_batch_that_fits(policy):
    graph = snrt.load_config(LENET).graph
    points = sweep(graph, policy, BUDGET, limit=4096)
    assert points and [p.batch for p in points] == sorted({p.batch for p in points})
    top = points[-1].batch
    assert make_plan(graph, top, policy, budget=BUDGET).arena_bytes <= BUDGET
    with pytest.raises(BudgetError):
        make_plan(graph, top + 1, policy, budget=BUDGET)
    assert all(p.arena_bytes <= BUDGET and p.predicted_s > 0 for p in points)


def test_sweep_stops_at_the_limit_and_finds_nothing_when_batch_1_does_not_fit():
    graph = snrt.load_config(LENET).graph
    assert [p.batch for p in sweep(graph, "liveness", BUDGET, limit=5)] == [1, 2, 4, 5]
    assert sweep(graph, "liveness", 1000, limit=64) == []


def test_recommend_takes_the_most_images_per_second():
    points = [Point("liveness", 8, 10, 0.1), Point("offload", 16, 10, 0.15), Point("superneurons", 16, 10, 0.15)]
    assert recommend(points) == Point("offload", 16, 10, 0.15)  # 106.7 images/s; a tie goes to the earlier policy


def test_the_learning_rate_scales_with_the_batch_and_warms_up_when_it_grows():
    train = snrt.load_config(LENET, {"train.iterations": 200, "train.batch": 32,
                                     "train.optimizer": {"lr": 0.1}}).train
    assert scaled_train(train, 128) == {"batch": 128, "optimizer": {"lr": pytest.approx(0.4)}, "schedule": {"warmup": 10}}
    assert scaled_train(train, 16) == {"batch": 16, "optimizer": {"lr": pytest.approx(0.05)},
                                       "schedule": {"warmup": train.schedule.warmup}}


def test_tune_writes_a_config_that_trains_and_refuses_to_overwrite_it(tmp_path, capsys, monkeypatch):
    out, png = tmp_path / "tuned.yaml", tmp_path / "tune.png"
    assert main(["tune", LENET, "--budget", "2MiB", "--json", "--out", str(out), "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    best = report["recommended"]
    assert set(report["largest_batch"]) == set(POLICIES) and best["batch"] <= report["largest_batch"][best["policy"]]
    tuned = snrt.load_config(out)
    assert (tuned.train.batch, tuned.memory.policy, tuned.memory.budget) == (best["batch"], best["policy"], 2 * 2**20)
    original = snrt.load_config(LENET)
    assert tuned.train.optimizer.lr == pytest.approx(original.train.optimizer.lr * best["batch"] / original.train.batch)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["train", str(out), "--iterations", "1", "--out", str(tmp_path / "run"), "--no-progress",
                 "--no-eval", "--backend", "cpu"]) == 0  # tuned with the CPU's kernels (a GPU's need other workspace)
    monkeypatch.setattr("snrt.tune.sweep", None)  # refused before the sweep and the range test, which take minutes
    assert main(["tune", LENET, "--budget", "2MiB", "--out", str(out), "--lr-range", "--measure"]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    ([], "snrt tune needs a budget"),
    (["--budget", "1KiB"], "no policy fits batch 1 in 1.0 KiB"),
])
def test_tune_without_a_workable_budget_says_so(args, words, tmp_path, capsys):
    assert main(["tune", LENET, "--out", str(tmp_path / "t.yaml"), *args]) == 2
    assert words in " ".join(capsys.readouterr().err.split())


def test_range_rates_grow_exponentially_over_five_decades():
    rates = range_rates(0.1, 11)
    assert rates[0] == pytest.approx(1e-4) and rates[-1] == pytest.approx(10.0)
    ratios = [b / a for a, b in zip(rates, rates[1:])]
    assert all(r == pytest.approx(10 ** 0.5) for r in ratios)


def test_the_range_test_suggests_a_tenth_of_the_rate_of_lowest_smoothed_loss():
    test = RangeTest(lrs=(0.01, 0.1, 1.0, 10.0), losses=(2.0, 1.0, 0.5, 9.0), smoothed=(2.0, 1.5, 0.9, 3.0))
    assert test.suggested_lr == pytest.approx(0.1)


def test_the_range_test_trains_at_its_rates_and_stops_when_the_loss_diverges():
    config = snrt.load_config(LENET, {"train.batch": 16, "train.data.type": "synthetic"})
    trainer = snrt.Trainer(config)
    seen = []
    test = range_test(trainer, 10.0, 40, on_iteration=lambda m: seen.append(m.lr))  # up to 1000: it diverges
    assert list(test.lrs) == seen == range_rates(10.0, 40)[:len(seen)]
    assert 3 <= len(seen) < 40  # stopped early: the loss ran away (or went non-finite) well before 1000
    assert all(map(math.isfinite, test.losses))


def test_tune_with_a_range_test_caps_the_scaled_rate(tmp_path, capsys):
    out, png = tmp_path / "tuned.yaml", tmp_path / "tput.png"
    assert main(["tune", LENET, "--budget", "1GiB", "--max-batch", "64", "--lr-range", "16", "--json", "--out",
                 str(out), "--png", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    scan, recommended = report["lr_range"], report["recommended"]
    assert len(scan["lrs"]) == len(scan["losses"]) <= 16
    assert recommended["lr"] == pytest.approx(min(recommended["scaled_lr"], scan["suggested_lr"]))
    assert snrt.load_config(str(out)).train.optimizer.lr == pytest.approx(recommended["lr"])
    assert png.with_suffix(".lr.png").read_bytes()[:4] == b"\x89PNG"


def test_tune_plans_streamed_parameters_when_asked(tmp_path, capsys):
    config, out = "configs/cifar_resnet20.yaml", str(tmp_path / "tuned.yaml")
    assert main(["tune", config, "--budget", "2MiB", "--max-batch", "64", "--out", out]) == 2  # 2.2 MB resident
    assert "no policy fits batch 1" in " ".join(capsys.readouterr().err.split())
    assert main(["tune", config, "--budget", "2MiB", "--max-batch", "64", "--out", out, "--stream-parameters",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["largest_batch"] and snrt.load_config(out).memory.stream_parameters


@pytest.mark.parametrize("flag", ["--lr-range", "--measure"])
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("after", [0, 1], ids=["before any iteration", "after one"])
def test_a_range_test_or_measurement_cut_short_by_a_signal_writes_no_config(tmp_path, capsys, monkeypatch, flag, signum,
                                                                            status, after):
    from snrt.train import Trainer

    fit = Trainer.fit

    def signalled(self, *args, on_iteration=None, **kwargs):
        def stop(metrics):  # as the training loop's handler does when the signal comes
            if on_iteration:
                on_iteration(metrics)
            self.stop_reason = signum
        if not after:
            self.stop_reason = signum
        return fit(self, *args, on_iteration=stop, **kwargs)

    monkeypatch.setattr(Trainer, "fit", signalled)
    out = tmp_path / "tuned.yaml"
    assert main(["tune", LENET, "--budget", "2MiB", "--max-batch", "16", flag, "--out", str(out)]) == status
    assert capsys.readouterr().err == f"error: {'interrupted' if signum == signal.SIGINT else 'terminated'}\n"
    assert not out.exists()
