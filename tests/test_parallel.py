"""Data parallel in one process: ranks as threads (tests/threadgroup.py), so the executor's
exchange steps, the split of the batch and the agreements run without MPI."""

import argparse
import json

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

import snrt
from snrt.config import TrainConfig, config_from_graph, with_settings
from snrt.data import Batches, load_datasets
from snrt.errors import DivergenceError, SnrtError
from snrt.graph import Graph
from snrt.layers.activation import ReLU
from snrt.layers.conv import Conv2d
from snrt.layers.input import Input
from snrt.layers.linear import Linear
from snrt.layers.loss import SoftmaxCrossEntropy
from snrt.layers.pool import GlobalAvgPool
from snrt.scheduler.policies import POLICIES
from snrt.train import Trainer
from tests.threadgroup import run_ranks

ROLES = ("parameter", "optimizer_state", "state")


def without_batchnorm(**train):
    """A small conv net whose gradient over a batch is the sum of its parts' (no BatchNorm)."""
    g = Graph("plain")
    g.add(Input(shape=(3, 8, 8)), name="data")
    g.add(Input(shape=(), dtype="int64"), name="label")
    g.add(Conv2d(out_channels=8, kernel=3, padding=1), inputs=["data"], name="conv0")
    g.add(ReLU(), inputs=["conv0"], name="relu0")
    g.add(Conv2d(out_channels=8, kernel=3, padding=1), inputs=["relu0"], name="conv1")
    g.add(ReLU(), inputs=["conv1"], name="relu1")
    g.add(GlobalAvgPool(), inputs=["relu1"], name="pool")
    g.add(Linear(out_features=4), inputs=["pool"], name="fc")
    g.add(SoftmaxCrossEntropy(), inputs=["fc", "label"], name="loss")
    cfg = config_from_graph(g, 4, TrainConfig())
    return with_settings(cfg, train={"batch": 8, "seed": 3, "data": {"type": "synthetic", "samples": 64},
                                     "optimizer": {"lr": 0.05}, **train})


def train(config, ranks, iterations=3, **options):
    """[(losses, {(node, name): array} of every persistent tensor)] of each rank."""
    def work(group):
        trainer = Trainer(config, group=group, **options)
        history = trainer.fit(iterations=iterations)
        return [m.loss for m in history], trainer.host_arrays(ROLES)
    with threadpool_limits(1):
        return run_ranks(ranks, work)


def resnet(**memory):
    cfg = snrt.load_config("configs/cifar_resnet20.yaml", {"input.shape": [3, 16, 16]})
    return with_settings(cfg, train={"batch": 8, "data": {"type": "synthetic", "samples": 64}},
                         memory=memory or None)


@pytest.mark.parametrize("ranks", [2, 4])
def test_the_ranks_train_the_global_batch_and_keep_identical_parameters(ranks):
    config = without_batchnorm()
    runs = train(config, ranks)
    (losses, arrays), = train(config, 1)
    for rank_losses, rank_arrays in runs:
        assert rank_losses == runs[0][0]  # the loss over the whole batch, the same on every rank
        for key, value in rank_arrays.items():
            assert np.array_equal(value, runs[0][1][key]), key
    np.testing.assert_allclose(runs[0][0], losses, rtol=1e-5)
    for key, value in arrays.items():  # the sum of the parts' gradients is the batch's gradient
        np.testing.assert_allclose(runs[0][1][key], value, rtol=2e-4, atol=1e-6, err_msg=str(key))


def test_clipping_by_the_global_norm_sees_the_summed_gradients():
    config = without_batchnorm(optimizer={"lr": 0.5, "clip_norm": 0.05})
    runs = train(config, 2)
    (losses, arrays), = train(config, 1)
    np.testing.assert_allclose(runs[0][0], losses, rtol=1e-5)
    for key, value in arrays.items():
        np.testing.assert_allclose(runs[1][1][key], value, rtol=2e-4, atol=1e-6, err_msg=str(key))


def test_each_rank_normalises_with_its_own_batchnorm_statistics():
    config = resnet()
    runs = train(config, 2, iterations=1)
    state = [k for k in runs[0][1] if k[1] == "running_mean"]
    assert state and any(not np.array_equal(runs[0][1][k], runs[1][1][k]) for k in state)
    params = [k for k in runs[0][1] if k[1] == "weight"]
    assert all(np.array_equal(runs[0][1][k], runs[1][1][k]) for k in params)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_policy_gives_the_same_parameters_and_measured_peak_equals_planned_with_two_ranks(policy):
    reference = train(resnet(), 2, iterations=2)
    runs = train(resnet(policy=policy), 2, iterations=2, check=True)  # check mode: every step's bytes verified
    for (losses, arrays), (ref_losses, ref_arrays) in zip(runs, reference):
        assert losses == ref_losses
        for key, value in arrays.items():
            assert np.array_equal(value, ref_arrays[key]), key


def test_the_measured_peak_of_each_rank_is_the_planned_peak():
    def work(group):
        trainer = Trainer(resnet(policy="superneurons"), group=group)
        trainer.fit(iterations=1)
        return trainer.plan, trainer.backend.arena.peak_bytes, trainer.executor.measured_bytes
    with threadpool_limits(1):
        for plan, peak, measured in run_ranks(2, work):
            assert plan.ranks == 2 and plan.batch == 4
            assert peak == plan.peak_bytes
            assert list(measured) == list(plan.device_bytes)


def test_a_batch_that_does_not_split_over_the_ranks_is_refused_clearly():
    config = with_settings(without_batchnorm(), train={"batch": 9})
    with pytest.raises(SnrtError, match="train.batch: the batch 9 must split evenly over the 2 ranks"):
        train(config, 2)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_the_ranks_parts_of_a_batch_are_disjoint_and_together_the_batch(ranks):
    dataset, _ = load_datasets(snrt.config.DataConfig(type="synthetic", samples=50), (3, 8, 8), 4, seed=1)
    mean, std = np.zeros(3), np.ones(3)

    def batches(rank, count):
        return Batches(dataset, 12, 1, mean, std, crop_padding=2, flip=True, prefetch=False, rank=rank,
                       ranks=count)
    whole = batches(0, 1)
    for i in (0, 4, 9):  # 9 crosses an epoch boundary
        x, y = whole.get(i)
        parts = [batches(r, ranks).get(i) for r in range(ranks)]
        assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
        assert np.array_equal(np.concatenate([p[1] for p in parts]), y)


def test_snrt_plan_shows_one_rank_of_a_data_parallel_run(capsys):
    from snrt.cli import main

    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--ranks", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    params = snrt.load_config("configs/cifar_resnet20.yaml").graph.num_params() * 4
    assert report["batch"] == 4 and report["ranks"] == 2
    for row in report["policies"]:
        assert row["ranks"] == 2 and row["exchanged_bytes"] == params
    assert main(["plan", "configs/cifar_resnet20.yaml", "--batch", "8", "--ranks", "3"]) == 2
    assert "must split evenly over the 3 ranks" in " ".join(capsys.readouterr().err.split())


def test_the_bucket_size_changes_when_gradients_travel_not_the_result():
    small = with_settings(resnet(), train={"gradient_bucket": "16KiB"})

    def work(group):
        trainer = Trainer(small, group=group)
        trainer.fit(iterations=2)
        return sum(s.kind == "allreduce" for s in trainer.plan.steps), trainer.host_arrays(ROLES)
    with threadpool_limits(1):
        (buckets, arrays), _ = run_ranks(2, work)
    assert buckets > 10
    (_, reference), _ = train(resnet(), 2, iterations=2)
    for key, value in reference.items():
        assert np.array_equal(arrays[key], value), key


class FakeGroup:
    """Two ranks; records an abort instead of ending the process."""

    def __init__(self, rank):
        self.rank, self.size, self.aborted = rank, 2, None

    def abort(self, code):
        self.aborted = code


def test_a_failure_of_one_rank_during_training_is_told_by_it_and_ends_every_rank(capsys):
    from snrt.cli import _report

    group = FakeGroup(rank=1)
    _report(argparse.Namespace(group=group, started=True), OSError(), "ckpt.npz: No space left on device", 2, False)
    assert group.aborted == 2
    assert "error: rank 1 of 2: ckpt.npz: No space left on device; ending every rank" in capsys.readouterr().err


def test_a_divergence_is_told_once_by_rank_0_and_ends_no_rank_by_force(capsys):
    from snrt.cli import _report

    for rank in (0, 1):
        group = FakeGroup(rank)
        _report(argparse.Namespace(group=group, started=True), DivergenceError("diverged"), "diverged", 2, rank == 0)
        assert group.aborted is None
    assert capsys.readouterr().err.count("error: diverged") == 1


@pytest.mark.parametrize("policy", ["liveness", "superneurons"])
def test_streamed_parameters_train_two_ranks_as_resident_ones_do(policy):
    reference = train(resnet(), 2, iterations=2)
    runs = train(resnet(policy=policy, stream_parameters=True), 2, iterations=2, check=True)
    for (losses, arrays), (ref_losses, ref_arrays) in zip(runs, reference):
        assert losses == ref_losses
        for key, value in arrays.items():
            assert np.array_equal(value, ref_arrays[key]), key
