"""snrt tune: the largest batch per policy from the plans, the recommendation, the scaled
learning rate, and the command as a user meets it."""

import json

import pytest

import snrt
from snrt.cli import main
from snrt.scheduler.planner import BudgetError, make_plan
from snrt.scheduler.policies import POLICIES
from snrt.tune import Point, recommend, scaled_train, sweep

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


def test_tune_writes_a_config_that_trains_and_refuses_to_overwrite_it(tmp_path, capsys):
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
                 "--no-eval"]) == 0
    assert main(["tune", LENET, "--budget", "2MiB", "--out", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("args, words", [
    ([], "snrt tune needs a budget"),
    (["--budget", "1KiB"], "no policy fits batch 1 in 1.0 KiB"),
])
def test_tune_without_a_workable_budget_says_so(args, words, tmp_path, capsys):
    assert main(["tune", LENET, "--out", str(tmp_path / "t.yaml"), *args]) == 2
    assert words in " ".join(capsys.readouterr().err.split())
