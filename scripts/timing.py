"""The timing harness of the benchmark scripts (bench_train.py, reproduce_speed.py, bench_memory.py,
reproduce_timeline.py): whole training iterations of snrt and of PyTorch, timed the same way.

- `time_snrt(config, ...)` / `time_torch(config, ...)`: `warmup` untimed and `iterations` timed
  training iterations of `snrt.Trainer(config)`, or of `snrt.torch_reference.TorchNet` built
  from the same graph and the Trainer's initial values and trained with `torch_sgd`, on the
  same precomputed batches (`training_batches`: the Trainer's own stream). Both return a
  `Run`: per-iteration wall and CPU seconds, every loss, the build time and the process's
  resident memory before the build, before the iterations and after them.
- `spawn(script, worker, **kwargs)` runs one worker of a script in a fresh Python process
  (ru_maxrss only ever grows, and OpenBLAS's and torch's thread pools must not compete), and
  `serve(workers)` is the worker's side: it prints the result as one tagged JSON line.
- `fit_seconds(config, iterations)`: `Trainer.fit` with warm-up, for scripts that want the
  executor's own seconds per iteration (and the trained Trainer) rather than a framework race.

Import this module before numpy: it sets the BLAS thread counts to every core (unless already
set), so numpy and torch both use the whole machine.
"""

import os

CORES = os.cpu_count() or 1
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, str(CORES))  # before numpy loads its BLAS

import gc  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # this checkout's snrt, whatever the installed copy points at
import snrt  # noqa: E402,F401  (before numpy: it sets OpenBLAS's thread timeout, as the `snrt` command does)
from snrt.backends.cpu_choice import cpu_model  # noqa: E402,F401  (the processor the timings ran on)

RESULT_TAG = "TIMING_RESULT "  # a worker's JSON line on its stdout
WORKER_FLAG = "--timing-worker"


# ---- memory of this process -----------------------------------------------------------------
def max_rss_bytes():
    """The process's peak resident set size so far (ru_maxrss is KiB on Linux)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def current_rss_bytes():
    """The process's resident set size now (Linux: /proc/self/statm; elsewhere the peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return max_rss_bytes()


# ---- data -----------------------------------------------------------------------------------
def training_batches(config, count):
    """The first `count` batches (x, y) of the stream `Trainer(config)` trains on
    (`snrt.data.Batches(...).get(i)` of the config's training set), computed now."""
    from snrt.data import Batches, load_datasets, normalization

    train = config.train
    train_set, _ = load_datasets(train.data, tuple(config.input.shape), config.input.classes, train.seed)
    mean, std = normalization(train.data, train_set)
    stream = Batches(train_set, train.batch, train.seed, mean, std, crop_padding=train.data.crop_padding,
                     flip=train.data.flip, prefetch=False)
    return [stream.get(i) for i in range(count)]


# ---- timed iterations -----------------------------------------------------------------------
@dataclass
class Run:
    """What `measure` saw. Lists of seconds are of the timed iterations only; `losses` has every
    iteration's, warm-up included. rss_* are bytes: `rss_start` / `rss_before` the resident
    set just before the build / the first iteration, `rss_max_*` the high-water mark then and
    after the last iteration."""

    subject: object  # what the build made: the Trainer, or (TorchNet, torch.optim.SGD)
    seconds: list  # wall seconds of each timed iteration
    cpu_seconds: list  # this process's CPU seconds (all threads) of each
    inner_seconds: list  # the step's own timing of each (Trainer: executor.run only), None where it has none
    losses: list
    build_s: float
    rss_start: int
    rss_max_start: int
    rss_before: int
    rss_max_before: int
    rss_max_after: int
    loadavg_before: float  # 1-minute load average (it includes this process)
    loadavg_after: float

    @property
    def rss_growth_bytes(self):
        """The high-water mark after the iterations minus the resident bytes before them: what
        the iterations took from the OS (allocator slack and temporaries included)."""
        return self.rss_max_after - self.rss_before

    @property
    def new_high_water(self):
        """False: the iterations never passed the earlier high-water mark, so rss_growth_bytes
        is only an upper bound of what they needed."""
        return self.rss_max_after > self.rss_max_before


def measure(build, data, warmup, label=None):
    """Build (timed: `build_s`), then run one training iteration per batch of `data`, the first
    `warmup` untimed. `build()` returns (subject, step) with `step(i, x, y)` -> (loss, the step's
    own seconds or None). With `label`, one line per iteration goes to stderr."""
    gc.collect()
    rss_start, high_start = current_rss_bytes(), max_rss_bytes()
    start = time.perf_counter()
    subject, step = build()
    build_s = time.perf_counter() - start
    gc.collect()
    rss_before, high_before = current_rss_bytes(), max_rss_bytes()
    load_before = os.getloadavg()[0]
    seconds, cpu, inner, losses = [], [], [], []
    for i, (x, y) in enumerate(data):
        start, start_cpu = time.perf_counter(), time.process_time()
        loss, own = step(i, x, y)
        elapsed, used = time.perf_counter() - start, time.process_time() - start_cpu
        losses.append(loss)
        if i >= warmup:
            seconds.append(elapsed)
            cpu.append(used)
            inner.append(own)
        if label:
            print(f"  {label} iteration {i}{' (warm-up)' if i < warmup else ''}: {elapsed:.2f} s, "
                  f"{used / elapsed:.2f} cores busy, loss {loss:.4f}", file=sys.stderr, flush=True)
    return Run(subject, seconds, cpu, inner, losses, build_s, rss_start, high_start, rss_before, high_before,
               max_rss_bytes(), load_before, os.getloadavg()[0])


def time_snrt(config, warmup, iterations, label=None, backend="cpu"):
    """`Trainer(config, backend).step(x, y, total)` over `warmup` + `iterations` batches of its
    stream; `inner_seconds` are the Trainer's own (executor.run only)."""
    from snrt import Trainer

    total = warmup + iterations
    data = training_batches(config, total)

    def build():
        trainer = Trainer(config, backend=backend)

        def step(i, x, y):
            metrics = trainer.step(x, y, total)
            return metrics.loss, metrics.seconds
        return trainer, step

    return measure(build, data, warmup, label)


def time_torch(config, warmup, iterations, label=None, schedule=False, adjust=None, forward=None,
               keep_initial=False):
    """PyTorch on every core: TorchNet from `config`'s graph and the Trainer's initial parameters
    (passed through `adjust(params)` if given) and BatchNorm state, `torch_sgd` with the config's
    SGD (zero_grad, forward, backward, step and `loss.item()` timed per iteration), on the
    batches `time_snrt` sees. `schedule`: set the learning rate of every iteration as the
    Trainer's schedule does (else the optimizer's lr throughout). `forward(net, graph)` returns
    the loss function `(x, y) -> loss` to use instead of the mean of TorchNet's losses.

    `keep_initial`: keep the NumPy initial parameters (TorchNet holds copies) alive until the
    iterations are over, so torch cannot reuse their memory: its RSS growth then counts
    all it needs (with them freed, it is lower by up to their size, e.g. ~100 MB for ResNet-50)."""
    import torch

    from snrt.init import initial_parameters, initial_state
    from snrt.optim import learning_rate
    from snrt.torch_reference import TorchNet, torch_sgd

    torch.set_num_threads(CORES)
    graph, train = config.graph, config.train
    opt, total = train.optimizer, warmup + iterations
    data = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in training_batches(config, total)]
    kept = []

    def build():
        params = initial_parameters(graph, train.seed, train.init)  # what the Trainer copies into its arena
        params = adjust(params) if adjust else params
        if keep_initial:
            kept.append(params)
        net = TorchNet(graph, params, initial_state(graph), torch_dropout=True)  # timed, not compared
        net.train()
        sgd = torch_sgd(net, graph, opt)
        loss_of = forward(net, graph) if forward else (lambda x, y: net({"data": x, "label": y}).mean())

        def step(i, x, y):
            if schedule:
                for group in sgd.param_groups:
                    group["lr"] = learning_rate(train.schedule, opt.lr, i, total)
            sgd.zero_grad(set_to_none=True)
            loss = loss_of(x, y)
            loss.backward()
            sgd.step()
            return loss.item(), None
        return (net, sgd), step

    return measure(build, data, warmup, label)


def fit_seconds(config, iterations, warmup=1):
    """`Trainer(config).fit` for `warmup` + `iterations` iterations: the Trainer (the caller reads
    its plan and arena and closes its backend) and the executor seconds of the last
    `iterations` (`Metrics.seconds`)."""
    from snrt import Trainer

    trainer = Trainer(config)
    history = trainer.fit(iterations=warmup + iterations)
    return trainer, [m.seconds for m in history[warmup:]]


# ---- one worker per process -----------------------------------------------------------------
def spawn(script, worker, echo=True, **kwargs):
    """Run `worker` (a name the script's `serve` knows) of `script` with `kwargs` (JSON) in a fresh
    Python process, from the repository root; its result, or {"error": ..., "stdout": ...}.
    `echo`: the worker's stderr goes to ours (else it is kept for the error)."""
    cmd = [sys.executable, str(Path(script).resolve()), WORKER_FLAG, worker, json.dumps(kwargs)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if echo else subprocess.PIPE, text=True, cwd=ROOT)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1][len(RESULT_TAG):])
    last = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:]
    return {"error": f"worker exited with status {proc.returncode}" + (f": {last[0]}" if last else ""),
            "stdout": proc.stdout[-2000:]}


def serve(workers, argv=None):
    """A script's worker side: when this process was started by `spawn`, run the worker it names
    (`workers`: {name: function of the kwargs}), print its result as the tagged JSON line and
    return True; otherwise return False."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != [WORKER_FLAG]:
        return False
    result = workers[argv[1]](**json.loads(argv[2]))
    print(RESULT_TAG + json.dumps(result), flush=True)
    return True
