"""The reproduction scripts' shared machinery: the largest-fitting search, the budget check and
the summary's verdicts (scripts/reproduce_common.py, scripts/reproduce_summary.py)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from calibrate_cpu_cost import fit  # noqa: E402
from reproduce_common import arena_in_budget, largest_fitting  # noqa: E402
from reproduce_summary import verdict  # noqa: E402

from snrt.scheduler.cost import CPU, step_cost, update_bytes  # noqa: E402
from snrt.scheduler.planner import BudgetError, make_plan  # noqa: E402
from snrt.scheduler.policies import POLICIES  # noqa: E402
from tests.scheduler.graphs import build  # noqa: E402


def brute_force(size_of, budget, limit):
    fitting = [n for n in range(1, limit + 1) if size_of(n) <= budget]
    return max(fitting, default=0)


@settings(max_examples=200, deadline=None)
@given(slope=st.integers(1, 10**6), base=st.integers(0, 10**8), budget=st.integers(0, 10**9),
       steps=st.lists(st.integers(0, 10**6), max_size=6), start=st.tuples(st.integers(1, 3000), st.integers(1, 3000)))
def test_largest_fitting_finds_the_largest_n_of_any_increasing_size(slope, base, budget, steps, start):
    """Affine sizes with a few upward jumps (as arenas grow with the batch or the depth)."""
    jumps = sorted((n * 97 % 3000, s) for n, s in enumerate(steps))

    def size_of(n):
        return base + slope * n + sum(s for at, s in jumps if n >= at)

    limit = 5000
    n, probes = largest_fitting(size_of, budget, start=start, limit=limit)
    assert n == brute_force(size_of, budget, limit)
    assert all(probes[m] == size_of(m) for m in probes)
    assert n == 0 or n in probes


@settings(max_examples=100, deadline=None)
@given(slope=st.integers(1, 10**6), base=st.integers(0, 10**8), budget=st.integers(10**8, 10**10))
def test_largest_fitting_pins_an_affine_size_in_a_few_probes(slope, base, budget):
    n, probes = largest_fitting(lambda m: base + slope * m, budget, start=(16, 32), limit=1 << 16)
    assert n == min(max((budget - base) // slope, 0), 1 << 16)
    assert len(probes) <= 8


def test_largest_fitting_never_probes_far_past_the_answer():
    """A probe far above the answer is a huge plan: the search steps up to it from below."""
    def size_of(n):  # close to affine, with the steps an arena's packing adds
        return 10**6 * n + 37_000 * (n // 5) + 500_000 * (n // 97)

    budget = size_of(1372) + 10**5
    n, probes = largest_fitting(size_of, budget, start=(100, 788), limit=1 << 16)
    assert n == brute_force(size_of, budget, 2000) == 1372
    assert max(probes) <= n + 16
    assert len(probes) <= 10


def test_largest_fitting_reports_zero_when_nothing_fits():
    n, probes = largest_fitting(lambda m: 100 + m, 50, start=(1, 2), limit=1000)
    assert n == 0 and 1 in probes


@pytest.mark.parametrize("policy", POLICIES)
def test_arena_in_budget_agrees_with_make_plan_under_that_budget(policy):
    graph = build([("conv", 0, 0), ("bn", 1, 1), ("relu", 2, 2), ("conv", 3, 3), ("add", 4, 2), ("relu", 5, 5)])
    for budget in (make_plan(graph, 4, p).arena_bytes for p in POLICIES):
        arena = arena_in_budget(graph, 4, policy, budget)
        try:
            fitted = make_plan(graph, 4, policy, budget=budget)
        except BudgetError:
            assert arena > budget
        else:  # the same plan, unless make_plan grew it into the room left (superneurons)
            assert arena <= budget
            assert arena == fitted.arena_bytes or POLICIES[policy].grows


def test_verdicts_compare_with_a_tolerance_in_either_direction():
    assert verdict(2600, 2500) == "level"
    assert verdict(4250, 2500) == "ahead"
    assert verdict(1000, 2500) == "behind"
    assert verdict(3.0, 7.0, higher_is_better=False) == "ahead"
    assert verdict(9.0, 7.0, higher_is_better=False) == "behind"


def test_the_summary_reads_the_result_files_and_names_the_missing_ones(tmp_path):
    peak = json.loads((ROOT / "results" / "peak_memory.json").read_text())
    (tmp_path / "peak_memory.json").write_text(json.dumps(peak))
    subprocess.run([sys.executable, str(ROOT / "scripts" / "reproduce_summary.py"), "--out", str(tmp_path)],
                   check=True, capture_output=True, cwd=ROOT)
    text = (tmp_path / "README.md").read_text()
    resnet50 = next(r for r in peak["plans"] if r["network"] == "resnet50")
    assert f"superneurons {resnet50['policies']['superneurons']['peak_bytes'] / 2**30:.2f} GiB" in text
    for missing in ("deepest_resnet", "largest_batch", "speed", "timeline"):
        assert f"results/{missing}.json missing" in text


def test_the_cost_fit_recovers_the_rates_that_produced_the_times():
    rng = np.random.default_rng(0)
    rows = np.column_stack([rng.uniform(0, 1e10, 200), rng.uniform(0, 1e9, 200), np.ones(200)])
    seconds = rows[:, 0] / 80e9 + rows[:, 1] / 4e9 + 300e-6
    model = fit(rows, seconds)
    assert model.flops_per_s == pytest.approx(80e9, rel=1e-6)
    assert model.memory_bytes_per_s == pytest.approx(4e9, rel=1e-6)
    assert model.step_overhead_s == pytest.approx(300e-6, rel=1e-6)


def test_the_cost_fit_keeps_every_rate_non_negative():
    rows = np.array([[1e9, 0.0, 1.0], [2e9, 0.0, 1.0], [3e9, 0.0, 1.0]])
    model = fit(rows, np.array([0.03, 0.02, 0.01]))  # time falling with work: no positive rate fits
    assert model.flops_per_s > 0 and model.memory_bytes_per_s > 0 and model.step_overhead_s >= 0


def test_an_update_costs_the_traffic_of_sgd_with_momentum():
    graph = build([("conv", 0, 0), ("bn", 1, 1)])
    plan = make_plan(graph, 2, "liveness")
    update = next(s for s in plan.steps if s.kind == "update" and graph[s.node].layer.type_name == "Conv2d")
    params = [plan.buffers[p].nbytes for p, *_ in update.slots]
    assert update_bytes(graph, update.node) == 5 * sum(params)
    assert step_cost(update, graph, 2).bytes == 5 * sum(params)
    assert CPU.kernel_s(step_cost(update, graph, 2)) > CPU.step_overhead_s
