"""Lowering: one Recipe turns the iteration into one Plan, pass by pass.

A Recipe says which plan to make: the policy row whose passes run, whether copies are hidden
behind compute, which replayed segments go speed-centric and which are kept, which buffers stay
resident and how far idle tensors are spilled. `lower` runs the passes of PASSES that the recipe
asks for, in that order, on a copy of the iteration's steps, then places the buffers and times
the plan:

    iteration ─> recompute ─> offload ─> stream ─> spill ─> free ─> offsets, timing ─> Assembly

Adding a pass is one row of PASSES (and a function taking the Lowering and the Recipe).
"""

from collections import Counter
from dataclasses import dataclass, field, replace

from snrt.scheduler import cost as cost_models
from snrt.scheduler.liveness import insert_frees, trace_allocations
from snrt.scheduler.offload import plan_offload, with_host_slots
from snrt.scheduler.offsets import assign_offsets
from snrt.scheduler.order import BufferTable
from snrt.scheduler.plan import Plan
from snrt.scheduler.recompute import plan_recomputation
from snrt.scheduler.spill import plan_spills
from snrt.scheduler.steps import largest_step_bytes, version_buffers
from snrt.scheduler.stream import plan_streaming

SPILL_FLOOR = "floor"  # a spill limit: the largest step's working set (the smallest arena spilling gives)


@dataclass(frozen=True)
class Does:
    """What a policy row does to the tensors of one iteration under the planning options,
    derived once (capabilities(row, options)): the passes a recipe of it runs, and the plans
    the search builds from it."""

    frees: bool  # frees tensors after their last use
    recomputes: bool  # drops cheap layers' outputs and replays them (training)
    offloads: bool  # offloads what the backward pass reads (training)
    streams: bool  # streams parameters and optimizer state (training, a freeing row, stream_parameters)
    spills: bool  # may spill idle tensors under a budget (training, a freeing row)
    copies: bool  # copies tensors between host and device: has a just-in-time variant
    grows: bool  # grows into the room a budget leaves (training)
    undoable: bool  # replays, offloads or streams: auto grows a budget-optimal plan from it


def capabilities(row, options):
    """The Does of Policy `row` under PlanOptions `options`."""
    training = options.training
    streams = options.stream_parameters and training and row.frees
    copies = row.offloads or streams
    return Does(frees=row.frees, recomputes=row.recomputes and training, offloads=row.offloads and training,
                streams=streams, spills=row.frees and training, copies=copies, grows=row.grows and training,
                undoable=row.recomputes or copies)


@dataclass(frozen=True)
class Recipe:
    """How one plan is lowered: Policy `row`'s passes (`does`, its capabilities), copies hidden
    behind compute (`hide_copies`) or just in time, the replayed segments (roots) that go
    speed-centric (`speed`) or are kept on the device and offloaded (`kept`), the buffer ids
    never offloaded or streamed (`resident`), and with `spill` (bytes, or SPILL_FLOOR) the idle
    tensors spilled at steps over that many non-resident bytes (snrt/scheduler/spill.py).
    `just_in_time` are the buffer ids (of the iteration) whose copies go just in time even
    where the others' hide (candidates.within_peak)."""

    row: object
    does: Does
    hide_copies: bool = True
    speed: tuple = ()
    kept: tuple = ()
    resident: tuple = ()
    spill: object = None
    just_in_time: tuple = ()


@dataclass(frozen=True)
class Assembly:
    """A Plan and how it was made: its Recipe, what the passes decided (`segments`: {root:
    [nodes]} the recompute pass replays), each step's predicted compute `seconds` and the
    seconds the compute stream `stalls` waiting for each buffer's copies (cost.simulate)."""

    plan: Plan
    recipe: Recipe
    segments: dict = field(default_factory=dict)
    seconds: list = field(default_factory=list)
    stalls: dict = field(default_factory=dict)

    def named(self, policy):
        """This assembly with its plan called `policy`."""
        return replace(self, plan=replace(self.plan, policy=policy))


class Lowering:
    """The work of one `lower`: the steps and buffers (with the host store's size) the passes
    rewrite in turn, the host slots offloading assigns, and the segments the recompute pass
    decided."""

    def __init__(self, session):
        it = session.iteration
        self.session, self.steps, self.table = session, list(it.steps), BufferTable()
        self.table.buffers = list(it.buffers)
        self.keep = {b for out, _, probs, labels, _ in it.losses for b in (out, probs, labels)}
        self.fed = tuple(b for _, b in it.inputs) + tuple(loss[1] for loss in it.losses if loss[1] >= 0)
        self.slots, self.segments = {}, {}


def _recompute(work, recipe):
    work.steps, work.segments = plan_recomputation(work.session.graph, work.steps, work.table, recipe.speed,
                                                   recipe.kept)


def _offload(work, recipe):
    model = work.session.options.cost_model
    work.steps, work.slots, work.table.host_bytes = plan_offload(
        work.steps, work.table.buffers, work.session.seconds(work.steps), model, work.keep | set(recipe.resident),
        recipe.hide_copies, frozenset(recipe.just_in_time))
    if not recipe.does.streams:  # else versioned with the streamed copies (streaming reads no activation's version)
        work.steps = version_buffers(work.steps, work.table)


def _stream(work, recipe):
    model = work.session.options.cost_model
    work.steps = plan_streaming(work.steps, work.table, work.session.seconds(work.steps), model, recipe.hide_copies,
                                recipe.resident, frozenset(recipe.just_in_time))
    work.steps = version_buffers(work.steps, work.table)


def _spill(work, recipe):
    limit = largest_step_bytes(work.steps, work.table.buffers) if recipe.spill == SPILL_FLOOR else recipe.spill
    work.steps = plan_spills(work.steps, work.table, work.slots, limit, work.keep, work.fed)
    work.steps = version_buffers(work.steps, work.table, work.fed)


def _free(work, recipe):
    work.steps = insert_frees(work.steps, work.table.buffers, work.keep)


@dataclass(frozen=True)
class Pass:
    """One row of the pass table: `name`, whether a Recipe asks for it (`runs`), and `apply`
    (Lowering, Recipe), which rewrites the Lowering's steps and buffers."""

    name: str
    runs: object
    apply: object


PASSES = (  # in lowering order
    Pass("recompute", lambda r: r.does.recomputes, _recompute),
    Pass("offload", lambda r: r.does.offloads, _offload),
    Pass("stream", lambda r: r.does.streams, _stream),
    Pass("spill", lambda r: r.spill is not None and r.does.spills, _spill),
    Pass("free", lambda r: r.does.frees, _free),
)


def lower(session, recipe):
    """The Assembly of `recipe` for the iteration of Session `session`: the passes it asks for,
    then offsets in the arena and the predicted time."""
    work = Lowering(session)
    for step in PASSES:
        if step.runs(recipe):
            step.apply(work, recipe)
    return _placed(work, recipe)


def _placed(work, recipe):
    """The Assembly of the Lowering `work` once its passes have run: buffers placed, steps timed."""
    session, steps = work.session, work.steps
    graph, batch, model = session.graph, session.batch, session.options.cost_model
    buffers = with_host_slots(work.table.buffers, work.slots)
    allocations, frees, device_bytes = trace_allocations(buffers, steps, work.fed)
    buffers, arena_bytes = assign_offsets(buffers, allocations, frees)
    seconds, stalls = session.seconds(steps), {}
    predicted_s, stall_s = cost_models.simulate(steps, buffers, seconds, model, stalls)
    replays = Counter(s.node for s in steps if s.kind == "recompute")
    recompute_flops = sum(count * graph[node].layer.cost(graph.in_shapes(node, batch), "forward").flops
                          for node, count in replays.items())
    it = session.iteration
    plan = Plan(batch, recipe.row.name, session.options.training, tuple(buffers), tuple(steps), tuple(device_bytes),
                arena_bytes, work.table.host_bytes, tuple(allocations), tuple(it.inputs), it.losses,
                predicted_s=predicted_s, stall_s=stall_s, recompute_flops=recompute_flops,
                ranks=session.options.ranks, fused=session.options.fuse)
    return Assembly(plan, recipe, work.segments, seconds, stalls)
