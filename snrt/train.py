"""The Trainer: a plan, a backend, an executor, data and an optimizer, iteration after iteration.

Deterministic: batch i, dropout masks and parameter initialisation are pure functions of the
seed and the iteration, so the same seed gives the same losses bit for bit, and a run
stopped and resumed from a checkpoint continues exactly as if it never stopped.
"""

import contextlib
import dataclasses
import itertools
import math
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from snrt.checkpoint import CheckpointError, describe_changes, load_checkpoint, save_checkpoint
from snrt.config import Config
from snrt.data import Batches, eval_batches, load_datasets, normalization
from snrt.errors import ConfigError, DivergenceError, SnrtError
from snrt.init import each_initial_parameter, each_initial_state
from snrt.optim import learning_rate, make_optimizer
from snrt.parallel import Solo, launcher_local_size
from snrt.precision import LossScale, precision_named
from snrt.runtime import plan_run, prepare
from snrt.threads import usable_cores
from snrt.units import is_count
from snrt.weights import ROLES as WEIGHT_ROLES, matched, read as read_weights
from snrt.workers import WorkerBatches


@dataclass
class Metrics:
    """What one training iteration measured."""

    iteration: int
    loss: float
    accuracy: float
    lr: float
    seconds: float
    images_per_s: float
    peak_device_bytes: int
    loss_scale: float = None  # fp16: the scale of the loss's gradient this iteration (snrt.precision.LossScale)
    skipped: bool = False  # fp16: the gradients overflowed, so no parameter was updated
    data_wait_s: float = 0.0  # how long the iteration waited for its batch
    heldout_loss: float = None  # every train.eval_every iterations: the held-out split's (None if not finite)
    heldout_accuracy: float = None


def _run_options(config, group):
    """What plan_run and prepare are told to train `config` on `group`'s ranks (each plans its
    part of the global batch)."""
    if not isinstance(config, Config):
        raise SnrtError(f"config: expected a snrt.Config (snrt.load_config(path), or config_from_graph for a graph "
                        f"built in Python), got {type(config).__name__}")
    train, memory = config.train, config.memory
    if train.batch % group.size:
        raise SnrtError(f"{config.source}: train.batch: the batch {train.batch} must split evenly over the "
                        f"{group.size} ranks (it is the global batch); choose a multiple of {group.size}")
    options = make_optimizer(train.optimizer).plan_options
    if precision_named(train.precision).loss_scaling:  # an overflow skips every update: they wait for the backward
        options = {**options, "deferred_updates": True}
    return dict(graph=config.graph, batch=train.batch // group.size, policy=memory.policy, budget=memory.budget,
                training=True, **options, group=group, bucket_bytes=train.gradient_bucket,
                stream_parameters=memory.stream_parameters, precision=train.precision,
                deterministic=train.deterministic, fuse=train.fuse)


class Trainer:
    """Trains `config` (a snrt.Config: the graph and every setting, batch, memory policy and
    budget included) on `backend` ("cpu" or "cuda"): `fit`, `evaluate`, `save`, `restore`.

    `check` turns on the executor's check mode (poisoned memory, live bytes and reads
    verified against the plan after every step).

    Data parallel: with a `group` of several ranks (snrt.parallel.world() under mpiexec), each
    process trains on its part of every batch (train.batch is the global batch; each rank
    plans for batch / ranks), the gradients are summed across the ranks in rank order before
    the updates, so every rank holds the same parameters; BatchNorm normalises with each
    rank's own statistics and keeps its own running statistics (rank 0's are saved). The
    loss and accuracy reported are over the whole batch; only rank 0 writes checkpoints.
    """

    def __init__(self, config, backend="cpu", check=False, group=None, plan=None):
        self.group = group or Solo()
        options = _run_options(config, self.group)
        self.config = config
        self.graph = config.graph
        train, memory = config.train, config.memory
        self.batch = train.batch
        self.optimizer = make_optimizer(train.optimizer)
        self.loss_scale = LossScale() if precision_named(train.precision).loss_scaling else None
        self.runtime = prepare(**options, backend=backend, check=check,
                               host_folder=memory.host_store, plan=plan, replay=train.cuda_graph,
                               values=itertools.chain(each_initial_parameter(self.graph, train.seed, train.init),
                                                      each_initial_state(self.graph)))
        self.plan, self.backend, self.executor = self.runtime.plan, self.runtime.backend, self.runtime.executor
        self._backend_name, self._check = backend, check
        self.iteration = 0
        try:
            self.train_set, self.heldout_set = load_datasets(train.data, tuple(config.input.shape),
                                                             config.input.classes, train.seed, config.input.per_pixel)
        except ConfigError as e:  # the data set's settings: named in the config's file
            raise ConfigError(config.source, e.key, e.message) if e.source == "<data>" else e from None
        self.mean, self.std = normalization(train.data, self.train_set)
        self.stop_reason = None  # what asked fit to stop: a signal (SIGINT, SIGTERM) or a caller's reason

    @staticmethod
    def plan_for(config, backend="cpu", group=None):
        """The plan a Trainer of `config` on `backend` would make, made with nothing allocated:
        SnrtError when the backend is not available, the batch does not split over the ranks,
        the network cannot train, or no plan fits the budget. `Trainer(..., plan=it)` uses it."""
        return plan_run(**_run_options(config, group or Solo()), backend=backend)

    # ---- training ------------------------------------------------------------------------
    def fit(self, iterations=None, on_iteration=None, checkpoint=None, checkpoint_every=None, lr_at=None):
        """Train up to iteration `iterations` (default train.iterations); return the Metrics.

        `on_iteration(metrics)` is called after every iteration. With `checkpoint` (a path),
        a checkpoint is written every `checkpoint_every` iterations, at the end, and when
        SIGINT (Ctrl-C) or SIGTERM stops the run (the current iteration finishes first; the
        signal is in `stop_reason`), or a caller sets `stop_reason`, and before the error of
        data that cannot be read (a bad file, a worker that died) is raised. A NaN or infinite loss
        raises DivergenceError and writes no checkpoint, so the last good one stays.
        `lr_at(iteration)` replaces train.schedule's learning rate (a learning-rate range test).
        """
        train = self.config.train
        for name, value in (("iterations", iterations), ("checkpoint_every", checkpoint_every)):
            if value is not None and not is_count(value, least=0):
                raise SnrtError(f"fit: {name}: expected an int >= 0, got {value!r}")
        total = iterations if iterations is not None else train.iterations
        every = train.checkpoint_every if checkpoint_every is None else checkpoint_every
        history = []
        with self._interrupt_guard(), self._batches() as batches:
            stream = iter(batches)
            while self.iteration < total and not self.stop_requested:
                waiting = time.perf_counter()
                try:
                    x, y = next(stream)
                except SnrtError:  # a file a worker process or this process's loader thread could not read
                    if checkpoint:  # the iterations done so far are kept
                        self.save(checkpoint)
                    raise
                waited = time.perf_counter() - waiting
                metrics = self.step(x, y, total, None if lr_at is None else lr_at(self.iteration))
                metrics.data_wait_s = waited
                if train.eval_every and self.iteration % train.eval_every == 0 and self.iteration < total:
                    loss, accuracy = self.evaluate()  # the end of the run is evaluated by the caller
                    if math.isfinite(loss):
                        metrics.heldout_loss, metrics.heldout_accuracy = loss, accuracy
                self._agree_to_stop()
                history.append(metrics)
                if on_iteration:
                    on_iteration(metrics)
                if checkpoint and every and self.iteration % every == 0 and self.iteration < total:
                    self.save(checkpoint)
            if checkpoint:  # still guarded: a signal now lets the write finish
                self.save(checkpoint)
        return history

    def _batches(self):
        """The training batches from this iteration on: Batches, made by train.data.workers
        processes when there are any (snrt/workers.py)."""
        train, workers = self.config.train, self.workers
        batches = Batches(self.train_set, self.batch, train.seed, self.mean, self.std,
                          crop_padding=train.data.crop_padding, flip=train.data.flip, start=self.iteration,
                          rank=self.group.rank, ranks=self.group.size, prefetch=not workers)
        return WorkerBatches(batches, workers) if workers else batches

    @property
    def workers(self):
        """The processes preparing batches: train.data.workers, or when it is null, for data
        decoded from files (image folders), the usable cores shared among the ranks on this
        host (at least one each); none for data in memory."""
        workers = self.config.train.data.workers
        if workers is None:
            return max(1, usable_cores() // launcher_local_size()) if self.train_set.decodes else 0
        most = 4 * usable_cores() + 4
        if workers > most:  # each is a Python process of its own: more only wait for the cores, and fill memory
            raise ConfigError(self.config.source, "train.data.workers",
                              f"{workers} worker processes on a machine with {usable_cores()} usable cores; "
                              f"expected at most {most}")
        return workers

    def _agree_to_stop(self):
        """With several ranks, every rank stops after the iteration at which any rank was asked to
        (a signal reaches the ranks at different moments)."""
        if self.group.size > 1:
            reason = self.stop_reason
            sigint, sigterm, other = self.group.sum([reason == signal.SIGINT, reason == signal.SIGTERM,
                                                     reason is not None and reason not in _SIGNALS])
            if reason is None and (sigint or sigterm or other):
                self.stop_reason = signal.SIGTERM if sigterm else signal.SIGINT if sigint else "another rank stopped"

    @property
    def stop_requested(self):
        """True once a signal or the caller asked the training loop to stop."""
        return self.stop_reason is not None

    def step(self, x, y, total, lr=None):
        """One training iteration on batch (x, y) at learning rate `lr` (default: the
        schedule's at this iteration of `total`); returns its Metrics."""
        train = self.config.train
        self._check_batch({"data": x, "label": y})
        if lr is None:
            lr = learning_rate(train.schedule, train.optimizer.lr, self.iteration, total)
        start = time.perf_counter()
        with np.errstate(all="ignore"):  # an overflow is reported once, as divergence, below
            scale = self.loss_scale.scale if self.loss_scale else 1.0
            losses, correct = self.executor.run({"data": x, "label": y}, self.iteration, train.seed, self.optimizer, lr,
                                                scale)
        self.backend.synchronize()
        seconds = time.perf_counter() - start
        if self.group.size == 1:
            loss, accuracy = float(losses.mean()), float(correct.mean())
        else:  # over every rank's samples (the ranks' parts are equal)
            loss, accuracy = (self.group.sum([losses.sum(dtype=np.float64), correct.sum(dtype=np.float64)])
                              / self.batch).tolist()
        if not math.isfinite(loss):
            raise DivergenceError(self._divergence_message(loss, lr))
        metrics = Metrics(self.iteration, loss, accuracy, lr, seconds, self.batch / seconds,
                          self.backend.arena.peak_bytes)
        if self.loss_scale:
            metrics.loss_scale, metrics.skipped = scale, self.executor.overflowed
            self.loss_scale.after(self.executor.overflowed)
        self.iteration += 1
        return metrics

    def _check_batch(self, feed):
        """SnrtError unless each array of `feed` has the shape of the plan's input it feeds:
        a smaller batch would be broadcast over the planned one (the CPU) or fail inside the
        iteration, leaving its buffers reserved."""
        plan = self.executor.plan
        for name, b in plan.inputs:
            expected, got = tuple(plan.buffers[b].shape), tuple(np.shape(feed[name]))
            if got != expected:
                raise SnrtError(f"step: {name} has shape {list(got)}, but this trainer's plan takes {list(expected)} "
                                f"(a batch of {expected[0]} first)")

    def _divergence_message(self, loss, lr):
        """What went non-finite at this iteration: the loss, and the first parameter (in graph
        order) that the iteration's update left non-finite, if any."""
        culprit = next((f"{node}:{name}" for node, name, fetch in self.runtime.persistent_tensors(("parameter",))
                        if not np.isfinite(fetch()).all()), None)
        where = (f"; the first parameter it left non-finite is {culprit}" if culprit
                 else "; the parameters are still finite (non-finite inputs or an overflow in the forward pass?)")
        return (f"training diverged at iteration {self.iteration}: the loss is {loss} at learning rate {lr:g}{where}. "
                "Stopped without writing a checkpoint, so the last good one is kept; lower the learning rate "
                "(--lr) and resume")

    @contextlib.contextmanager
    def _interrupt_guard(self):
        """SIGINT and SIGTERM (in the main thread) ask the loop to stop after the current
        iteration; the previous handlers come back afterwards."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {s: signal.signal(s, lambda signum, frame: setattr(self, "stop_reason", signum)) for s in signals}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    # ---- evaluation ------------------------------------------------------------------------
    def evaluate(self, dataset=None):
        """(mean loss, accuracy) over `dataset` (default: the held-out split), in eval mode."""
        dataset = dataset if dataset is not None else self.heldout_set
        forward = prepare(self.graph, self.plan.batch, "liveness", backend=self._backend_name, training=False,
                          check=self._check, values=self.host_arrays(("parameter", "state")),
                          precision=self.config.train.precision,  # evaluated as it trains
                          deterministic=self.config.train.deterministic, fuse=self.config.train.fuse,
                          replay=self.config.train.cuda_graph)
        loss_sum, correct, seen = 0.0, 0.0, 0
        # a loss that overflows is reported once, by the caller (nonfinite_evaluation), not as warnings
        with np.errstate(all="ignore"):
            try:
                batch = self.plan.batch  # this rank's part of a training batch
                for x, y in eval_batches(dataset, batch, self.mean, self.std):
                    valid = len(y)
                    if valid < batch:  # pad the last batch; only the real samples count
                        x = np.concatenate([x, np.repeat(x[-1:], batch - valid, axis=0)])
                        y = np.concatenate([y, np.repeat(y[-1:], batch - valid, axis=0)])
                    losses, right = forward.executor.run({"data": x, "label": y}, self.iteration,
                                                         self.config.train.seed)
                    loss_sum += float(losses[:valid].sum())
                    correct += float(right[:valid].sum())  # per-sample accuracies (per-pixel: fractions)
                    seen += valid
            finally:
                forward.close()
        return loss_sum / max(seen, 1), correct / max(seen, 1)

    def nonfinite_evaluation(self, loss):
        """The one line saying that a held-out loss `loss` is not finite, with its likely cause."""
        if self.graph.state_specs():
            cause = (f"the running statistics of its normalization layers (BatchNorm) after {self.iteration} "
                     f"iteration{'s' if self.iteration != 1 else ''} are not usable yet; train longer or with a "
                     "larger batch")
        else:
            cause = "the trained parameters give a non-finite loss on held-out data; train longer or with a lower lr"
        return f"the held-out evaluation is not finite (loss {loss}): {cause}"

    # ---- checkpoints -----------------------------------------------------------------------
    def host_arrays(self, roles=("parameter", "optimizer_state", "state")):
        """{(node, name): host copy} of the persistent buffers with the given roles."""
        return self.runtime.host_arrays(roles)

    def save(self, path):
        """Write parameters, optimizer state, BatchNorm statistics and the iteration atomically,
        one tensor in memory at a time (see snrt/checkpoint.py). Only rank 0 writes."""
        if self.group.rank != 0:
            return
        tensors = ((f"{node}:{name}", fetch) for node, name, fetch in
                   self.runtime.persistent_tensors(("parameter", "optimizer_state", "state")))
        save_checkpoint(path, tensors, {"iteration": self.iteration, "seed": self.config.train.seed,
                                        "network": self.graph.name, "graph": self.graph.fingerprint(),
                                        "optimizer": self.config.train.optimizer.type,
                                        "batch": self.batch, "precision": self.config.train.precision,
                                        **self._class_names(),
                                        **({"loss_scale": dataclasses.asdict(self.loss_scale)} if self.loss_scale else {})})

    def _class_names(self):
        """{"class_names": the folder of each class index} of an image folder's data; {} for other data."""
        names = getattr(self.train_set, "class_names", ())
        return {"class_names": list(names)} if names else {}

    def load_weights(self, path):
        """Parameters and normalization statistics from a weights file (safetensors or a
        PyTorch state dict, matched as snrt/weights.py says); the optimizer starts afresh."""
        wanted = [((node, name), self.executor.view_of(node, name).shape)
                  for node, name, _ in self.runtime.persistent_tensors(WEIGHT_ROLES)]
        self.runtime.load(matched(wanted, read_weights(path), Path(path)))

    def restore(self, path, optimizer_state=True):
        """Load a checkpoint written by `save` for the same network; training continues from it.
        Without `optimizer_state` (to evaluate it) only its parameters and statistics are loaded,
        so a checkpoint of any optimizer will do.

        Returns a note when the checkpoint was trained at another batch size or with another seed
        (None otherwise).
        """
        arrays, meta = load_checkpoint(path)
        roles = ("parameter", "optimizer_state", "state") if optimizer_state else WEIGHT_ROLES
        expected = {f"{node}:{name}": (node, name) for node, name, _ in self.runtime.persistent_tensors(roles)}
        optimizer = self.config.train.optimizer.type
        if optimizer_state and meta.get("optimizer", "sgd") != optimizer:
            raise CheckpointError(f"{path}: trained with {meta.get('optimizer', 'sgd')}, this run uses {optimizer}: the "
                                  "optimizer's state does not carry over; resume with the same train.optimizer.type")
        missing = sorted(set(expected) - set(arrays))
        if missing:
            raise CheckpointError(f"{path}: made for a different network (no {missing[0]}; "
                                  f"{len(missing)} tensors missing)")
        for key, (node, name) in expected.items():
            shape = self.executor.view_of(node, name).shape
            if arrays[key].shape != shape:
                raise CheckpointError(f"{path}: {key} has shape {list(arrays[key].shape)}, "
                                      f"the network needs {list(shape)}")
        if meta.get("graph", self.graph.fingerprint()) != self.graph.fingerprint():
            raise CheckpointError(f"{path}: made for another network ({meta.get('network')!r}, structure "
                                  f"{meta['graph']}) than {self.graph.name!r} (structure {self.graph.fingerprint()}): "
                                  "its layers, options or connections differ")
        saved, now = meta.get("class_names"), self._class_names().get("class_names")
        if saved and now and saved != now:  # the same index, another folder: every label would mean another class
            raise CheckpointError(f"{path}: trained on the classes (image folders) {saved}, this data's are {now}: "
                                  "a class index would name another folder")
        self.runtime.load({(node, name): arrays[key] for key, (node, name) in expected.items()})
        self.iteration = int(meta["iteration"])
        if self.loss_scale and isinstance(meta.get("loss_scale"), dict):  # else it starts afresh
            self.loss_scale = LossScale(**{k: meta["loss_scale"][k] for k in ("scale", "good", "growth_interval")
                                           if k in meta["loss_scale"]})
        return describe_changes(meta, self.batch, self.config.train.seed, self.config.train.precision)


_SIGNALS = (signal.SIGINT, signal.SIGTERM)
