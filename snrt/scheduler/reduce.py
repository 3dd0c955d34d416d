"""Data parallel: the gradient reduction across ranks as plan steps.

With several ranks every process runs the same plan on its own slice of the global batch, and
each parameter gradient must be summed over the ranks before its update. Gradients are grouped
into buckets in the order the backward pass completes them (about BUCKET_BYTES each, as
PyTorch DDP does); as soon as a bucket's last gradient is written, an AllReduce step packs it
into this rank's slot of a `ranks`-slot buffer and starts exchanging the slots, overlapped
with the rest of the backward pass. After the last backward step, one AllReduceWait per bucket
waits for its exchange and adds the slots in rank order into fresh gradient buffers, which the
updates (all deferred to this point) then consume.

So a gradient lives from its backward step until its bucket is packed, the bucket's slots
until its wait, and the summed gradient until its update: all of it planned, so the memory
each rank uses stays exact.
"""

from snrt.layers.base import numel
from snrt.scheduler.plan import AllReduce, AllReduceWait, evolve

BUCKET_BYTES = 25 * 2**20


def plan_reduction(steps, table, ranks, bucket_bytes=BUCKET_BYTES):
    """`steps` (an iteration whose updates all follow the last backward step) with the buckets'
    AllReduce steps after the backward steps that complete them, their AllReduceWait steps
    after the last backward step, and the updates reading the summed gradients. `table` (a
    BufferTable) receives the slot buffers ("bucket<k>:gathered", role "collective") and the
    summed gradients ("<gradient>@sum"). Unchanged for one rank.
    """
    if ranks <= 1:
        return steps
    last_backward = max((i for i, s in enumerate(steps) if s.kind == "backward"), default=-1)
    out, waits, summed, bucket = [], [], {}, []
    filled = 0  # bytes in `bucket`

    def close_bucket():
        first = table.buffers[bucket[0]]
        count = sum(numel(table.buffers[g].shape) for g in bucket)
        gathered = table.add(f"bucket{len(waits)}:gathered", (ranks, count), first.dtype, "collective")
        sums = tuple(_summed(table, g) for g in bucket)
        summed.update(zip(bucket, sums))
        out.append(AllReduce(tuple(bucket), gathered, filled, ranks))
        waits.append(AllReduceWait(gathered, sums, filled, ranks))
        bucket.clear()

    for i, step in enumerate(steps):
        if step.kind == "update":
            slots = tuple((p, summed.get(g, g), states, decay) for p, g, states, decay in step.slots)
            step = evolve(step, slots=slots)
        out.append(step)
        if step.kind == "backward":
            for _, g in step.grad_params:
                bucket.append(g)
                filled += table.buffers[g].nbytes
            if bucket and (i == last_backward or filled >= bucket_bytes):
                close_bucket()
                filled = 0
        if i == last_backward:
            out.extend(waits)
    return out


def _summed(table, grad):
    """A new buffer like gradient `grad`, for its sum over the ranks."""
    b = table.buffers[grad]
    return table.add(f"{b.name}@sum", b.shape, b.dtype, b.role)
