"""Offset assignment: every buffer gets a fixed place in one device arena.

The buffers' live intervals are replayed in step order against a best-fit allocator over
one address range (holes are coalesced on free), so two buffers share bytes only when their
intervals do not overlap. The arena is the highest address used; the sum of live bytes at
the peak step is the lower bound any assignment must reach.
"""

import bisect
from dataclasses import replace

from snrt.scheduler.plan import PERSISTENT_ROLES

ALIGN_BYTES = 256


def aligned(nbytes):
    """`nbytes` rounded up to the arena alignment."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class _Holes:
    """Free address ranges below `top`, sorted by start, coalesced."""

    def __init__(self):
        self.starts, self.ends = [], []
        self.top = 0

    def take(self, size):
        best = None
        for k, (start, end) in enumerate(zip(self.starts, self.ends)):
            if end - start >= size and (best is None or end - start < self.ends[best] - self.starts[best]):
                best = k
                if end - start == size:
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


def assign_offsets(buffers, steps, allocations):
    """(buffers with offsets, arena bytes) for buffers alive as `allocations` and Free steps say."""
    holes = _Holes()
    offsets = {}
    for b in buffers:
        if b.role in PERSISTENT_ROLES:
            offsets[b.id] = holes.take(aligned(b.nbytes))
    for step, fresh in zip(steps, allocations):
        for b in fresh:
            offsets[b] = holes.take(aligned(buffers[b].nbytes))
        if step.kind == "free":
            for b in step.buffers:
                holes.give(offsets[b], aligned(buffers[b].nbytes))
    placed = [replace(b, offset=offsets.get(b.id, -1)) for b in buffers]
    return placed, holes.top
