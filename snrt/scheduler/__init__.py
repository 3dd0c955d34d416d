"""Memory planning passes: execution order, liveness, recomputation, offload. Pure functions
from a Graph and options to a Plan; no numpy or cupy here."""

import dataclasses

from snrt.errors import SnrtError
from snrt.graph import Graph
from snrt.scheduler.plan import Plan
from snrt.scheduler.options import PlanOptions, check_flag
from snrt.scheduler.planner import BudgetError, make_plan
from snrt.scheduler.policies import POLICIES, Policy
from snrt.units import is_count, parse_bytes


def plan(graph, batch, policy="none", budget=None, training=True, **options):
    """The memory plan of one iteration of `graph` at `batch` under `policy`.

    `budget` is bytes or a string such as "12GiB"; see make_plan for the other options. A graph
    that is not a Graph, a batch that is not a positive int, a budget that is not a byte size,
    or an option PlanOptions does not have or of the wrong kind, is a SnrtError.
    """
    if not isinstance(graph, Graph):
        raise SnrtError(f"graph: expected a snrt.Graph, got {type(graph).__name__} (a loaded network file's is "
                        "snrt.load_config(path).graph)")
    accepted = ["hide_copies", *(f.name for f in dataclasses.fields(PlanOptions))]  # make_plan's own, and the fields
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise SnrtError(f"unknown planning option {unknown[0]!r}; expected one of {', '.join(accepted)}")
    if not is_count(batch):
        raise SnrtError(f"batch: expected a positive int, got {batch!r}")
    if "hide_copies" in options:  # make_plan's own; PlanOptions checks its fields
        check_flag("hide_copies", options["hide_copies"])
    try:
        budget = parse_bytes(budget) if budget is not None else None
    except ValueError as e:
        raise SnrtError(f"budget: {e}") from None
    return make_plan(graph, int(batch), policy, budget=budget, training=training, **options)


__all__ = ["BudgetError", "POLICIES", "Plan", "Policy", "make_plan", "plan"]
