"""Parameter and optimizer-state streaming: deeper than the device holds.

Without it, every parameter and its optimizer state (SGD's momentum, Adam's moments) sit on the
device for the whole run. Streamed, each has a home in the host store and comes to the device
only while steps use it: prefetched before its layer's forward step and again before the
backward step (recompute steps of its layer in between fetch it too), the momentum before the
update; the updated weight and momentum are copied back home and freed. A tensor stays on the
device between two uses when no other layer's compute runs between them (a layer's backward
and its fused update, say). Its gradient is consumed at once by the fused update, as before.

The pass inserts steps that name the tensor's own buffer; `version_buffers` then gives every
later device copy a buffer id of its own, with the same home. Homes are assigned here.
"""

from snrt.scheduler.copies import hide_backward, hide_forward, with_inserted
from snrt.scheduler.plan import Offload, Prefetch, Wait
from snrt.scheduler.steps import COMPUTE_KINDS, STREAMED_ROLES


def plan_streaming(steps, table, seconds, model, hide_copies=True, resident=(), just_in_time=()):
    """`steps` with the copies of every parameter and optimizer-state tensor but those in
    `resident` (they stay on the device). `table` (a BufferTable) gives those buffers homes
    at the end of its host store; `seconds[i]` is step i's
    predicted compute time, used to issue a prefetch early enough to hide it behind the
    compute before (and to wait for a copy home late enough), or, with `hide_copies` False
    (for the buffers of `just_in_time` alone otherwise), just in time.
    """
    resident = set(resident)
    streamed = [b.id for b in table.buffers if b.role in STREAMED_ROLES and b.id not in resident]
    for b in streamed:
        table.home(b)
    before, after = {}, {}  # step index -> steps to insert before / after it
    for b, stays in _stays(steps, set(streamed)).items():
        copy_s = model.copy_s(table.buffers[b].nbytes) if hide_copies and b not in just_in_time else 0.0
        earliest = 0
        for first, last, written in stays:
            fetch_at = hide_backward(seconds, first, earliest, copy_s)
            before.setdefault(fetch_at, []).append(Prefetch(b, b))
            before.setdefault(first, []).append(Wait(b))
            earliest = last + 1
            if written:  # the new value goes home before this copy is freed
                after.setdefault(last, []).append(Offload(b))
                home_at = hide_forward(seconds, last + 1, len(steps), copy_s)
                before.setdefault(home_at, []).append(Wait(b))
                earliest = home_at
    return with_inserted(steps, before, after)


def _stays(steps, streamed):
    """{buffer: [(first step, last step, written), ...]}: the runs of steps using each streamed
    buffer with no other compute step between two uses, and whether the run writes it."""
    stays, previous = {}, {}
    last_compute = -1
    for i, step in enumerate(steps):
        if step.kind not in COMPUTE_KINDS:
            continue
        writes = set(step.writes())
        for b in dict.fromkeys((*step.reads(), *step.writes())):
            if b not in streamed:
                continue
            runs = stays.setdefault(b, [])
            if runs and previous[b] == last_compute:  # nothing else ran since its last use: stay
                first, _, written = runs[-1]
                runs[-1] = (first, i, written or b in writes)
            else:
                runs.append((i, i, b in writes))
            previous[b] = i
        last_compute = i
    return stays
