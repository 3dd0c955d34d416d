"""Thread pools: the cores a process may use, and the BLAS pool capped explicitly."""

import json
import re
import subprocess
import sys

import pytest

from snrt.threads import cgroup_cpu_quota, describe_pools, usable_cores


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_cgroup_quota_is_read_from_v2_or_v1_files(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(tmp_path) == quota


def test_usable_cores_are_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(__import__("os").sched_getaffinity(0))
    assert usable_cores(tmp_path) == affinity  # no quota files: the affinity
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a core
    assert usable_cores(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 3) * 100000} 100000\n")  # more than the affinity
    assert usable_cores(tmp_path) == affinity


def test_describe_pools_names_each_library_and_its_threads():
    assert describe_pools([("openblas", 2), ("openmp", 1)]) == "openblas 2 threads, openmp 1 thread"
    assert describe_pools([]) == "none"


def test_limit_threads_caps_numpys_pool_and_those_loaded_later():
    """In a fresh process (a pool's size is process-wide): numpy's BLAS pool at 1 thread, a
    pool loaded afterwards (scipy's own OpenBLAS, in the test environment) too, and a GEMM
    still gives the right answer."""
    code = ("import json, numpy as np, snrt, threadpoolctl; snrt.limit_threads(1); import scipy.linalg; "
            "a = np.ones((64, 64), np.float32); pools = threadpoolctl.threadpool_info(); "
            "print(json.dumps([[(p['filepath'], p['num_threads']) for p in pools], float((a @ a)[0, 0])]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    pools, value = json.loads(out)
    assert any("numpy" in path for path, _ in pools) and any("scipy" in path for path, _ in pools)
    assert all(n == 1 for _, n in pools)
    assert value == 64.0


@pytest.mark.parametrize("count", [0, -1, "2", 1.5, True])
def test_limit_threads_refuses_a_count_that_is_not_a_positive_int_and_changes_nothing(count):
    """0 threads once set trained to a ZeroDivisionError where the kernels split their work."""
    import snrt
    from snrt.threads import kernel_threads

    before = kernel_threads()
    with pytest.raises(snrt.SnrtError, match=f"limit_threads: expected a positive int, got {re.escape(repr(count))}"):
        snrt.limit_threads(count)
    assert kernel_threads() == before


def test_a_thread_count_past_any_machine_is_refused_by_limit_threads_and_the_command_line(capsys):
    """--threads 99999999999 sized the kernels' workspace for that many threads and ended in
    'not enough memory for this run: lower --batch', which blamed the batch."""
    import snrt
    from snrt.cli import main
    from snrt.threads import MAX_THREADS, kernel_threads

    before = kernel_threads()
    with pytest.raises(snrt.SnrtError, match=f"limit_threads: expected at most {MAX_THREADS} threads, got 99999999999"):
        snrt.limit_threads(99999999999)
    assert kernel_threads() == before
    with pytest.raises(SystemExit):
        main(["train", "configs/lenet.yaml", "--threads", "99999999999"])
    assert f"argument --threads: expected at most {MAX_THREADS} threads, got 99999999999" in capsys.readouterr().err


@pytest.mark.parametrize("preset, expected", [(None, "16"), ("4", "4")])
def test_importing_snrt_first_has_openblas_threads_sleep_at_once_unless_the_user_chose(preset, expected):
    env = {k: v for k, v in __import__("os").environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if preset:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    code = "import os, snrt; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == expected


@pytest.mark.parametrize("imports, preset, warned", [
    ("import numpy, snrt", None, True),
    ("import snrt, numpy", None, False),
    ("import numpy, snrt", "16", False),
])
def test_a_cpu_backend_warns_once_when_numpy_came_first_with_openblas_spinning(imports, preset, warned):
    """numpy imported before snrt has OpenBLAS's threads spin with its default timeout (snrt
    could not shorten it): a CPU backend warns, once per process; not when snrt came first or
    the user chose a timeout."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    env["OPENBLAS_NUM_THREADS"] = "2"  # a pool to spin, on a machine of any size
    if preset:
        env["OPENBLAS_THREAD_TIMEOUT"] = preset
    code = (f"{imports}\nimport warnings\nfrom snrt.backends.numpy_backend import NumpyBackend\n"
            "with warnings.catch_warnings(record=True) as seen:\n    warnings.simplefilter('always')\n"
            "    NumpyBackend(64)\n    NumpyBackend(64)\n"
            "print(sum(w.category.__name__ == 'BlasSpinWarning' for w in seen))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.strip() == ("1" if warned else "0")
