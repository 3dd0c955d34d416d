"""Spilling: tensors idle where the device is fullest go to the host and come back.

Offloading (offload.py) moves the tensors the forward pass leaves for the backward pass, and
replays drop the cheap ones; other tensors still sit idle on the device between two uses: a
fork's output between the branches that read it, the gradient of a skip connection while the
block's body runs its backward, the input images from the first layer's forward to its
backward, pooling's and normalization's saved indices and statistics. Under a budget tighter
than those plans, such a tensor is spilled over a gap between two of its uses that holds a
step whose device bytes exceed the limit: copied to the host store after the first use (waited
for at once), freed, and copied back just before the second (just in time). A tensor the
device got by a prefetch and has not changed since is not copied out again: it comes back
from the host copy it came from.

The largest tensors go first, each only while a step of its gap is still over the limit, so
spills are few and the peak comes down to the limit or to what cannot be spilled: the working
set of a step, tensors in flight, tensors used by consecutive compute steps.

The pass inserts steps naming the tensor's own buffer; `version_buffers` then gives each copy
brought back a buffer id of its own, with the same home in the host store.
"""

from snrt.scheduler.copies import with_inserted
from snrt.scheduler.plan import Offload, Prefetch, Wait, evolve
from snrt.scheduler.steps import COMPUTE_KINDS

SPILLED_ROLES = ("activation", "gradient", "aux", "parameter_gradient")


def plan_spills(steps, table, homes, limit, keep=(), fed=()):
    """`steps` with spills.

    `table` (a BufferTable) gets the homes (`host_slot`, at the end of its host store) of the
    tensors spilled after a compute step wrote them; `homes` ({buffer id: host slot}) are the slots offloading already gave;
    `limit` is the non-resident device bytes a step may hold; `keep` are never spilled, `fed`
    (written by the executor before the first step) are alive from step 0.
    """
    buffers = table.buffers
    uses = _uses(steps, fed)
    peaks = _Peaks(_live_bytes(uses, buffers, len(steps), keep))
    computes = _running_count(steps)
    written = {b for s in steps if s.kind in COMPUTE_KINDS for b in s.writes()}
    gaps = [(buffers[b].nbytes, b, u, v) for b, at in uses.items()
            if buffers[b].role in SPILLED_ROLES and not buffers[b].resident and b not in keep
            for u, v in zip(at, at[1:])
            if computes[v] - computes[u + 1] > 0 and not _opens(steps[u], b) and not _closes(steps[v], b)]
    gaps.sort(key=lambda g: (-g[0], g[2], g[1]))
    before, after = {}, {}
    for nbytes, b, u, v in gaps:
        if nbytes == 0 or peaks.max(u + 1, v) <= limit:
            continue
        peaks.add(u + 1, v, -nbytes)
        source = _host_copy(steps, uses[b][0], b, written)
        if source is None:  # a value computed on the device: it goes home first
            home = homes.get(b, buffers[b].host_slot)  # an offloaded activation keeps its slot
            if home < 0:
                table.home(b)  # its copies share it
            else:
                table.buffers[b] = evolve(buffers[b], host_slot=home)
            after.setdefault(u, []).extend((Offload(b), Wait(b)))
            source = b
        before.setdefault(v, []).extend((Prefetch(b, source), Wait(b)))
    return with_inserted(steps, before, after)


def _uses(steps, fed):
    """{buffer id: [indices of the steps that read or write it]}, fed buffers used at step 0 too."""
    uses = {b: [0] for b in fed}
    for i, step in enumerate(steps):
        for b in dict.fromkeys((*step.reads(), *step.writes())):
            at = uses.setdefault(b, [])
            if not at or at[-1] != i:
                at.append(i)
    return uses


def _live_bytes(uses, buffers, n, keep):
    """Non-resident bytes alive at each of `n` steps (from a buffer's first use to its last, or
    to the end for those in `keep`, which are never freed)."""
    delta = [0] * (n + 1)
    for b, at in uses.items():
        if not buffers[b].resident:
            delta[at[0]] += buffers[b].nbytes
            delta[n if b in keep else at[-1] + 1] -= buffers[b].nbytes
    live, total = [], 0
    for d in delta[:n]:
        total += d
        live.append(total)
    return live


def _running_count(steps):
    """counts[i]: compute steps before step i (counts has len(steps) + 1 entries)."""
    counts = [0]
    for step in steps:
        counts.append(counts[-1] + (step.kind in COMPUTE_KINDS))
    return counts


def _opens(step, b):
    """Whether `step` leaves a copy or an exchange of `b` in flight."""
    return (step.kind in ("offload", "prefetch") and step.buffer == b) or \
        (step.kind == "allreduce" and step.gathered == b)


def _closes(step, b):
    """Whether `step` waits for a copy or an exchange of `b`."""
    return (step.kind == "wait" and step.buffer == b) or (step.kind == "allreduce_wait" and step.gathered == b)


def _host_copy(steps, first, b, written):
    """The buffer whose host slot holds `b`'s value, when `b` came to the device by a prefetch
    (its first use, step `first`) and no compute step writes it; else None."""
    step = steps[first]
    if step.kind == "prefetch" and step.buffer == b and b not in written:
        return step.source
    return None


class _Peaks:
    """Values over steps with range add and range max, each in O(log n) (a segment tree whose
    inner nodes hold their subtree's max plus the adds pending for all of it)."""

    def __init__(self, values):
        size = 1
        while size < max(len(values), 1):
            size *= 2
        self.size, self.height = size, size.bit_length() - 1
        self.top = [float("-inf")] * size + list(values) + [float("-inf")] * (size - len(values))
        self.pending = [0] * size
        for i in range(size - 1, 0, -1):
            self.top[i] = max(self.top[2 * i], self.top[2 * i + 1])

    def add(self, lo, hi, value):
        """Add `value` to positions lo..hi-1."""
        left, right = lo + self.size, hi + self.size
        first, last = left, right - 1
        while left < right:
            if left & 1:
                self._apply(left, value)
                left += 1
            if right & 1:
                right -= 1
                self._apply(right, value)
            left, right = left // 2, right // 2
        self._rebuild(first)
        self._rebuild(last)

    def max(self, lo, hi):
        """The largest value at positions lo..hi-1 (-inf when empty)."""
        if lo >= hi:
            return float("-inf")
        left, right = lo + self.size, hi + self.size
        self._push(left)
        self._push(right - 1)
        best = float("-inf")
        while left < right:
            if left & 1:
                best = max(best, self.top[left])
                left += 1
            if right & 1:
                right -= 1
                best = max(best, self.top[right])
            left, right = left // 2, right // 2
        return best

    def _apply(self, node, value):
        self.top[node] += value
        if node < self.size:
            self.pending[node] += value

    def _rebuild(self, node):
        while node > 1:
            node //= 2
            self.top[node] = max(self.top[2 * node], self.top[2 * node + 1]) + self.pending[node]

    def _push(self, node):
        for shift in range(self.height, 0, -1):
            parent = node >> shift
            if self.pending[parent]:
                self._apply(2 * parent, self.pending[parent])
                self._apply(2 * parent + 1, self.pending[parent])
                self.pending[parent] = 0
