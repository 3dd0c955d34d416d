"""Copy windows the copying passes (offload, stream, spill) share: where to wait for a copy to
the host and where to issue one back so that compute hides them, and inserting the copy steps."""


def with_inserted(steps, before, after):
    """`steps` with before[i] inserted before step i (before[len(steps)]: at the end) and
    after[i] after it."""
    out = []
    for i, step in enumerate(steps):
        out.extend(before.get(i, ()))
        out.append(step)
        out.extend(after.get(i, ()))
    out.extend(before.get(len(steps), ()))
    return out


def hide_forward(seconds, first, limit, copy_s):
    """The step index before which to wait for an offload issued before step `first`:
    after enough compute to hide `copy_s`, and no later than `limit`."""
    elapsed, i = 0.0, first
    while i < limit and elapsed < copy_s:
        elapsed += seconds[i]
        i += 1
    return i


def hide_backward(seconds, use, earliest, copy_s):
    """The step index at which to issue a prefetch needed at `use`: far enough back that
    the compute between hides `copy_s`, never before `earliest`."""
    elapsed, i = 0.0, use
    while i > earliest and elapsed < copy_s:
        i -= 1
        elapsed += seconds[i]
    return i
