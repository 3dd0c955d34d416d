"""Offset assignment: every buffer gets a fixed place in one device arena.

Two buffers may share bytes only when their live intervals do not overlap. Two packings are
tried and the smaller arena kept: the intervals replayed in step order against a best-fit
allocator (holes coalesced on free; linear in the number of buffers), and, for plans of up to
GREEDY_MAX_BUFFERS buffers, the offline greedy that places the largest buffers first, each at
the lowest offset free over its whole interval (usually tighter; each buffer checked against
those placed that are alive during its steps, found through an index by step), in two orders of
buffers of one size (`GREEDY_TIES`: the earliest first, the longest-lived first; across the zoo's
plans each is the tighter one for some). Persistent
buffers sit at the bottom. The arena is the highest address used; the sum of live bytes at
the peak step is the lower bound any assignment must reach.
"""

import bisect

from snrt.scheduler.plan import evolve

ALIGN_BYTES = 256
GREEDY_MAX_BUFFERS = 8000
BUCKET_STEPS = 16  # the greedy's index of placed buffers: one list per this many steps
GREEDY_TIES = (  # orders of the greedy's buffers of one size, by their (first, last) steps alive
    lambda first, last: (first,),
    lambda first, last: (first - last, first),
)


def aligned(nbytes):
    """`nbytes` rounded up to the arena alignment."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class _Holes:
    """Free address ranges below `top`, sorted by start, coalesced."""

    def __init__(self):
        self.starts, self.ends = [], []
        self.top = 0

    def take(self, size):
        best, best_size = None, None
        for k, (start, end) in enumerate(zip(self.starts, self.ends)):
            if end - start >= size and (best is None or end - start < best_size):
                best, best_size = k, end - start
                if best_size == size:
                    break
        if best is None:
            if self.ends and self.ends[-1] == self.top:  # grow the last hole into new space
                start = self.starts.pop()
                self.ends.pop()
            else:
                start = self.top
            self.top = start + size
            return start
        start = self.starts[best]
        if self.ends[best] - start == size:
            del self.starts[best], self.ends[best]
        else:
            self.starts[best] = start + size
        return start

    def give(self, start, size):
        end = start + size
        k = bisect.bisect_left(self.starts, start)
        if k > 0 and self.ends[k - 1] == start:  # merge with the hole before
            k -= 1
            start = self.starts[k]
            del self.starts[k], self.ends[k]
        if k < len(self.starts) and self.starts[k] == end:  # and with the hole after
            end = self.ends[k]
            del self.starts[k], self.ends[k]
        self.starts.insert(k, start)
        self.ends.insert(k, end)


def assign_offsets(buffers, allocations, frees):
    """(buffers with offsets, arena bytes) for buffers alive from `allocations[i]` (the ids
    that come alive just before step i) to `frees[j]` (the ids step j frees)."""
    resident = [b.id for b in buffers if b.resident]
    offsets, bottom = {}, 0
    for b in resident:
        offsets[b] = bottom
        bottom += aligned(buffers[b].nbytes)
    best, top = _best_fit(buffers, allocations, frees)
    if sum(map(len, allocations)) <= GREEDY_MAX_BUFFERS:
        intervals = _intervals(allocations, frees)
        for ties in GREEDY_TIES:
            greedy, greedy_top = _largest_first(buffers, intervals, ties)
            if greedy_top < top:
                best, top = greedy, greedy_top
    offsets.update({b: bottom + off for b, off in best.items()})
    placed = [evolve(b, offset=offsets.get(b.id, -1)) for b in buffers]
    return placed, bottom + top


def _intervals(allocations, frees):
    """{buffer id: (first step alive, last step alive)} of the non-persistent buffers."""
    start, end = {}, {}
    for i, (fresh, freed) in enumerate(zip(allocations, frees)):
        for b in fresh:
            start[b] = i
        for b in freed:
            end[b] = i
    return {b: (s, end.get(b, len(allocations))) for b, s in start.items()}


def _best_fit(buffers, allocations, frees):
    """Offsets (from 0) by replaying allocations and frees against a best-fit allocator."""
    holes, offsets = _Holes(), {}
    size = [aligned(b.nbytes) for b in buffers]
    take, give = holes.take, holes.give
    for fresh, freed in zip(allocations, frees):
        for b in fresh:
            offsets[b] = take(size[b])
        for b in freed:
            give(offsets[b], size[b])
    return offsets, holes.top


def _largest_first(buffers, intervals, ties):
    """(offsets from 0, top): largest buffers first (those of one size in the order of
    ties(first, last)), each at the lowest offset free over its interval."""
    order = sorted(intervals, key=lambda b: (-aligned(buffers[b].nbytes), *ties(*intervals[b]), b))
    placed = _Placed(max((end for _, end in intervals.values()), default=0) + 1)
    offsets, top = {}, 0
    for b in order:
        start, end = intervals[b]
        size = aligned(buffers[b].nbytes)
        offset = 0
        for low, high in sorted(placed.alive_during(start, end)):
            if offset + size <= low:
                break
            if high > offset:
                offset = high
        placed.add(start, end, (offset, offset + size))
        offsets[b] = offset
        top = max(top, offset + size)
    return offsets, top


class _Placed:
    """Address ranges, each alive over an interval of steps in [0, steps), found by the steps:
    those alive during [start, end] are the ones alive at step `start` (a segment tree over the
    steps, each range kept at the O(log steps) nodes that cover its interval) and those that
    come alive in (start, end] (lists by first step, BUCKET_STEPS steps each), each found once."""

    def __init__(self, steps):
        self.leaves = 1 << max(0, steps - 1).bit_length()
        self.nodes = [[] for _ in range(2 * self.leaves)]
        self.by_first = [[] for _ in range(steps // BUCKET_STEPS + 1)]

    def add(self, start, end, block):
        self.by_first[start // BUCKET_STEPS].append((start, block))
        nodes, low, high = self.nodes, start + self.leaves, end + self.leaves + 1
        while low < high:
            if low & 1:
                nodes[low].append(block)
                low += 1
            if high & 1:
                high -= 1
                nodes[high].append(block)
            low >>= 1
            high >>= 1

    def alive_during(self, start, end):
        """The blocks alive at some step of [start, end], in no order."""
        nodes, node, alive = self.nodes, start + self.leaves, []
        while node:
            alive += nodes[node]
            node >>= 1
        for k in range((start + 1) // BUCKET_STEPS, end // BUCKET_STEPS + 1):
            alive += [block for first, block in self.by_first[k] if start < first <= end]
        return alive
