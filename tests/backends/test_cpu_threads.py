"""The CPU kernels that run on the kernel threads give the same bits on any number of them,
also in a workspace planned for fewer threads than run (threads limited after planning)."""

import threading
import time

import numpy as np
import pytest

import snrt.threads
from snrt.backends import cpu_activation, cpu_channel, cpu_depthwise, cpu_kernels, cpu_norm, cpu_pool, cpu_resample
from snrt.backends.cpu_common import run_split
from snrt.backends.cpu_handoff import SLOT, current, publish, watch
from snrt.backends.cpu_kernels import CPU_KERNELS
from snrt.layers.activation import ELU, GELU, ReLU, ReLU6, Sigmoid, SiLU, Softmax
from snrt.layers.base import BACKWARD, FORWARD, KernelContext, Saved
from snrt.layers.conv import Conv2d
from snrt.layers.norm import BatchNorm, GroupNorm
from snrt.layers.join import Scale
from snrt.layers.pool import AdaptiveAvgPool, MaxPool, Upsample
from tests.layers.harness import make_params, make_state

SHAPE = (2, 8, 256, 260)  # over 2^20 values: each kernel here splits it among the kernel threads
LAYERS = [BatchNorm(), BatchNorm(affine=False), SiLU(), GELU(), GELU(approximate="tanh"), Sigmoid(), ELU(alpha=0.5),
          ReLU(), ReLU6(),
          MaxPool(kernel=3, stride=2, padding=1), MaxPool(kernel=2),
          Conv2d(out_channels=8, kernel=3, padding=1, groups=8), Conv2d(out_channels=16, kernel=5, stride=2, groups=8),
          Upsample(scale=2), Upsample(scale=2, mode="bilinear"), AdaptiveAvgPool(output=(5, 7)), Scale(init=0.5),
          GroupNorm(groups=4), Softmax()]


def expected_threads(layer, planned, threads):
    """The thread counts of the kernel's run_split calls, forward then backward: `threads` where
    a kernel needs no workspace, else as many as it was planned for."""
    if isinstance(layer, (BatchNorm, MaxPool, ReLU, ReLU6, Upsample, AdaptiveAvgPool, Scale, GroupNorm)):
        return [threads, threads]
    if isinstance(layer, (Sigmoid, ELU)):  # the exponentials in workspace, a backward without
        return [planned, threads]
    if isinstance(layer, Conv2d):  # forward; weight, then data gradient
        return [planned] * 3
    return [planned, planned]


def run(layer, x, planned_threads, threads, monkeypatch):
    """(y, gx, parameter gradients...) of the CPU kernel, its workspace planned with
    `planned_threads` kernel threads and run with `threads`; asserts the threads each split ran
    on (expected_threads)."""
    used = []

    def counted(function, start, stop, per_thread_args, shared_args):
        used.append(len(per_thread_args))
        run_split(function, start, stop, per_thread_args, shared_args)

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


@pytest.mark.parametrize("failing", [0, 2])  # the caller's own share, another thread's
def test_run_split_raises_a_shares_error_once_every_share_has_ended(failing):
    ended = []

    def share(r0, r1):
        time.sleep(0.02 * r0)  # the caller's share (r0 = 0) ends first
        ended.append(r0)
        if r0 == failing:
            raise ValueError(f"share {r0}")

    with pytest.raises(ValueError, match=f"share {failing}"):
        run_split(share, 0, 3, [()] * 3, ())
    assert sorted(ended) == [0, 1, 2]


def _fill(out, value, r0, r1):
    out[r0:r1] = value


def test_run_split_hands_every_share_to_a_worker_however_long_it_slept():
    for value in range(1, 301):
        out = np.zeros(6)
        run_split(_fill, 0, 6, [()] * 3, (out, value))
        assert (out == value).all()
        if value % 100 == 0:
            time.sleep(0.01)


def test_run_split_from_several_threads_at_once_gives_each_its_own_results():
    """Ranks run as threads of one process (the data-parallel tests' reference) split at the same time."""
    failures = []

    def rank(number):
        for value in range(200):
            out = np.zeros(8)
            run_split(_fill, 0, 8, [()] * 2, (out, number * 1000 + value))
            if not (out == number * 1000 + value).all():
                failures.append((number, value, out))

    ranks = [threading.Thread(target=rank, args=(number,)) for number in range(4)]
    for thread in ranks:
        thread.start()
    for thread in ranks:
        thread.join()
    assert not failures


def test_a_watched_counter_gives_the_value_another_thread_published_or_the_one_seen_when_none_came():
    counters = np.zeros(2 * SLOT, np.int64)
    assert watch(counters, SLOT, 0, 1000) == 0  # nothing published: the value seen, after 1,000 loads
    publisher = threading.Thread(target=lambda: (time.sleep(0.01), publish(counters, SLOT, 7)))
    publisher.start()
    while (value := watch(counters, SLOT, 0, 1 << 20)) == 0:
        pass
    publisher.join()
    assert value == 7 and current(counters, SLOT) == 7 and counters[0] == 0
