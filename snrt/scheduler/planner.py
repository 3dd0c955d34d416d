"""The planner: the passes a policy's row (snrt/scheduler/policies.py) asks for turn an
iteration into a Plan; `auto` picks the fastest row whose arena fits the budget.

A budget (bytes) is checked against the arena the plan needs; an infeasible one is an error
that states the smallest budget that works and the largest batch that fits.
"""

import bisect
import contextlib
import gc
import threading
from collections import Counter
from dataclasses import dataclass, replace

from snrt.errors import SnrtError
from snrt.layers.base import LAYER_KERNELS
from snrt.scheduler import cost as cost_models
from snrt.scheduler.cost import CostModel
from snrt.scheduler.liveness import insert_frees, trace_allocations
from snrt.scheduler.offload import plan_offload, with_host_slots
from snrt.scheduler.offsets import aligned, assign_offsets
from snrt.scheduler.order import BufferTable, build_iteration
from snrt.scheduler.plan import Plan
from snrt.scheduler.optimal import choose, frugal_decisions
from snrt.scheduler.policies import AUTO, POLICIES, policy_named
from snrt.scheduler.reduce import BUCKET_BYTES
from snrt.scheduler.spill import plan_spills
from snrt.scheduler.stream import COMPUTE_KINDS, plan_streaming
from snrt.scheduler.recompute import (backward_start, droppable_nodes, largest_step_bytes, plan_recomputation,
                                      speed_segments_that_fit, version_buffers)
from snrt.summary import human_bytes


@dataclass(frozen=True)
class PlanOptions:
    """What every pass needs besides the graph, batch and policy.

    `kernels` is the kernel choice of the backend that will run the plan: its
    `workspace_bytes(layer, in_shapes, phase, itemsize)` sizes the workspaces (cuDNN's on the
    GPU; the layers' own on the CPU).
    """

    training: bool = True
    optimizer_states: tuple = ("momentum",)
    deferred_updates: bool = False
    cost_model: CostModel = cost_models.CPU
    dtype: str = "float32"
    kernels: object = LAYER_KERNELS
    ranks: int = 1
    bucket_bytes: int = BUCKET_BYTES
    stream_parameters: bool = False


class BudgetError(SnrtError):
    """No policy fits the budget. `smallest_bytes` works at this batch; `largest_batch` fits."""

    def __init__(self, message, smallest_bytes, largest_batch):
        super().__init__(message)
        self.smallest_bytes, self.largest_batch = smallest_bytes, largest_batch


def make_plan(graph, batch, policy="none", budget=None, training=True, optimizer_states=("momentum",),
              cost_model=cost_models.CPU, dtype="float32", kernels=LAYER_KERNELS, hide_copies=True,
              deferred_updates=False, ranks=1, bucket_bytes=BUCKET_BYTES, stream_parameters=False):
    """The Plan of one iteration of `graph` at `batch` under `policy` (a name of
    snrt/scheduler/policies.py, or "auto").

    `budget` (bytes) is checked against the arena; `training` False gives a forward-only
    plan; `optimizer_states` names the optimizer's buffers of each parameter (one planned buffer
    per parameter and name: SGD's ("momentum",), () without momentum, Adam's ("exp_avg",
    "exp_avg_sq")); `deferred_updates` runs every update after the whole backward pass (what
    clipping by the global gradient norm needs: all parameter gradients stay alive to the end,
    and the plan counts them) instead of each right after its layer's backward; `kernels` see
    PlanOptions. A copying policy prefetches early enough to hide its copies behind compute,
    and, when that plan exceeds the budget, just in time (smaller, slower); `hide_copies`
    False asks for the just-in-time plan directly. With several `ranks` (data parallel), each
    rank runs this plan on its `batch` samples and the parameter gradients are summed across
    the ranks in buckets of about `bucket_bytes` (snrt/scheduler/reduce.py). With
    `stream_parameters`, a training plan of a freeing policy keeps parameters and optimizer
    state in the host store and brings each to the device only while steps use it
    (snrt/scheduler/stream.py).
    """
    opts = PlanOptions(training, tuple(optimizer_states), deferred_updates, cost_model, dtype, kernels, ranks,
                       bucket_bytes, stream_parameters)
    with _planning():
        return _plan(graph, batch, policy, budget, opts, hide_copies)


def each_plan(graph, batch, policies, budget=None, **options):
    """(policy, Plan) for each name in `policies` (not "auto"), made in one go: a plan one
    policy builds on (superneurons on offload's) is assembled once for all of them.

    Without a `budget`, each is make_plan(graph, batch, policy, **options). With one, a policy
    whose plan fits it gives the plan make_plan(..., budget=budget) gives (superneurons skips
    its cap and grows into the room left), and one whose plan does not fit gives its own plan,
    over the budget (where make_plan would prefetch just in time and spill)."""
    opts = PlanOptions(**{k: tuple(v) if k == "optimizer_states" else v
                          for k, v in options.items() if k != "hide_copies"})
    hide_copies = options.get("hide_copies", True)
    with _planning():
        for name in policies:
            policy = policy_named(name)
            built = _built(graph, batch, policy, opts, hide_copies, budget,  # over it: as without a budget
                           _fitting_cap(graph, batch, policy, budget, opts, hide_copies))
            over = budget is not None and built.plan.arena_bytes > budget
            yield name, built.plan if over else _grown(graph, batch, policy, budget, opts, built)


_SESSION = threading.RLock()  # held by the thread whose planning session owns _Assembled


@contextlib.contextmanager
def _planning():
    """One planning session: the plans assembled in it are shared (see _Assembled) and let go
    at its end. Sessions in different threads take turns (they would share the caches).

    The passes make hundreds of thousands of small objects that reference counting frees; the
    cyclic collector, triggered by their sheer number, would walk every live plan object again
    and again (a third of ResNet-2500's planning time), so it is paused meanwhile."""
    with _SESSION:
        collecting = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            _Assembled.forget()  # the plans this session made are not kept alive
            if collecting:
                gc.enable()


def plan_within(graph, batch, policy, budget, spill=True, **options):
    """make_plan(graph, batch, policy, budget=budget, **options) for a policy (not "auto"), but
    where nothing fits, the last plan it tried (its arena over the budget) instead of the
    BudgetError and its search for the largest batch: what a search over sizes probes. (A
    policy that grows is not grown into the room left: that plan fits when this one does.)
    `spill` False leaves idle tensors where the policy puts them (the policy's own plans)."""
    opts = PlanOptions(**{k: tuple(v) if k == "optimizer_states" else v for k, v in options.items()})
    with _planning():
        return _within(graph, batch, policy_named(policy), budget, opts, hide_copies=True, spill=spill)[0]


def _plan(graph, batch, policy, budget, opts, hide_copies):
    if policy == AUTO:
        return _auto(graph, batch, budget, opts)
    policy = policy_named(policy)
    plan, built = _within(graph, batch, policy, budget, opts, hide_copies,
                          rival=_fitting_cap(graph, batch, policy, budget, opts, hide_copies))
    if budget is not None and plan.arena_bytes > budget:
        raise _infeasible(graph, batch, budget, (policy,), opts)
    return _grown(graph, batch, policy, budget, opts, built) if built else plan


def _grown(graph, batch, policy, budget, opts, built):
    """The plan of _Built `built` (Policy `policy`'s, fitting `budget`), grown into the room the
    budget leaves when the policy grows (a training plan under a budget).

    A policy capped by another (superneurons by offload) grows from the faster of its plan and
    the cap's, when the cap's fits: offloading every segment instead of replaying it is one of
    its own plans (the one it falls back to when replays do not fit under the cap), and where
    copies hide behind compute it is the faster one."""
    if budget is None or not policy.grows or not opts.training:
        return built.plan
    cap = _fitting_cap(graph, batch, policy, budget, opts, built.hide_copies)
    base = cap if cap and cap.plan.predicted_s < built.plan.predicted_s else built
    return replace(_optimal(graph, batch, budget, opts, base), policy=policy.name)


def _fitting_cap(graph, batch, policy, budget, opts, hide_copies):
    """The _Built plan of the policy Policy `policy` is capped by, when it fits `budget` and
    `policy` would grow from it (see _grown); else None."""
    if budget is None or not (policy.grows and policy.capped_by and opts.training):
        return None
    cap = _built(graph, batch, policy_named(policy.capped_by), opts, hide_copies)
    return cap if cap.plan.arena_bytes <= budget else None


def _within(graph, batch, policy, budget, opts, hide_copies, spill=True, rival=None):
    """(plan, the _Built it is, or None when spilled): Policy `policy`'s plan; over `budget`,
    its just-in-time plan (copying policies), then, with `spill`, that plan with idle tensors
    spilled (freeing policies in training); the last one tried when none fits. `rival`: see
    _built (its first plan, hiding copies as asked)."""
    built = _built(graph, batch, policy, opts, hide_copies, budget, rival)
    if budget is not None and built.plan.arena_bytes > budget and _copies(policy, opts) and hide_copies:
        built = _built(graph, batch, policy, opts, hide_copies=False)
    if budget is not None and built.plan.arena_bytes > budget and spill and _spills(policy, opts):
        spilled = _spilled(graph, batch, budget, opts, built)
        if spilled:
            return replace(spilled, policy=policy.name), None
    return built.plan, built


@dataclass(frozen=True)
class _Built:
    """A policy's plan and how it was assembled: `_assemble(graph, batch, row, opts, hide_copies,
    speed, kept)` gives it (`row` is the policy's, or its cap's when that is what it fell back
    to) and `segments` ({checkpoint: [nodes]}) are the segments it replays; `resident`, the
    activations it keeps on the device that the row would offload and the parameters and
    optimizer states it keeps there that the row would stream (see _optimal)."""

    plan: Plan
    row: object
    hide_copies: bool
    segments: dict
    speed: tuple
    kept: tuple
    resident: tuple = ()


def _built(graph, batch, policy, opts, hide_copies=True, budget=None, rival=None):
    """The _Built plan of Policy `policy`.

    With recomputation, the all-memory-centric plan is built first (under a capped policy,
    with the segments that cost more memory than the cap's plan kept, see `_recompute_within_cap`,
    unless it fits `budget` as it is: then the budget is the memory limit, not the cap);
    segments that fit under its peak are then replayed speed-centric, and that plan is kept
    unless its arena is larger.

    `rival` is a _Built plan the caller takes instead unless this one is faster (the cap's,
    which superneurons grows from when it is faster, see _grown). It is returned at once when
    replaying every node the memory-centric plan drops, once each, costs more than the
    rival's stalls (see _time_at_least): then neither plan can be faster. (When the
    memory-centric plan exceeds the budget, the cap's rounds would keep some segments and
    replay fewer nodes; that plan is not tried.) The speed-centric rebuild is skipped when
    the segments left after those rounds cost as much.
    """
    if rival is not None and policy.recomputes and _slower_than(graph, batch, opts, _droppable(graph, batch, opts),
                                                               rival):
        return rival
    plan, segments = _assemble(graph, batch, policy, opts, hide_copies)
    kept, row = (), policy
    if policy.capped_by and segments and (budget is None or plan.arena_bytes > budget):
        plan, segments, kept, row = _recompute_within_cap(graph, batch, policy, opts, hide_copies, plan, segments)
    if segments:
        speed = speed_segments_that_fit(plan, segments)
        replayed = [node for nodes in segments.values() for node in nodes]
        if speed and not (rival is not None and _slower_than(graph, batch, opts, replayed, rival)):
            faster, _ = _assemble(graph, batch, policy, opts, hide_copies, speed, kept)
            if faster.arena_bytes <= plan.arena_bytes:
                return _Built(faster, row, hide_copies, segments, tuple(speed), kept)
    return _Built(plan, row, hide_copies, segments, (), kept)


def _slower_than(graph, batch, opts, replayed, rival):
    """Whether every plan that replays each of the nodes `replayed` is slower than _Built
    `rival`'s plan (by more than float rounding)."""
    return _time_at_least(graph, batch, opts, replayed) > rival.plan.predicted_s * (1 + 1e-9)


def _time_at_least(graph, batch, opts, replayed):
    """A lower bound on the predicted seconds of a plan of this iteration that replays each of
    the nodes `replayed` at least once: the seconds of the iteration's own steps (every plan
    runs them; the passes add replays, copies, waits and frees) and one replay of each, which
    costs what its forward step does (a plan's predicted time is the sum of its steps'
    seconds and the stalls, see cost.simulate)."""
    it = _Assembled.iteration_for(graph, batch, opts)
    seconds = _seconds_of(graph, batch, opts.cost_model)
    forward = {s.node: s for s in it.steps if s.kind == "forward"}
    return sum(seconds(it.steps)) + sum(seconds([forward[node] for node in replayed]))


def _droppable(graph, batch, opts):
    """The nodes a recomputing policy's memory-centric plan drops and replays (all it may replay)."""
    steps = _Assembled.iteration_for(graph, batch, opts).steps
    return droppable_nodes(graph, steps, backward_start(steps))


REPLAY_ROUNDS = 4  # rebuilds of a capped plan while segments are moved to offloading


def _recompute_within_cap(graph, batch, policy, opts, hide_copies, plan, segments):
    """(plan, replayed segments, kept segment roots, the Policy assembled) whose arena is at
    most the plan of `policy.capped_by` (offload: superneurons never needs more memory than
    offloading alone).

    Replaying a segment holds its checkpoint and the replayed chain on the device at once,
    where offloading holds only the one prefetched tensor the backward step reads. So while
    the plan's arena exceeds the cap's, the segments replayed around a step over the cap's
    peak are kept (offloaded, not dropped) and the plan is rebuilt; if that does not get
    there within REPLAY_ROUNDS, every segment is kept (the cap's plan under this name).
    """
    capped_by = policy_named(policy.capped_by)
    cap, _ = _assemble(graph, batch, capped_by, opts, hide_copies)
    kept = set()
    for _ in range(REPLAY_ROUNDS):
        if plan.arena_bytes <= cap.arena_bytes:
            return plan, segments, tuple(sorted(kept)), policy
        over = _segments_replayed_over(plan, segments, cap.peak_bytes)
        if not over:
            break
        kept |= over
        plan, segments = _assemble(graph, batch, policy, opts, hide_copies, (), tuple(sorted(kept)))
    if plan.arena_bytes <= cap.arena_bytes:
        return plan, segments, tuple(sorted(kept)), policy
    return replace(cap, policy=policy.name), {}, (), capped_by


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


class _Assembled:
    """The iteration built last, and the plans assembled from it during one make_plan, which
    assembles several (superneurons: its own, offload's as its cap, a faster rebuild; auto:
    every policy, with superneurons again), so each is made once. The iteration stays for the
    next call (`snrt plan` plans policy after policy; ResNet-2500's is about 29 MiB); plans
    are let go when the call returns. Neither is changed once made (the passes copy what
    they change)."""

    key = None
    iteration = None
    plans = {}
    step_seconds = {}  # (kind, node, bytes) -> predicted seconds, for this iteration's graph, batch and cost model
    timings = {}  # id(plan) -> (its steps' predicted seconds, {buffer: seconds stalled}) of the plans in `plans`

    @classmethod
    def forget(cls):
        cls.plans, cls.timings = {}, {}

    @classmethod
    def iteration_for(cls, graph, batch, opts):
        inputs = tuple(repr(n.layer) for n in graph.nodes.values() if not n.inputs)  # shapes and dtypes
        key = (graph.fingerprint(), inputs, batch, opts)
        if key != cls.key:
            cls.key, cls.plans, cls.step_seconds, cls.timings = key, {}, {}, {}
            cls.iteration = build_iteration(graph, batch, opts.training, opts.optimizer_states, opts.dtype,
                                            opts.kernels, opts.deferred_updates, opts.ranks, opts.bucket_bytes)
        return cls.iteration


NO_COMPUTE = ("offload", "prefetch", "wait", "free")  # step kinds that take no compute-stream time


def _seconds_of(graph, batch, cost_model):
    """steps -> their predicted compute seconds, each (kind, node) computed once for all the
    plans of one iteration (see _Assembled)."""
    known = _Assembled.step_seconds

    def seconds(steps):
        out = []
        append = out.append
        for s in steps:
            kind = s.kind
            if kind in NO_COMPUTE:
                append(0.0)
                continue
            key = (kind, s.node, 0) if kind in COMPUTE_KINDS else (kind, None, getattr(s, "nbytes", 0))
            value = known.get(key)
            if value is None:
                value = known[key] = cost_models.step_seconds(s, graph, batch, cost_model)
            append(value)
        return out
    return seconds


def _assemble(graph, batch, policy, opts, hide_copies, speed_segments=(), kept_segments=(), resident=(),
              spill=None):
    """(plan, replayed segments) of Policy `policy` with the given speed-centric and kept (not
    dropped) segments, and the buffer ids in `resident` never offloaded or streamed, each made
    once (see _Assembled). With `spill` (bytes, or SPILL_FLOOR), the tensors idle at steps over
    that many non-resident bytes are spilled (snrt/scheduler/spill.py)."""
    it = _Assembled.iteration_for(graph, batch, opts)
    key = (policy.name, hide_copies, tuple(speed_segments), tuple(kept_segments), tuple(resident), spill)
    if key not in _Assembled.plans:
        _Assembled.plans[key] = _assemble_from(it, graph, batch, policy, opts, hide_copies, speed_segments,
                                               kept_segments, resident, spill)
    return _Assembled.plans[key]


def _assemble_from(it, graph, batch, policy, opts, hide_copies, speed_segments, kept_segments, resident, spill):
    """_assemble's plan, from Iteration `it`."""
    training, cost_model = opts.training, opts.cost_model
    step_seconds = _seconds_of(graph, batch, cost_model)
    table = BufferTable()
    table.buffers = list(it.buffers)
    steps = list(it.steps)
    keep = {b for out, _, probs, labels, _ in it.losses for b in (out, probs, labels)}
    fed = tuple(b for _, b in it.inputs) + tuple(loss[1] for loss in it.losses if loss[1] >= 0)
    slots, host_bytes, segments = {}, 0, {}
    if policy.recomputes and training:
        steps, segments = plan_recomputation(graph, steps, table, speed_segments, kept_segments)
    streams = opts.stream_parameters and training and policy.frees
    if policy.offloads and training:
        seconds = step_seconds(steps)
        steps, slots, host_bytes = plan_offload(steps, table.buffers, seconds, cost_model, keep | set(resident),
                                                hide_copies)
        if not streams:  # else versioned with the streamed copies (streaming reads no activation's version)
            steps = version_buffers(steps, table)
    if streams:
        steps, host_bytes = plan_streaming(steps, table, step_seconds(steps), cost_model, host_bytes, hide_copies,
                                           resident)
        steps = version_buffers(steps, table)
    if spill is not None and training and policy.frees:
        limit = largest_step_bytes(steps, table.buffers) if spill == SPILL_FLOOR else spill
        steps, host_bytes = plan_spills(steps, table, slots, limit, host_bytes, keep, fed)
        steps = version_buffers(steps, table, fed)
    if policy.frees:
        steps = insert_frees(steps, table.buffers, keep)
    buffers = with_host_slots(table.buffers, slots)
    allocations, frees, device_bytes = trace_allocations(buffers, steps, fed)
    buffers, arena_bytes = assign_offsets(buffers, allocations, frees)
    seconds, stalls = step_seconds(steps), {}
    predicted_s, stall_s = cost_models.simulate(steps, buffers, seconds, cost_model, stalls)
    replays = Counter(s.node for s in steps if s.kind == "recompute")
    recompute_flops = sum(count * graph[node].layer.cost(graph.in_shapes(node, batch), "forward").flops
                          for node, count in replays.items())
    plan = Plan(batch, policy.name, training, tuple(buffers), tuple(steps), tuple(device_bytes), arena_bytes,
                host_bytes, tuple(allocations), tuple(it.inputs), it.losses,
                predicted_s=predicted_s, stall_s=stall_s, recompute_flops=recompute_flops, ranks=opts.ranks)
    _Assembled.timings[id(plan)] = (seconds, stalls)
    return plan, segments


def _candidates(graph, batch, policies, opts):
    """[_Built] for Policy rows `policies`, the copying ones also with just-in-time prefetch."""
    return [_built(graph, batch, p, opts, hide)
            for p in policies for hide in ((True, False) if _copies(p, opts) else (True,))]


def _spills(policy, opts):
    """Whether plans of Policy `policy` may spill idle tensors (see snrt/scheduler/spill.py)."""
    return policy.frees and opts.training


SPILL_FLOOR = "floor"  # a spill limit: the largest step's working set (the smallest arena spilling gives)
SPILL_ROUNDS = 3  # plans assembled with a limit from the budget before the floor's


def _spilled(graph, batch, budget, opts, base):
    """The plan of _Built `base` with the idle tensors spilled that it must lose to fit
    `budget` (named "spilled(<policy>)"), or None when even spilling down to the floor does not
    fit (at once when the budget is below the resident bytes and the largest step's working
    set). The limit starts at the budget less the resident bytes and is cut by the arena's
    excess (gaps between offsets) while it does not fit; the last try spills to the floor."""
    limit = budget - _resident_bytes(base.plan)
    if limit < largest_step_bytes(base.plan.steps, base.plan.buffers):  # no plan goes below the largest step
        return None
    for attempt in range(SPILL_ROUNDS + 1):
        plan = _spilled_to(graph, batch, opts, base, limit if attempt < SPILL_ROUNDS else SPILL_FLOOR)
        if plan.arena_bytes <= budget:
            return replace(plan, policy=f"spilled({base.plan.policy})")
        limit -= plan.arena_bytes - budget
    return None


def _spilled_to(graph, batch, opts, base, spill):
    """The plan of _Built `base` spilled down to `spill` (bytes, or SPILL_FLOOR)."""
    return _assemble(graph, batch, base.row, opts, base.hide_copies, base.speed, base.kept, base.resident, spill)[0]


def _just_in_time(candidates, opts):
    """The _Built plans of `candidates` that spilling starts from: each freeing row's
    just-in-time one (its smallest), in training."""
    return [c for c in candidates if _spills(c.row, opts) and not (c.hide_copies and _copies(c.row, opts))]


def _resident_bytes(plan):
    """The bottom of `plan`'s arena: its resident buffers, aligned (the same at every batch)."""
    return sum(aligned(b.nbytes) for b in plan.buffers if b.resident)


def _copies(policy, opts):
    """Whether plans of Policy `policy` copy tensors between host and device (and so have a
    just-in-time variant)."""
    return policy.offloads or (opts.stream_parameters and opts.training and policy.frees)


def _auto(graph, batch, budget, opts):
    """The fastest plan whose arena fits `budget` (ties: the smaller arena), of the policies'
    and of the budget-optimal ones grown from them; when none fits with parameters resident
    (a training plan), the fastest of those with idle tensors spilled and of the same with
    parameters streamed."""
    if budget is None:
        raise SnrtError("policy 'auto' needs a budget (for example --budget 12GiB)")
    rows = tuple(POLICIES.values())
    candidates = _candidates(graph, batch, rows, opts)
    suffix = ", streamed" if opts.stream_parameters else ""
    named = [(p, suffix) for p in _fitting(graph, batch, budget, opts, candidates)]
    if not named:
        named = [(p, suffix) for p in _spilled_plans(graph, batch, budget, opts, candidates)]
        if opts.training and not opts.stream_parameters:
            opts = replace(opts, stream_parameters=True)
            candidates = _candidates(graph, batch, rows, opts)
            streamed = (_fitting(graph, batch, budget, opts, candidates)
                        or _spilled_plans(graph, batch, budget, opts, candidates))
            named += [(p, ", streamed") for p in streamed]
    if not named:
        raise _infeasible(graph, batch, budget, rows, opts, candidates)
    best, suffix = min(named, key=lambda n: (n[0].predicted_s, n[0].arena_bytes))
    return replace(best, policy=f"auto:{best.policy}{suffix}")


def _fitting(graph, batch, budget, opts, candidates):
    """The plans of _Built `candidates` that fit `budget`, and the budget-optimal ones grown
    from them."""
    fitting = [c for c in candidates if c.plan.arena_bytes <= budget]
    return [c.plan for c in fitting] + [_optimal(graph, batch, budget, opts, c) for c in _bases(fitting, opts)]


def _spilled_plans(graph, batch, budget, opts, candidates):
    """The plans of _Built `candidates` spilled to fit `budget`, where spilling gets there."""
    return [p for p in (_spilled(graph, batch, budget, opts, c) for c in _just_in_time(candidates, opts)) if p]


def _bases(fitting, opts):
    """The _Built plans the budget-optimal choice starts from: of each policy that replays,
    offloads or streams parameters, its fitting plan that hides its copies, else its
    just-in-time one."""
    first = {}
    for c in fitting:
        if c.row.recomputes or c.row.offloads or _copies(c.row, opts):
            first.setdefault(c.plan.policy, c)
    return list(first.values())


ROUNDS = 4  # plans assembled at most while growing a budget-optimal plan
WORTHWHILE = 0.01  # the least predicted saving, as a fraction of the iteration, a grown plan must offer


def _optimal(graph, batch, budget, opts, base):
    """The budget-optimal plan grown from _Built `base` (a plan that fits `budget`), named
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
        grown = _grow(graph, batch, opts, best, room)
        if grown is None:
            break
        if grown.plan.arena_bytes > budget:
            room -= cut * (grown.plan.arena_bytes - budget)
            cut *= 2
        elif grown.plan.predicted_s < best.plan.predicted_s:
            best, room, cut = grown, budget, 1
        else:
            break
    return replace(best.plan, policy=f"optimal({base.plan.policy})")


def _grow(graph, batch, opts, base, room):
    """The _Built plan with the decisions of _Built `base` that `choose` undoes in `room`
    bytes, or None when they would save less than WORTHWHILE of its predicted time (not worth
    the memory they hold, nor the planning time of another assembly)."""
    it = _Assembled.iteration_for(graph, batch, opts)
    written_by = {s.node: (s.output, *(b for _, b in s.aux)) for s in it.steps if s.kind == "forward"}
    seconds, stalls = _timing(graph, batch, opts, base.plan)
    decisions = {d.key: d for d in frugal_decisions(base.plan, base.segments, written_by, seconds, stalls)}
    worthwhile = WORTHWHILE * base.plan.predicted_s
    if sum(d.saves_s for d in decisions.values() if d.saves_s > 0) < worthwhile:  # no choice saves more
        return None
    choice = choose(decisions.values(), base.plan.device_bytes, room)
    if not choice or choice.saves_s < worthwhile:
        return None
    kept = tuple(sorted({*base.kept, *(root for kind, root in choice.undone if kind == "segment")}))
    resident = tuple(sorted({*base.resident, *(b for key in choice.undone for b in decisions[key].keeps)}))
    plan, segments = _assemble(graph, batch, base.row, opts, base.hide_copies, base.speed, kept, resident)
    return _Built(plan, base.row, base.hide_copies, segments, base.speed, kept, resident)


def _timing(graph, batch, opts, plan):
    """(predicted seconds of each of `plan`'s steps, {buffer: seconds the compute stream stalls
    waiting for its copies}): kept from its assembly, or simulated again (a plan renamed)."""
    known = _Assembled.timings.get(id(plan))
    if known is not None:
        return known
    seconds, stalls = _seconds_of(graph, batch, opts.cost_model)(plan.steps), {}
    cost_models.simulate(plan.steps, plan.buffers, seconds, opts.cost_model, stalls)
    return seconds, stalls


def _infeasible(graph, batch, budget, policies, opts, candidates=None):
    """The BudgetError for `budget`: the smallest budget that works, the largest batch that fits."""
    candidates = candidates or _candidates(graph, batch, policies, opts)
    options = [(c.plan, c.row, c.hide_copies, None) for c in candidates]
    options += [(_spilled_to(graph, batch, opts, c, SPILL_FLOOR), c.row, c.hide_copies, SPILL_FLOOR)
                for c in _just_in_time(candidates, opts)]
    frugal, row, hide, spill = min(options, key=lambda o: o[0].arena_bytes)
    smallest = frugal.arena_bytes

    def fits(b):
        built = _built(graph, b, row, opts, hide)
        plan = _spilled_to(graph, b, opts, built, spill) if spill else built.plan
        return plan.arena_bytes <= budget

    low, high = 0, batch - 1  # the largest batch in [1, batch) that fits, by bisection
    persistent = sum(b.nbytes for b in frugal.buffers if b.resident)  # the same at every batch
    if high >= 1 and (persistent > budget or not fits(1)):  # often nothing fits: say so without a bisection
        high = 0
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    largest = low
    names = "/".join(p.name for p in policies)
    if largest:
        where = f"the largest batch that fits is {largest} (policy {row.name})"
    elif opts.training and not opts.stream_parameters:
        where = ("no batch size fits: the parameters and optimizer state alone are too large to stay on the device; "
                 "stream them from host memory (--stream-parameters, memory.stream_parameters) or use policy auto")
    else:
        where = "no batch size fits: the largest single step does not fit"
    return BudgetError(
        f"budget {human_bytes(budget)} is too small for batch {batch} under {names}: the smallest "
        f"budget that works is {human_bytes(smallest)} ({smallest} bytes, policy {row.name}); {where}",
        smallest, largest)
