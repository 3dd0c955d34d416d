"""Choosing among plans: the one place the planner compares them.

Every choice the search makes is `pick(candidates, order, budget)`: of the candidates (Plans
or Assemblies) whose arena fits the budget, the first in one of the named orders, the earlier
candidate on a tie. A lower bound on a plan's time prunes a candidate before it is built when
a rival already beats it (`beaten`).
"""

FIRST = "first"  # the first candidate that fits
FASTEST = "fastest"  # the least predicted time
FASTEST_THEN_SMALLEST = "fastest, then smallest"  # the least predicted time, then the smallest arena
SMALLEST = "smallest"  # the smallest arena

_KEYS = {
    FIRST: lambda plan: 0,
    FASTEST: lambda plan: plan.predicted_s,
    FASTEST_THEN_SMALLEST: lambda plan: (plan.predicted_s, plan.arena_bytes),
    SMALLEST: lambda plan: plan.arena_bytes,
}
ROUNDING = 1e-9  # relative: predicted times closer than this are not told apart by a bound


def pick(candidates, order=FIRST, budget=None):
    """The candidate of `candidates` (Plans, or Assemblies of them) first in `order` among
    those whose arena is at most `budget` bytes (all of them without a budget); None when none
    fits."""
    key = _KEYS[order]
    best = best_key = None
    for candidate in candidates:
        plan = getattr(candidate, "plan", candidate)
        if budget is not None and plan.arena_bytes > budget:
            continue
        k = key(plan)
        if best is None or k < best_key:
            best, best_key = candidate, k
    return best


def fits(candidate, budget):
    """Whether `candidate` (a Plan or an Assembly) fits `budget` (None: always)."""
    return pick((candidate,), FIRST, budget) is not None


def beaten(at_least_s, rival):
    """Whether `rival` (a Plan or an Assembly) is faster than every plan predicted to take at
    least `at_least_s` seconds (by more than float rounding)."""
    return at_least_s > getattr(rival, "plan", rival).predicted_s * (1 + ROUNDING)
