"""Liveness: when every buffer comes alive and when it can be freed, in linear passes.

Every buffer id has one live interval: from the first step that uses it (or the start of the
iteration for fed inputs) to its last use. Recomputed and prefetched tensors are new buffer
ids (versions), so a tensor that is dropped and brought back is two intervals, two ids.
Resident buffers (parameters, optimizer and BatchNorm state, unless streamed) are alive throughout.
"""

from snrt.scheduler.plan import Free


def insert_frees(steps, buffers, keep=()):
    """`steps` with a Free after each step for the buffers whose last use it is.

    Resident buffers and those in `keep` (read by the executor after the iteration:
    the loss, its probabilities, the labels) are never freed. One pass from the end: the
    step where a buffer is first met is its last use.
    """
    seen = set(keep) | {b.id for b in buffers if b.resident}
    out = []
    for step in reversed(steps):
        reads, writes = step.reads(), step.writes()
        if not (seen.issuperset(reads) and seen.issuperset(writes)):
            dying = {b for b in (*reads, *writes) if b not in seen}
            seen.update(dying)
            out.append(Free(tuple(sorted(dying))))
        out.append(step)
    out.reverse()
    return out


def trace_allocations(buffers, steps, fed):
    """(allocations, frees, device bytes): per step, the buffers that come alive just before it
    (those it uses first), those its Free lets go (() for other steps), and the bytes on the
    device while it runs (resident + allocated, not yet freed).

    Resident buffers are alive from the start; `fed` (inputs, the loss seed) are written
    by the executor before the first step, so they come alive with it.
    """
    resident = [b for b in buffers if b.resident]
    seen = {b.id for b in resident}
    size = [b.nbytes for b in buffers].__getitem__
    live = sum(b.nbytes for b in resident)
    points, frees, device_bytes = [], [], []
    add_point, add_free, add_bytes = points.append, frees.append, device_bytes.append
    known = seen.issuperset
    first = fed  # comes alive with the first step; None once it has
    for step in steps:
        if step.kind == "free":
            add_point(())
            add_bytes(live)
            add_free(step.buffers)
            live -= sum(map(size, step.buffers))
            continue
        writes, reads = step.writes(), step.reads()
        if first is None and known(writes) and known(reads):  # most steps: nothing new
            add_point(())
        else:
            fresh = tuple([b for b in dict.fromkeys((*(first or ()), *writes, *reads)) if b not in seen])
            first = None
            seen.update(fresh)
            add_point(fresh)
            live += sum(map(size, fresh))
        add_bytes(live)
        add_free(())
    return points, frees, device_bytes
