"""The candidate plans the search chooses among, each an Assembly built by one function:

- `own_plan`: a policy row's own plan (with recomputation: memory-centric first, capped by the
  row it never exceeds, then the speed-centric segments that fit under its peak; copies hidden
  only where that does not raise its peak, see `within_peak`);
- `fitting_cap`: the plan of the row a growing row is capped by, where it fits the budget;
- `spilled`: a plan with the idle tensors spilled that it must lose to fit a budget;
- `optimal`: a plan grown into the room a budget leaves (snrt/scheduler/optimal.py's choice).

Building a candidate never chooses between two candidates by itself: where it must, it asks
snrt/scheduler/pick.py, which also holds the lower bound that prunes a candidate a rival beats.
"""

import bisect
from dataclasses import replace

from snrt.scheduler.lowering import SPILL_FLOOR
from snrt.scheduler.offsets import aligned
from snrt.scheduler.optimal import choose, frugal_decisions
from snrt.scheduler.pick import FASTEST, SMALLEST, beaten, fits, pick
from snrt.scheduler.policies import policy_named
from snrt.scheduler.recompute import droppable_nodes, speed_segments_that_fit
from snrt.scheduler.steps import backward_start, largest_step_bytes

REPLAY_ROUNDS = 4  # rebuilds of a capped plan while segments are moved to offloading
PEAK_ROUNDS = 4  # rebuilds of a plan while the copies that set its peak go just in time
SPILL_ROUNDS = 3  # plans assembled with a limit from the budget before the floor's
ROUNDS = 4  # plans assembled at most while growing a budget-optimal plan
WORTHWHILE = 0.01  # the least predicted saving, as a fraction of the iteration, a grown plan must offer


def own_plan(session, row, hide_copies=True, budget=None, rival=None):
    """The Assembly of Policy `row`'s own plan in Session `session`.

    The memory-centric plan is built first: with recomputation, every segment replayed per
    step (under a capped row, with the segments that cost more memory than the cap's own plan
    kept, see `_within_cap`), copies hidden behind compute (with `hide_copies`) except those
    that would raise its peak (`within_peak`). Both unless it fits `budget` as it is: then the
    budget is the memory limit, not the cap's plan or the peak. Segments that fit under its
    peak are then replayed speed-centric, and that plan is kept unless its arena is larger.

    `rival` is an Assembly the caller takes instead unless this one is faster (the cap's,
    which superneurons grows from when it is faster, see `grown`). It is returned instead of
    building a plan whose lower bound (see `time_at_least`) it beats: before the memory-centric
    plan (every node it drops replayed once), and before the speed-centric rebuild (every
    segment left after the cap's rounds replayed once).
    """
    recipe = session.recipe(row, hide_copies)
    if rival is not None and recipe.does.recomputes and beaten(time_at_least(session, droppable(session)), rival):
        return rival
    memory = session.assemble(recipe)
    if not (budget is not None and fits(memory, budget)):
        memory = within_peak(session, memory)
        if row.capped_by and memory.segments:
            memory = _within_cap(session, memory)
    if not memory.segments:
        return memory
    speed = speed_segments_that_fit(memory.plan, memory.segments)
    if not speed:
        return memory
    if rival is not None and beaten(time_at_least(session, [n for ns in memory.segments.values() for n in ns]), rival):
        return rival  # the memory-centric plan replays them too: the rival beats both
    return pick([session.assemble(replace(memory.recipe, speed=tuple(speed))), memory], SMALLEST)


def droppable(session):
    """The nodes a recomputing row's memory-centric plan drops and replays (all it may replay)."""
    steps = session.iteration.steps
    return droppable_nodes(session.graph, steps, backward_start(steps))


def time_at_least(session, replayed):
    """A lower bound on the predicted seconds of a plan of the session's iteration that replays
    each of the nodes `replayed` at least once: the seconds of the iteration's own steps (every
    plan runs them; the passes add replays, copies, waits and frees) and one replay of each,
    which costs what its forward step does (a plan's predicted time is the sum of its steps'
    seconds and the stalls, see cost.simulate)."""
    steps = session.iteration.steps
    forward = {s.node: s for s in steps if s.kind == "forward"}
    return sum(session.seconds(steps)) + sum(session.seconds([forward[node] for node in replayed]))


def within_peak(session, built):
    """Assembly `built` with the copies that raise its peak made just in time
    (`Recipe.just_in_time`, chosen by `copies_over_floor`), rebuilt while that lowers its
    peak without growing its arena (at most PEAK_ROUNDS rebuilds).

    A prefetch issued early, or an offload waited for late, holds its tensor on the device
    over the steps between; where those steps are the plan's fullest, the window costs memory
    that the plan does not otherwise need. Those copies then stall the compute stream instead
    (cost.simulate counts it); every other copy still hides."""
    recipe = built.recipe
    if not (recipe.hide_copies and recipe.does.copies):
        return built
    for _ in range(PEAK_ROUNDS):
        more = copies_over_floor(built.plan) - set(built.recipe.just_in_time)
        if not more:
            break
        tried = session.assemble(replace(built.recipe, just_in_time=tuple(sorted({*built.recipe.just_in_time,
                                                                                   *more}))))
        if tried.plan.peak_bytes >= built.plan.peak_bytes or tried.plan.arena_bytes > built.plan.arena_bytes:
            break
        built = tried
    return built


def copies_over_floor(plan):
    """The ids, as the copying passes name them (their first version), of the tensors whose
    copies `plan` should make just in time: the fewest, largest first, whose copy windows
    cover every step over the floor.

    A tensor is in a copy window over the steps from its prefetch to the wait for it, and
    after its offload until the wait for it (while it is still in use, it is held anyway).
    The floor is the most any step holds outside such windows: an estimate, not always exact,
    of the peak the plan would have with every copy just in time."""
    first_version = {b.name: b.id for b in plan.buffers if not b.is_copy}
    windows, issued = {}, {}  # first version -> [(first step, end step, bytes)]; buffer -> its copy in flight
    held = [0] * (len(plan.steps) + 1)  # bytes in copy windows, as differences from step to step
    for i, step in enumerate(plan.steps):
        if step.kind in ("offload", "prefetch"):
            issued[step.buffer] = i + (step.kind == "offload")
        elif step.kind == "wait" and step.buffer in issued:
            start, buffer = issued.pop(step.buffer), plan.buffers[step.buffer]
            if start < i:
                windows.setdefault(first_version[buffer.name.split("@")[0]], []).append((start, i, buffer.nbytes))
                held[start] += buffer.nbytes
                held[i] -= buffer.nbytes
    floor, in_windows = 0, 0
    for i, nbytes in enumerate(plan.device_bytes):
        in_windows += held[i]
        floor = max(floor, nbytes - in_windows)
    excess = [nbytes - floor for nbytes in plan.device_bytes]
    chosen = set()
    for b, spans in sorted(windows.items(), key=lambda item: (-max(n for _, _, n in item[1]), item[0])):
        if any(excess[i] > 0 for start, end, _ in spans for i in range(start, end)):
            chosen.add(b)
            for start, end, nbytes in spans:
                for i in range(start, end):
                    excess[i] -= nbytes
    return chosen


def _within_cap(session, memory):
    """The memory-centric Assembly `memory`, with segments kept (offloaded, not dropped) until
    its arena and its peak are at most those of the own plan of the row it is capped by
    (offload: superneurons never needs more memory than offloading alone), each rebuild
    `within_peak`.

    Replaying a segment holds its checkpoint and the replayed chain on the device at once,
    where offloading holds only the one prefetched tensor the backward step reads. So while
    the plan's arena or peak exceeds the cap's, the segments replayed around a step over the
    cap's peak are kept and the plan is rebuilt. If the arena is not within the cap's after
    REPLAY_ROUNDS, every segment is kept: the cap's plan under this row's name; a plan within
    the cap's arena whose peak is still over the cap's is kept as it is.
    """
    row = memory.recipe.row
    capped = own_plan(session, policy_named(row.capped_by), memory.recipe.hide_copies)
    cap = capped.plan
    kept, current = set(), memory
    for _ in range(REPLAY_ROUNDS):
        if fits(current, cap.arena_bytes) and current.plan.peak_bytes <= cap.peak_bytes:
            return current
        over = _segments_replayed_over(current.plan, current.segments, cap.peak_bytes)
        if not over:
            break
        kept |= over
        current = within_peak(session, session.assemble(replace(memory.recipe, kept=tuple(sorted(kept)))))
    if fits(current, cap.arena_bytes):
        return current
    return capped.named(row.name)


def _segments_replayed_over(plan, segments, limit):
    """Roots of the segments replayed next to a step whose device bytes exceed `limit`: the
    recompute steps from the compute step before it to the next compute step after it."""
    root_of = {node: root for root, nodes in segments.items() for node in nodes}
    steps, over = plan.steps, set()
    compute = [i for i, s in enumerate(steps) if s.kind in ("forward", "backward", "update")]
    for i, nbytes in enumerate(plan.device_bytes):
        if nbytes <= limit:
            continue
        at = bisect.bisect_left(compute, i)  # compute[at] is the first compute step at or after i
        before = compute[at - 1] if at else -1
        after = compute[at] if at < len(compute) else len(steps)
        over.update(root_of[s.node] for s in steps[before + 1:after + 1]
                    if s.kind == "recompute" and s.node in root_of)
    return over


def fitting_cap(session, row, budget, hide_copies=True):
    """The own plan of the row Policy `row` is capped by, when it fits `budget` and `row` would
    grow from it (see `grown`); else None."""
    if budget is None or not (session.does(row).grows and row.capped_by):
        return None
    cap = own_plan(session, policy_named(row.capped_by), hide_copies, budget)
    return cap if fits(cap, budget) else None


def grown(session, row, budget, built):
    """The plan of Assembly `built` (Policy `row`'s, fitting `budget`), grown into the room the
    budget leaves when the row grows.

    A row capped by another (superneurons by offload) grows from the faster of its plan and
    the cap's, when the cap's fits: offloading every segment instead of replaying it is one of
    its own plans (the one it falls back to when replays do not fit under the cap), and where
    copies hide behind compute it is the faster one."""
    if budget is None or not session.does(row).grows:
        return built.plan
    cap = fitting_cap(session, row, budget, built.recipe.hide_copies)
    base = pick([built, cap], FASTEST) if cap else built
    return replace(optimal(session, budget, base), policy=row.name)


def spilled(session, budget, base):
    """The Assembly of `base` with the idle tensors spilled that it must lose to fit `budget`
    (named "spilled(<policy>)"), or None when even spilling down to the floor does not fit (at
    once when the budget is below the resident bytes and the largest step's working set). The
    limit starts at the budget less the resident bytes and is cut by the arena's excess (gaps
    between offsets) while it does not fit; the last try spills to the floor."""
    limit = budget - resident_bytes(base.plan)
    if limit < largest_step_bytes(base.plan.steps, base.plan.buffers):  # no plan goes below the largest step
        return None
    for attempt in range(SPILL_ROUNDS + 1):
        assembly = session.assemble(replace(base.recipe, spill=limit if attempt < SPILL_ROUNDS else SPILL_FLOOR))
        if fits(assembly, budget):
            return assembly.named(f"spilled({base.plan.policy})")
        limit -= assembly.plan.arena_bytes - budget
    return None


def resident_bytes(plan):
    """The bottom of `plan`'s arena: its resident buffers, aligned (the same at every batch)."""
    return sum(aligned(b.nbytes) for b in plan.buffers if b.resident)


def optimal(session, budget, base):
    """The budget-optimal plan grown from Assembly `base` (a plan that fits `budget`), named
    "optimal(<policy>)": the segments it replays and the activations it offloads that are
    better kept on the device, chosen by snrt/scheduler/optimal.py.

    The choice is made against the base's device bytes and stalls. The arena also counts the
    gaps between offsets, so it can come out larger than the budget: the room is then cut by
    that much and the choice made again, and by twice as much each time it is still over (the
    gaps grow as the room shrinks; cut by the excess alone, the rounds could run out before a
    plan fits). Stalls are not additive (a copy stream that no longer carries one tensor
    carries the next one sooner), so while the grown plan is faster the choice is made again
    from it."""
    best, room, cut = base, budget, 1
    for _ in range(ROUNDS):
        bigger = _grow(session, best, room)
        if bigger is None:
            break
        if not fits(bigger, budget):
            room -= cut * (bigger.plan.arena_bytes - budget)
            cut *= 2
        elif pick([best, bigger], FASTEST) is bigger:
            best, room, cut = bigger, budget, 1
        else:
            break
    return replace(best.plan, policy=f"optimal({base.plan.policy})")


def _grow(session, base, room):
    """The Assembly with the decisions of Assembly `base` that `choose` undoes in `room` bytes,
    or None when they would save less than WORTHWHILE of its predicted time (not worth the
    memory they hold, nor the planning time of another assembly)."""
    written_by = {s.node: (s.output, *(b for _, b in s.aux)) for s in session.iteration.steps if s.kind == "forward"}
    decisions = {d.key: d for d in frugal_decisions(base.plan, base.segments, written_by, base.seconds, base.stalls)}
    worthwhile = WORTHWHILE * base.plan.predicted_s
    if sum(d.saves_s for d in decisions.values() if d.saves_s > 0) < worthwhile:  # no choice saves more
        return None
    choice = choose(decisions.values(), base.plan.device_bytes, room)
    if not choice or choice.saves_s < worthwhile:
        return None
    kept = tuple(sorted({*base.recipe.kept, *(root for kind, root in choice.undone if kind == "segment")}))
    resident = tuple(sorted({*base.recipe.resident, *(b for key in choice.undone for b in decisions[key].keeps)}))
    return session.assemble(replace(base.recipe, kept=kept, resident=resident))
