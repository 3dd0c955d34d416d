"""The CPU kernels that run on the kernel threads give the same bits on any number of them,
also in a workspace planned for fewer threads than run (threads limited after planning)."""

import multiprocessing
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from numba import njit

import snrt.threads
from snrt.backends import cpu_activation, cpu_channel, cpu_depthwise, cpu_kernels, cpu_norm, cpu_pool, cpu_resample
from snrt.backends.cpu_parallel import run_split
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.layers.activation import ELU, GELU, ReLU, ReLU6, Sigmoid, SiLU, Softmax
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.conv import Conv2d
from snrt.layers.norm import BatchNorm, GroupNorm, LayerNorm
from snrt.layers.join import Scale
from snrt.layers.pool import AdaptiveAvgPool, AvgPool, MaxPool, Upsample
from tests.layers.harness import make_params, make_state

SHAPE = (2, 8, 256, 260)  # over 2^20 values: each kernel here splits it among the kernel threads
LAYERS = [BatchNorm(), BatchNorm(affine=False), SiLU(), GELU(), GELU(approximate="tanh"), Sigmoid(), ELU(alpha=0.5),
          ReLU(), ReLU6(),
          MaxPool(kernel=3, stride=2, padding=1), MaxPool(kernel=2), AvgPool(kernel=3, stride=2, padding=1),
          Conv2d(out_channels=8, kernel=3, padding=1, groups=8), Conv2d(out_channels=16, kernel=5, stride=2, groups=8),
          Upsample(scale=2), Upsample(scale=2, mode="bilinear"), AdaptiveAvgPool(output=(5, 7)), Scale(init=0.5),
          GroupNorm(groups=4), LayerNorm(), Softmax()]


def expected_threads(layer, planned, threads):
    """The thread counts of the kernel's run_split calls, forward then backward: `threads` where
    a kernel needs no workspace, else as many as it was planned for."""
    if isinstance(layer, (BatchNorm, MaxPool, AvgPool, ReLU, ReLU6, SiLU, GELU, Sigmoid, ELU, AdaptiveAvgPool, Scale,
                          GroupNorm)) \
            or isinstance(layer, Upsample) and layer.mode == "nearest":
        return [threads, threads]
    if isinstance(layer, Conv2d):  # forward; weight, then data gradient
        return [planned] * 3
    if isinstance(layer, LayerNorm):  # a share is a sample
        return [min(planned, SHAPE[0])] * 2
    return [planned, planned]


def run(layer, x, planned_threads, threads, monkeypatch):
    """(y, gx, parameter gradients...) of the CPU kernel, its workspace planned with
    `planned_threads` kernel threads and run with `threads`; asserts the threads each split ran
    on (expected_threads)."""
    used = []

    def counted(function, start, stop, threads, shared_args, per_thread=()):
        used.append(threads)
        run_split(function, start, stop, threads, shared_args, per_thread)

    for module in (cpu_activation, cpu_channel, cpu_depthwise, cpu_kernels, cpu_norm, cpu_pool, cpu_resample):
        monkeypatch.setattr(module, "run_split", counted)
    monkeypatch.setattr(snrt.threads, "_LIMIT", [planned_threads])
    kernel = CPU_KERNELS.kernel_for(layer, [x.shape])
    workspace = {phase: np.zeros(kernel.workspace_bytes([x.shape], phase), np.uint8) for phase in (FORWARD, BACKWARD)}
    monkeypatch.setattr(snrt.threads, "_LIMIT", [threads])
    params = make_params(layer, [x.shape], np.random.default_rng(1))
    state = make_state(layer, [x.shape])
    aux = {k: np.empty(s.shape, np.float32 if s.dtype == "compute" else s.dtype)
           for k, s in layer.aux_specs([x.shape]).items()}
    y = np.full(layer.infer_shape([x.shape]), np.nan, np.float32)
    kernel.forward(KernelContext(np, workspace=workspace[FORWARD]), [x], params, state, y, aux)
    gx = np.full_like(x, np.nan)
    gy = np.random.default_rng(1).standard_normal(y.shape, dtype=np.float32)
    grads = {k: np.full_like(v, np.nan) for k, v in params.items()}
    kernel.backward(KernelContext(np, workspace=workspace[BACKWARD]), gy, Saved((x,), y),
                    params, aux, [gx], grads)
    assert used == expected_threads(layer, planned_threads, threads)
    return [y, gx, *grads.values()]


@pytest.mark.parametrize("layer", LAYERS, ids=repr)
def test_a_threaded_cpu_kernel_gives_the_same_bits_on_any_number_of_threads(layer, monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(SHAPE, dtype=np.float32)
    one = run(layer, x, 1, 1, monkeypatch)
    assert not any(np.isnan(a).any() for a in one)
    for planned, threads in ((2, 2), (3, 3), (1, 4)):  # (1, 4): limited to 4 after planning for 1
        for a, b in zip(one, run(layer, x, planned, threads, monkeypatch)):
            np.testing.assert_array_equal(a, b)


@njit(nogil=True)
def _fill(out, value, r0, r1, own):
    """out[r0:r1] = value + the thread's own scratch row's first value."""
    out[r0:r1] = value + own[0]


def _split_fill(out, value, threads):
    """out after run_split of _fill over it, thread t's scratch row holding 1000 t."""
    own = (1000 * np.arange(threads, dtype=np.float64)).reshape(threads, 1)
    run_split(_fill, 0, out.size, threads, (out, value), (own,))
    return out


def test_run_split_gives_each_thread_its_share_and_its_own_scratch_row():
    out = _split_fill(np.zeros(7), 5.0, 3)  # shares [0, 2), [2, 4), [4, 7)
    np.testing.assert_array_equal(out, [5, 5, 1005, 1005, 2005, 2005, 2005])
    np.testing.assert_array_equal(_split_fill(np.zeros(3), 1.0, 1), [1, 1, 1])


def test_run_split_from_several_threads_at_once_gives_each_its_own_results():
    """Ranks run as threads of one process (the data-parallel tests' reference) split at the same time."""
    failures = []

    def rank(number):
        for value in range(200):
            out = _split_fill(np.zeros(8), float(number * 100000 + value), 2)
            if not (out == number * 100000 + value + np.repeat([0, 1000], 4)).all():
                failures.append((number, value, out))

    ranks = [threading.Thread(target=rank, args=(number,)) for number in range(4)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert not failures


def test_a_process_forked_after_a_parallel_split_runs_its_shares_one_after_the_other():
    """GNU OpenMP cannot start a parallel loop in a child forked after one ran (the child would
    stop): the child's splits run on its one thread, with the same results."""
    _split_fill(np.zeros(8), 1.0, 2)  # a parallel loop in this process
    receive, send = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=lambda: send.send(_split_fill(np.zeros(8), 2.0, 2).tolist()))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert receive.recv() == [2.0] * 4 + [1002.0] * 4


FACTORY = '''
import sys
import numpy as np
from numba import njit
from snrt.backends.cpu_parallel import run_split

def scaled(factor):
    @njit(nogil=True, cache=True)
    def scale(x, y, r0, r1):
        for i in range(r0, r1):
            y[i] = x[i] * factor
    return scale

factors = [float(f) for f in sys.argv[1:]]
kernels = [scaled(f) for f in factors]  # made in this order: the first would take the plain name
x = np.arange(8.0)
for kernel, factor in zip(kernels, factors):
    y = np.zeros(8)
    run_split(kernel, 0, 8, 2, (x, y))
    print(factor, (y == x * factor).all())
'''


def test_kernels_a_factory_makes_run_their_own_code_in_every_process(tmp_path):
    """The launcher compiled for a kernel is cached on disk by the kernel's name; kernels a
    factory makes differ only by what they close over, so that is in the name: a process that
    makes them in another order must not load a launcher that runs its sibling."""
    (tmp_path / "factory.py").write_text(FACTORY)
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join(sys.path)}
    for order in (["2", "3"], ["3", "2"]):
        done = subprocess.run([sys.executable, str(tmp_path / "factory.py"), *order], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [f"{float(order[0])}", "True", f"{float(order[1])}", "True"]


def test_a_kernel_closing_over_anything_but_constants_is_refused():
    table = np.ones(3)

    @njit(nogil=True)
    def reads_table(x, r0, r1):
        for i in range(r0, r1):
            x[i] = table[i]

    with pytest.raises(TypeError, match="closes over ndarray"):
        run_split(reads_table, 0, 3, 2, (np.zeros(3),))
