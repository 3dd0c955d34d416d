"""The step vocabulary the passes share: where the backward pass starts, which step kinds
compute, a step's working set, and the versioning of buffers written again (by replays and
prefetches). A pass imports these from here, never from a sibling pass."""

from snrt.scheduler.plan import evolve, remap

COMPUTE_KINDS = ("forward", "recompute", "backward", "update")  # steps that run on the compute stream
NO_COMPUTE = ("offload", "prefetch", "wait", "free")  # step kinds that take no compute-stream time
STREAMED_ROLES = ("parameter", "optimizer_state")  # buffer roles that parameter streaming moves


def backward_start(steps):
    """Index of the first step after the last forward step."""
    return max((i for i, s in enumerate(steps) if s.kind == "forward"), default=-1) + 1


def largest_step_bytes(steps, buffers):
    """The largest working set of one step: non-persistent bytes it reads and writes (with the
    resident bytes, the floor no schedule goes below; see scripts/bench_memory.py)."""
    def own(step):
        ids = set(step.reads()) | set(step.writes())
        return sum(buffers[b].nbytes for b in ids if not buffers[b].resident)

    return max((own(s) for s in steps), default=0)


def version_buffers(steps, table, fed=()):
    """Give every tensor written again by a recompute or prefetch step a new buffer id.

    Later steps read the newest version. `table` (a BufferTable) receives the new buffers,
    named like the original with "@k" (and with its home in the host store, if it has one).
    Workspaces of recompute steps are versioned too. `fed` buffers count as written before
    the first step (the executor writes them).
    """
    written, count = set(fed), {}
    newest, older = {}, {}  # old id -> its newest version; newest version -> the old ids
    untouched = newest.keys().isdisjoint  # whether ids include no versioned one
    mark = written.update
    out = []
    for step in steps:
        if newest and not (untouched(step.reads()) and untouched(step.writes())):
            step = remap(step, newest)
        if step.kind in ("recompute", "prefetch"):
            fresh = {}
            for b in step.writes():
                if b in written:
                    fresh[b] = table.new_version(b, count)
            if fresh:
                step = _rewrite_outputs(step, fresh)
                for b, new in fresh.items():
                    olds = older.pop(b, [])
                    olds.append(b)
                    for old in olds:
                        newest[old] = new
                    older[new] = olds
        mark(step.writes())
        out.append(step)
    return out


def _rewrite_outputs(step, fresh):
    """The recompute/prefetch `step` writing the `fresh` ids instead (its reads stay)."""
    if step.kind == "prefetch":
        return evolve(step, buffer=fresh.get(step.buffer, step.buffer))
    aux = tuple((name, fresh.get(b, b)) for name, b in step.aux)
    return evolve(step, output=fresh.get(step.output, step.output), aux=aux,
                   workspace=fresh.get(step.workspace, step.workspace))
