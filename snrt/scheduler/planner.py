"""The planner: which plan of an iteration to make, and within which budget.

How one plan is made (snrt/scheduler/lowering.py): a Recipe names a policy row of
snrt/scheduler/policies.py and what to do beyond it; `lower` runs the passes of its table that
the recipe asks for, in this order, on the iteration snrt/scheduler/order.py builds:

    pass       runs when                                 module
    recompute  the row recomputes (training)             recompute.py  replay cheap segments
    offload    the row offloads (training)               offload.py    activations to the host and back
    stream     stream_parameters, a freeing row          stream.py     parameters and optimizer state
    spill      the recipe has a spill limit              spill.py      idle tensors at the fullest steps
    free       the row frees                             liveness.py   free after the last use
    then       offsets.py places every buffer in the arena; cost.simulate times the steps

Which plan to make (snrt/scheduler/candidates.py builds each candidate, snrt/scheduler/pick.py
compares them): for a row under a budget, the ladder

    own plan ──fits──> grown into the room left (rows that grow: superneurons)
       │ over
    just-in-time prefetches (rows that copy) ──fits──> grown
       │ over
    idle tensors spilled (freeing rows, training) ──fits──> that plan
       │ over
    nothing fits: make_plan raises BudgetError (the smallest budget that works, the largest
    batch that fits); plan_within returns the last plan tried; fitting_plan returns None

A row that grows and is capped by another (superneurons by offload) starts from the faster of
its own plan and the cap's (its own is not built when a lower bound shows the cap's is faster).
`auto` builds every row's own plan (and each copying row's just-in-time one) and picks the
fastest that fits, of those and the budget-optimal plans grown from them; when none fits with
parameters resident (training), the spilled plans, and the same with parameters streamed.

To add a policy: a row in policies.py, a capability in lowering.Does if it needs a new pass,
and that pass in lowering.PASSES. To change how offload windows are chosen: offload.py and the
copy windows of copies.py.
"""

from dataclasses import replace
from typing import NamedTuple

from snrt.errors import SnrtError
from snrt.scheduler.candidates import fitting_cap, grown, optimal, own_plan, spilled
from snrt.scheduler.lowering import SPILL_FLOOR
from snrt.scheduler.options import PlanOptions
from snrt.scheduler.pick import FASTEST_THEN_SMALLEST, SMALLEST, fits, pick
from snrt.scheduler.policies import AUTO, POLICIES, policy_named
from snrt.scheduler.session import Session, planning
from snrt.summary import human_bytes

__all__ = ["BudgetError", "PlanOptions", "each_plan", "fitting_plan", "make_plan", "plan_within"]


class BudgetError(SnrtError):
    """No policy fits the budget. `smallest_bytes` works at this batch; `largest_batch` fits."""

    def __init__(self, message, smallest_bytes, largest_batch):
        super().__init__(message)
        self.smallest_bytes, self.largest_batch = smallest_bytes, largest_batch


def require_budget(policy, budget):
    """A BudgetError when `policy` is "auto" and `budget` is None: auto picks the fastest plan
    that fits a budget, so it has nothing to pick without one (checked before any planning)."""
    if policy == AUTO and budget is None:
        raise BudgetError("policy 'auto' picks the fastest plan within a budget: give one (memory.budget, or "
                          "for example --budget 12GiB)", None, None)


def make_plan(graph, batch, policy="none", budget=None, hide_copies=True, **options):
    """The Plan of one iteration of `graph` at `batch` under `policy` (a name of
    snrt/scheduler/policies.py, or "auto") whose arena fits `budget` (bytes; None: any), by the
    ladder of the module docstring; `options` are PlanOptions' fields. A copying policy
    prefetches early enough to hide its copies behind compute; `hide_copies` False asks for its
    just-in-time plan directly. Raises BudgetError when nothing fits."""
    with planning():
        session = Session(graph, batch, PlanOptions(**options))
        found = _search(session, policy, budget, hide_copies)
        if found.plan is None:
            raise _infeasible(found.session, budget, found.rows, found.candidates,
                              auto_from=session if policy == AUTO else None)
        return found.plan


def fitting_plan(graph, batch, policy, budget, **options):
    """make_plan(graph, batch, policy, budget=budget, **options), or None where it would raise
    (without the search for the largest batch that fits that its error states)."""
    with planning():
        return _search(Session(graph, batch, PlanOptions(**options)), policy, budget).plan


def each_plan(graph, batch, policies, budget=None, hide_copies=True, **options):
    """(policy, Plan) for each name in `policies` (not "auto"), made in one session: a plan one
    policy builds on (superneurons on offload's) is assembled once for all of them.

    Without a `budget`, each is make_plan(graph, batch, policy, **options). With one, a policy
    whose plan fits it gives the plan make_plan(..., budget=budget) gives (superneurons skips
    its cap and grows into the room left), and one whose plan does not fit gives its own plan,
    over the budget (where make_plan would prefetch just in time and spill)."""
    with planning():
        session = Session(graph, batch, PlanOptions(**options))
        for name in policies:
            row = policy_named(name)
            built = own_plan(session, row, hide_copies, budget, fitting_cap(session, row, budget, hide_copies))
            yield name, grown(session, row, budget, built) if fits(built, budget) else built.plan


def plan_within(graph, batch, policy, budget, spill=True, **options):
    """make_plan(graph, batch, policy, budget=budget, **options) for a policy (not "auto"), but
    where nothing fits, the last plan it tried (its arena over the budget) instead of the
    BudgetError and its search for the largest batch: what a search over sizes probes. (A
    policy that grows is not grown into the room left: that plan fits when this one does.)
    `spill` False leaves idle tensors where the policy puts them (the policy's own plans)."""
    with planning():
        session = Session(graph, batch, PlanOptions(**options))
        return _ladder(session, policy_named(policy), budget, spill=spill)[0]


class _Found(NamedTuple):
    """What a search found: the plan (None when nothing fits), and what BudgetError is built
    from otherwise: the Session searched last, the rows tried and their candidates (None:
    build them)."""

    plan: object
    session: Session
    rows: tuple
    candidates: list = None


def _search(session, policy, budget, hide_copies=True):
    """The _Found of make_plan(..., policy, budget, hide_copies) in Session `session`."""
    if policy == AUTO:
        return _auto(session, budget)
    row = policy_named(policy)
    plan, built = _ladder(session, row, budget, hide_copies, rival=fitting_cap(session, row, budget, hide_copies))
    if not fits(plan, budget):
        return _Found(None, session, (row,))
    return _Found(grown(session, row, budget, built) if built else plan, session, (row,))


def _ladder(session, row, budget, hide_copies=True, spill=True, rival=None):
    """(plan, its Assembly, or None when spilled): Policy `row`'s own plan (or `rival`, see
    candidates.own_plan); over `budget`, its just-in-time plan (rows that copy), then, with
    `spill`, that plan with idle tensors spilled (rows that spill); the last one tried when
    none fits."""
    does = session.does(row)
    built = own_plan(session, row, hide_copies, budget, rival)
    if not fits(built, budget) and does.copies and hide_copies:
        built = own_plan(session, row, hide_copies=False)
    if not fits(built, budget) and spill and does.spills:
        smaller = spilled(session, budget, built)
        if smaller:
            return replace(smaller.plan, policy=row.name), None
    return built.plan, built


def _candidates(session, rows, budget):
    """The Assemblies of Policy `rows`' own plans under `budget`, the copying ones also with
    just-in-time prefetch."""
    return [own_plan(session, row, hide, budget)
            for row in rows for hide in ((True, False) if session.does(row).copies else (True,))]


def _just_in_time(candidates):
    """The Assemblies of `candidates` that spilling starts from: each spilling row's
    just-in-time one (its smallest)."""
    return [c for c in candidates if c.recipe.does.spills and not (c.recipe.hide_copies and c.recipe.does.copies)]


def _auto(session, budget):
    """The _Found of policy auto: the fastest plan whose arena fits `budget` (ties: the smaller
    arena), of the rows' and of the budget-optimal ones grown from them; when none fits with
    parameters resident (a training plan), the fastest of those with idle tensors spilled and
    of the same with parameters streamed."""
    require_budget(AUTO, budget)
    rows = tuple(POLICIES.values())
    candidates = _candidates(session, rows, budget)
    suffix = ", streamed" if session.options.stream_parameters else ""
    named = [(p, suffix) for p in _fitting(session, budget, candidates)]
    if not named:
        named = [(p, suffix) for p in _spilled_plans(session, budget, candidates)]
        if session.options.training and not session.options.stream_parameters:
            session = session.with_options(stream_parameters=True)
            candidates = _candidates(session, rows, budget)
            streamed = _fitting(session, budget, candidates) or _spilled_plans(session, budget, candidates)
            named += [(p, ", streamed") for p in streamed]
    best = pick([replace(p, policy=f"auto:{p.policy}{suffix}") for p, suffix in named], FASTEST_THEN_SMALLEST)
    return _Found(best, session, rows, candidates)


def _fitting(session, budget, candidates):
    """The plans of Assemblies `candidates` that fit `budget`, and the budget-optimal ones
    grown from them: from the first fitting candidate of each policy that replays, offloads or
    streams parameters (its plan that hides its copies, else its just-in-time one)."""
    fitting = [c for c in candidates if fits(c, budget)]
    bases = {}
    for c in fitting:
        if c.recipe.does.undoable:
            bases.setdefault(c.plan.policy, c)
    return [c.plan for c in fitting] + [optimal(session, budget, c) for c in bases.values()]


def _spilled_plans(session, budget, candidates):
    """The plans of Assemblies `candidates` spilled to fit `budget`, where spilling gets there."""
    return [s.plan for s in (spilled(session, budget, c) for c in _just_in_time(candidates)) if s]


def _infeasible(session, budget, rows, candidates=None, auto_from=None):
    """The BudgetError for `budget`: the smallest budget that works, the largest batch that fits.
    For a policy, the batch is the largest at which the recipe of its smallest plan fits; for
    auto (`auto_from`: the Session it started from, before it streamed parameters), the largest
    at which auto itself finds a plan, named in the message."""
    candidates = candidates or _candidates(session, rows, budget)
    floors = [session.assemble(replace(c.recipe, spill=SPILL_FLOOR)) for c in _just_in_time(candidates)]
    frugal = pick(candidates + floors, SMALLEST)
    smallest, row, hide, spill = frugal.plan.arena_bytes, frugal.recipe.row, frugal.recipe.hide_copies, frugal.recipe.spill
    policy = f"policy {row.name}" + (", parameters streamed" if session.options.stream_parameters else "")
    found_at = {}

    def fits_at(batch):
        if auto_from is not None:
            found_at[batch] = _auto(auto_from.at_batch(batch), budget).plan
            return found_at[batch] is not None
        at = session.at_batch(batch)
        built = own_plan(at, row, hide, budget)
        return fits(at.assemble(replace(built.recipe, spill=spill)) if spill else built, budget)

    low, high = 0, session.batch - 1  # the largest batch in [1, batch) that fits, by bisection
    persistent = sum(b.nbytes for b in frugal.plan.buffers if b.resident)  # the same at every batch
    if high >= 1 and (persistent > budget or not fits_at(1)):  # often nothing fits: say so without a bisection
        high = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits_at(mid):
            low = mid
        else:
            high = mid - 1
    largest = low
    names = "/".join(r.name for r in rows)
    if largest:
        where = f"the largest batch that fits is {largest} ({found_at[largest].policy if found_at else policy})"
    elif session.options.training and not session.options.stream_parameters:  # streaming them would help
        held = (f"the parameters and optimizer state alone ({human_bytes(persistent)}) are too large to stay on the "
                "device" if persistent > budget else "not with the parameters and optimizer state on the device")
        where = (f"no batch size fits: {held}; stream them from host memory (--stream-parameters, "
                 "memory.stream_parameters) or use policy auto")
    else:
        where = f"no batch size fits: even batch 1 needs more under {policy}"
    return BudgetError(
        f"budget {human_bytes(budget)} is too small for batch {session.batch} under {names}: the smallest "
        f"budget that works is {human_bytes(smallest)} ({smallest} bytes, {policy}); {where}",
        smallest, largest)
