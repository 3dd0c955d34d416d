"""Replaying a captured iteration (snrt/executor.py, CUDA graphs on the GPU), checked on the
CPU through a NumPy backend that captures as CUDA does: inside `capturing` nothing runs, the
kernels, accumulations, copies and updates are recorded, and `replaying` runs the record once,
each update with the scalars of its row as the iteration wrote them.

Replayed training must be bit-identical to steps run one by one, under every policy; what
a replay cannot repeat (random numbers keyed by the iteration, a step that fails its capture,
clipping by the gradients' norm) runs step by step and says why."""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import snrt
import snrt.runtime
from snrt.backends.base import Captured, CopyEvent, NotCapturable
from snrt.backends.numpy_backend import NumpyBackend
from snrt.config import DataConfig, OptimizerConfig, TrainConfig, config_from_graph, with_settings
from snrt.errors import DivergenceError
from snrt.layers.base import KernelContext
from snrt.train import Trainer
from tests.scheduler.graphs import CLASSES, build, graph_recipes
from tests.scheduler.test_exactness import CONCAT_NET
from tests.test_train import SMALL_RESNET


class DoneEvent(CopyEvent):
    def wait(self):
        pass


class RecordingKernel:
    """A kernel whose calls, while its backend captures, are recorded instead of run."""

    def __init__(self, kernel, backend):
        self.kernel, self.backend = kernel, backend
        self.layer = getattr(kernel, "layer", kernel)  # a layer may be its own kernel

    def __getattr__(self, name):
        return getattr(self.kernel, name)

    def forward(self, ctx, *args, **options):
        self.backend.run_or_record(ctx, self.layer, lambda: self.kernel.forward(ctx, *args, **options))

    def backward(self, ctx, *args):
        self.backend.run_or_record(ctx, self.layer, lambda: self.kernel.backward(ctx, *args))


class CapturingBackend(NumpyBackend):
    """NumpyBackend with the capture contract of a GPU backend (base.Backend.capturing).
    `refuse` names a layer type whose kernels cannot be captured (NotCapturable), or is
    "launch": the captured graph fails to launch."""

    refuse = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record, self.mode, self.rows, self.next_row = None, None, [], 0

    def replay_unsupported_reason(self):
        return None

    def kernel_for(self, layer, in_shapes):
        return RecordingKernel(super().kernel_for(layer, in_shapes), self)

    def run_or_record(self, ctx, layer, call):
        if self.mode != "capture":
            call()
            return
        if type(layer).__name__ == self.refuse:
            raise NotCapturable(f"{self.refuse} cannot be captured here")
        self.record.append(lambda: (ctx.release_scratch(), call()))

    def accumulate(self, total, part):
        if self.mode == "capture":
            self.record.append(lambda: NumpyBackend.accumulate(self, total, part))
        else:
            super().accumulate(total, part)

    def offload(self, buffer):
        if self.mode != "capture":
            return super().offload(buffer)
        self.record.append(lambda: super(CapturingBackend, self).offload(buffer).wait())
        return DoneEvent()

    def prefetch(self, buffer, source):
        if self.mode != "capture":
            return super().prefetch(buffer, source)
        self.record.append(lambda: super(CapturingBackend, self).prefetch(buffer, source).wait())
        return DoneEvent()

    def update(self, optimizer, w, g, states, weight_decay, lr, count, workspace, grad_scale=1.0):
        if self.mode is None:
            return super().update(optimizer, w, g, states, weight_decay, lr, count, workspace, grad_scale)
        row = self.next_row
        self.next_row += 1
        scalars = (weight_decay, lr, count, grad_scale)
        if self.mode == "capture":
            self.rows.append(scalars)
            self.record.append(lambda: NumpyBackend.update(self, optimizer, w, g, states, *self.rows[row][:3],
                                                           workspace, self.rows[row][3]))
        else:
            self.rows[row] = scalars

    def capturing(self, update_rows):
        backend = self

        class Capture:
            def __enter__(self):
                backend.record, backend.mode, backend.rows, backend.next_row = [], "capture", [], 0
                self.captured = Captured()
                return self.captured

            def __exit__(self, kind, error, trace):
                backend.mode = None
                if kind is None:
                    assert len(backend.rows) == update_rows
                    self.captured.graph = backend.record
        return Capture()

    def replaying(self, captured):
        backend = self

        class Replay:
            def __enter__(self):
                backend.mode, backend.next_row = "replay", 0

            def __exit__(self, kind, error, trace):
                backend.mode = None
                if kind is None:
                    if backend.refuse == "launch":
                        raise RuntimeError("the graph did not launch")
                    for call in captured.graph:
                        call()
        return Replay()


def trained(config, backend=CapturingBackend, iterations=5, **train):
    """(losses, persistent arrays, trainer) of `iterations` on `backend` where the trainer asks
    for the CPU, `train` settings changed."""
    real = snrt.runtime.backend_class
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(snrt.runtime, "backend_class", lambda name: backend if name == "cpu" else real(name))
        trainer = Trainer(with_settings(config, train=train) if train else config)
        losses = [m.loss for m in trainer.fit(iterations=iterations)]
    return losses, trainer.host_arrays(), trainer


def assert_same_training(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    for key, value in a[1].items():
        np.testing.assert_array_equal(value, b[1][key], err_msg=key)


@pytest.fixture
def refusing():
    """Sets CapturingBackend.refuse for one test."""
    yield CapturingBackend
    CapturingBackend.refuse = None


SCHEDULED = {"optimizer": {"type": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.001},
             "schedule": {"type": "cosine", "warmup": 2}}


@pytest.mark.parametrize("policy", ["none", "liveness", "recompute", "offload", "superneurons"])
def test_replayed_iterations_train_bit_identically_to_steps_one_by_one(policy):
    """Every iteration after the second replays the capture, with the learning rate of its
    own iteration (a warm-up then cosine schedule changes it every iteration)."""
    config = with_settings(snrt.load_config(SMALL_RESNET), memory={"policy": policy})
    expected = trained(config, NumpyBackend, **SCHEDULED)
    capturing_run = trained(config, **SCHEDULED)
    executor = capturing_run[2].executor
    assert executor.replayed == 4 and executor.runs == 5, executor.describe_replay()
    assert executor.describe_replay() == "CUDA graph: 4 of 5 iterations ran as one captured graph"
    assert_same_training(capturing_run, expected)
    assert capturing_run[2].backend.arena.peak_bytes == capturing_run[2].plan.peak_bytes


def test_adam_replays_with_each_iterations_step_count():
    """Adam's bias corrections change with the step count: each replay's rows carry its own."""
    settings = {"optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.01}}
    config = snrt.load_config(SMALL_RESNET)
    replayed = trained(config, **settings)
    assert replayed[2].executor.replayed == 4
    assert_same_training(replayed, trained(config, NumpyBackend, **settings))


def test_replay_off_runs_every_step_and_says_so():
    run = trained(snrt.load_config(SMALL_RESNET), iterations=3, cuda_graph=False)
    assert run[2].executor.replayed == 0
    assert run[2].executor.describe_replay() == "steps run one by one: turned off (--no-cuda-graph)"


def test_random_layers_keep_their_iteration_step_by_step():
    """CONCAT_NET has a Dropout: its masks follow the iteration, which a replay would repeat."""
    config = snrt.load_config(CONCAT_NET)
    run = trained(config, iterations=4)
    assert run[2].executor.replayed == 0
    assert "draws random numbers from the iteration's seed" in run[2].executor.describe_replay()
    assert_same_training(run, trained(config, NumpyBackend, iterations=4))


def test_a_step_that_cannot_be_captured_leaves_the_iteration_to_run_step_by_step(refusing):
    """The capture fails at MaxPool's forward: nothing of it ran, the iteration runs step by
    step, and so does every later one; the training is as without a capture."""
    config = snrt.load_config(SMALL_RESNET)
    expected = trained(config, NumpyBackend, iterations=4)
    refusing.refuse = "MaxPool"
    run = trained(config, iterations=4)
    reason = run[2].executor.describe_replay()
    assert run[2].executor.replayed == 0
    assert "the capture failed at step" in reason and "MaxPool cannot be captured here" in reason, reason
    assert_same_training(run, expected)


def test_a_graph_that_does_not_launch_leaves_the_run_step_by_step(refusing):
    config = snrt.load_config(SMALL_RESNET)
    refusing.refuse = "launch"
    run = trained(config, iterations=3)
    assert run[2].executor.replayed == 0
    assert run[2].executor.describe_replay() == ("steps run one by one: the capture failed at its end or first "
                                                 "launch: the graph did not launch")
    assert_same_training(run, trained(config, NumpyBackend, iterations=3))


def test_clipping_by_the_norm_is_not_replayed():
    run = trained(snrt.load_config(SMALL_RESNET), iterations=3,
                  optimizer={"type": "sgd", "lr": 0.05, "clip_norm": 1.0})
    assert run[2].executor.replayed == 0
    assert "norm on the host" in run[2].executor.describe_replay()


def test_the_cpu_backend_runs_steps_one_by_one():
    run = trained(snrt.load_config(SMALL_RESNET), NumpyBackend, iterations=2)
    assert run[2].executor.describe_replay() == "steps run one by one: the cpu backend runs steps one by one"


def test_reading_the_random_key_marks_the_steps_context_also_through_rest():
    ctx = KernelContext(np, True, seed=5, iteration=2, workspace=np.empty(256, np.uint8))
    ctx.scratch((4,), "float32")
    inner = ctx.rest()
    assert not ctx.read_key
    assert inner.iteration == 2 and inner.seed == 5
    assert ctx.read_key and inner.root is ctx


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graph_recipes(max_ops=8), st.sampled_from(["none", "superneurons"]))
def test_generated_graphs_replay_as_they_train_step_by_step(recipe, policy):
    """Any network of the generated layers trains alike replayed and step by step, or diverges
    alike (a Mul of one tensor by itself after convolutions, twice over, can leave a weight NaN
    within 4 iterations even at this learning rate); one with a Dropout runs step by step
    throughout."""
    train = TrainConfig(batch=4, iterations=4, data=DataConfig(samples=16), optimizer=OptimizerConfig(lr=0.01))
    config = with_settings(config_from_graph(build(recipe), CLASSES, train), memory={"policy": policy})
    try:
        run = trained(config, iterations=4)
    except DivergenceError as replayed:
        with pytest.raises(DivergenceError) as step_by_step:
            trained(config, NumpyBackend, iterations=4)
        assert str(step_by_step.value) == str(replayed)
        return
    assert_same_training(run, trained(config, NumpyBackend, iterations=4))
    random = any(op in ("dropout", "dropout2d") for op, _, _ in recipe)
    assert run[2].executor.replayed == (0 if random else 3), run[2].executor.describe_replay()
