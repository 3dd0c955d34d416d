"""Liveness: when every buffer comes alive and when it can be freed, in one linear pass.

Every buffer id has one live interval: from the first step that uses it (or the start of the
iteration for fed inputs) to its last use. Recomputed and prefetched tensors are new buffer
ids (versions), so a tensor that is dropped and brought back is two intervals, two ids.
Resident buffers (parameters, optimizer and BatchNorm state, unless streamed) are alive throughout.
"""

from snrt.scheduler.plan import Free


def last_uses(steps):
    """{buffer id: index of the last step that reads or writes it}."""
    last = {}
    for i, step in enumerate(steps):
        for b in (*step.reads(), *step.writes()):
            last[b] = i
    return last


def insert_frees(steps, buffers, keep=()):
    """`steps` with a Free after each step for the buffers whose last use it is.

    Resident buffers and those in `keep` (read by the executor after the iteration:
    the loss, its probabilities, the labels) are never freed.
    """
    never = set(keep) | {b.id for b in buffers if b.resident}
    dying = {}
    for b, i in last_uses(steps).items():
        if b not in never:
            dying.setdefault(i, []).append(b)
    out = []
    for i, step in enumerate(steps):
        out.append(step)
        if i in dying:
            out.append(Free(tuple(sorted(dying[i]))))
    return out


def allocation_points(buffers, steps, fed):
    """Per step, the buffers that come alive just before it: those it uses first.

    Resident buffers are alive from the start; `fed` (inputs, the loss seed) are written
    by the executor before the first step, so they come alive with it.
    """
    seen = {b.id for b in buffers if b.resident}
    points = []
    for i, step in enumerate(steps):
        writes, reads = step.writes(), step.reads()
        if i and seen.issuperset(writes) and seen.issuperset(reads):  # most steps: nothing new
            points.append(())
            continue
        first = fed if i == 0 else ()
        fresh = tuple(b for b in dict.fromkeys((*first, *writes, *reads)) if b not in seen)
        seen.update(fresh)
        points.append(fresh)
    return points


def predict_device_bytes(buffers, steps, allocations):
    """Bytes on the device while each step runs: resident + alive (allocated, not yet freed)."""
    live = sum(b.nbytes for b in buffers if b.resident)
    size = [b.nbytes for b in buffers].__getitem__
    out = []
    for step, fresh in zip(steps, allocations):
        if fresh:
            live += sum(map(size, fresh))
        out.append(live)
        if step.kind == "free":
            live -= sum(map(size, step.buffers))
    return out
