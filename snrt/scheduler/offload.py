"""Offload and prefetch (vDNN, and SuperNeurons' unified tensor pool).

A tensor written in the forward pass and read again in the backward pass is copied to host
memory on the device-to-host stream after its last forward use; the compute stream waits for
that copy only when enough compute has run to hide it, and the device copy is freed after
the wait. Before its first backward use it is prefetched on the host-to-device stream, early
enough that the copy hides behind the compute before it (the distance comes from the cost
model, not a constant), and the compute stream waits for it right before the use.

The pass inserts steps naming the original buffer; `version_buffers` then gives the
prefetched tensor a buffer id of its own. Host slots are assigned here.
"""

from snrt.scheduler.copies import hide_backward, hide_forward, with_inserted
from snrt.scheduler.offsets import aligned
from snrt.scheduler.plan import Offload, Prefetch, Wait, evolve
from snrt.scheduler.steps import backward_start


def offload_candidates(steps, buffers, start, keep=()):
    """Activation buffers used before `start` and read at or after it, except `keep`."""
    first_read_after, last_before = {}, {}
    for i, step in enumerate(steps):
        for b in (*step.reads(), *step.writes()):
            if i < start:
                last_before[b] = i
            elif b in last_before and b in step.reads() and b not in first_read_after:
                first_read_after[b] = i
    chosen = [b for b in first_read_after if buffers[b].role == "activation" and b not in keep]
    return sorted(chosen, key=lambda b: last_before[b]), last_before, first_read_after


def plan_offload(steps, buffers, seconds, model, keep=(), hide_copies=True, just_in_time=()):
    """`steps` with offload/wait after forward uses and prefetch/wait before backward uses.

    `seconds[i]` is the predicted compute time of step i; `keep` are never offloaded. After
    recomputation only checkpoints are still read by the backward pass, so under the
    superneurons policy exactly the checkpoints are offloaded. Returns
    (steps, {buffer id: host slot offset}, host bytes). With `hide_copies` False every copy
    is waited for at once and prefetched just before its use: slower, but no tensor is on
    the device longer than it must be (what a tight budget needs); `just_in_time` are the
    buffers copied so while the others' copies hide.
    """
    start = backward_start(steps)
    chosen, last_before, first_after = offload_candidates(steps, buffers, start, keep)
    before, after = {}, {}  # step index -> steps to insert before / after it
    slots, host_bytes = {}, 0
    for b in chosen:
        slots[b] = host_bytes
        host_bytes += aligned(buffers[b].nbytes)
        copy_s = model.copy_s(buffers[b].nbytes) if hide_copies and b not in just_in_time else 0.0
        last, use = last_before[b], first_after[b]
        after.setdefault(last, []).append(Offload(b))
        wait_at = hide_forward(seconds, last + 1, start, copy_s)
        before.setdefault(wait_at, []).append(Wait(b))
        fetch_at = hide_backward(seconds, use, max(wait_at, start), copy_s)
        before.setdefault(fetch_at, []).append(Prefetch(b, b))
        before.setdefault(use, []).append(Wait(b))
    return with_inserted(steps, before, after), slots, host_bytes


def with_host_slots(buffers, slots):
    """Buffers with their host slot offsets filled in."""
    return [evolve(b, host_slot=slots[b.id]) if b.id in slots else b for b in buffers]
