"""A static check of a Plan against its own rules, independent of the passes that made it.

`verify_plan` walks the steps once and raises PlanError when a step reads a buffer that is
not alive or holds nothing yet, when a buffer is freed twice or never allocated, when a wait
has no copy (or gradient exchange) to wait for, when an update reads a gradient that was
not summed across the ranks of a data-parallel plan, when two buffers alive at the same time overlap in the arena, when
the predicted bytes disagree with the walk, or when the arena exceeds a budget.
"""


class PlanError(AssertionError):
    """The plan breaks one of its own rules (a planner bug)."""


def verify_plan(plan, budget=None):
    """Raise PlanError if `plan` is inconsistent (see the module doc); return None if it holds."""
    buffers = plan.buffers
    persistent = {b.id for b in buffers if b.resident}
    fed = set(plan.allocations[0]) & ({b for _, b in plan.inputs} | {loss[1] for loss in plan.losses})
    alive = set(persistent)
    holding = set(persistent) | fed  # alive and written (or being copied in)
    in_flight = set()
    summed = set()  # gradients summed across the ranks
    live_bytes = sum(buffers[b].nbytes for b in persistent)
    _check_offsets(buffers, persistent, "persistent buffers")
    for i, step in enumerate(plan.steps):
        where = f"step {i} ({step.kind} {getattr(step, 'node', '')})"
        for b in plan.allocations[i]:
            if b in alive:
                raise PlanError(f"{where}: {buffers[b].name} allocated while alive")
            _check_against_live(buffers, b, alive, where)
            alive.add(b)
            live_bytes += buffers[b].nbytes
        if live_bytes != plan.device_bytes[i]:
            raise PlanError(f"{where}: {live_bytes} bytes alive, the plan says {plan.device_bytes[i]}")
        for b in step.reads():
            if b not in alive:
                raise PlanError(f"{where}: reads {buffers[b].name}, which is not alive")
            if b not in holding:
                raise PlanError(f"{where}: reads {buffers[b].name} before anything wrote it")
        for b in step.writes():
            if b not in alive:
                raise PlanError(f"{where}: writes {buffers[b].name}, which is not alive")
            holding.add(b)
        if step.kind in ("offload", "prefetch"):
            in_flight.add(step.buffer)
            if step.kind == "prefetch" and buffers[step.source].host_slot < 0:
                raise PlanError(f"{where}: prefetches from {buffers[step.source].name}, which has no host slot")
            if step.kind == "prefetch" and step.source in summed:
                summed.add(step.buffer)  # a summed gradient brought back
        elif step.kind == "allreduce":
            in_flight.add(step.gathered)
        elif step.kind in ("wait", "allreduce_wait"):
            b = step.buffer if step.kind == "wait" else step.gathered
            if b not in in_flight:
                raise PlanError(f"{where}: waits for {buffers[b].name}, which has no copy in flight")
            in_flight.discard(b)
            summed.update(step.writes())
        elif step.kind == "update" and plan.ranks > 1:
            for _, g, _, _ in step.slots:
                if g not in summed:
                    raise PlanError(f"{where}: updates with {buffers[g].name}, which was not summed across ranks")
        elif step.kind == "free":
            for b in step.buffers:
                if b not in alive or b in persistent:
                    raise PlanError(f"{where}: frees {buffers[b].name}, which is not a live temporary")
                if b in in_flight:
                    raise PlanError(f"{where}: frees {buffers[b].name} while its copy is in flight")
                alive.discard(b)
                holding.discard(b)
                live_bytes -= buffers[b].nbytes
    if in_flight:
        raise PlanError(f"copies never waited for: {sorted(buffers[b].name for b in in_flight)[:3]}")
    if plan.peak_bytes > plan.arena_bytes:
        raise PlanError(f"peak {plan.peak_bytes} bytes does not fit the {plan.arena_bytes}-byte arena")
    if budget is not None and plan.arena_bytes > budget:
        raise PlanError(f"arena {plan.arena_bytes} bytes exceeds the budget of {budget}")


def _check_against_live(buffers, b, alive, where):
    """No alive buffer may share bytes with `b`."""
    start, end = buffers[b].offset, buffers[b].offset + buffers[b].nbytes
    if start < 0:
        raise PlanError(f"{where}: {buffers[b].name} has no offset")
    for other in alive:
        o = buffers[other]
        if o.offset < end and start < o.offset + o.nbytes and o.nbytes and buffers[b].nbytes:
            raise PlanError(f"{where}: {buffers[b].name} overlaps live {o.name} in the arena")


def _check_offsets(buffers, ids, what):
    spans = sorted((buffers[b].offset, buffers[b].offset + buffers[b].nbytes, buffers[b].name) for b in ids)
    for (s1, e1, n1), (s2, _, n2) in zip(spans, spans[1:]):
        if s2 < e1:
            raise PlanError(f"{what}: {n1} and {n2} overlap in the arena")
