"""The budget-optimal choice of what to keep: which decisions of the most frugal plan to undo.

The frugal plan replays every cheap segment (memory-centric) and offloads every other tensor
the backward pass reads. Each of those decisions can be undone, one at a time:

- a replayed segment kept: its tensors stay on the device from the forward pass to the
  backward pass, and the replays (their compute) are saved;
- an offloaded tensor kept: it stays on the device instead of going to the host and back,
  and the stalls waiting for those copies are saved;
- a node's streamed parameters and optimizer states kept resident: they hold their bytes for
  the whole iteration, and the stalls waiting for their copies are saved.

Undoing decision d costs `d.nbytes` at every step of an interval of the frugal plan and saves
`d.saves_s` predicted seconds. `choose` picks the set of decisions to undo that saves the most
while the frugal plan's device bytes plus the kept bytes stay within the budget at every step.

Lifetimes of a training iteration nest: a tensor written earlier in the forward pass is read
later in the backward pass, so the intervals of a chain of blocks form a laminar family (two
intervals are nested or disjoint), and branches are disjoint siblings. On a laminar family the
choice is an exact dynamic program over the tree of intervals: a subtree's best saving as a
function of the headroom (bytes) its ancestors leave, a step function computed once per
subtree, bottom-up. Intervals that cross (a skip tensor that outlives a block it does not
contain) are widened until they nest, which only over-counts bytes: the choice stays
feasible. A step function with more than `limit` steps is thinned (a dropped step's headroom
gets the saving of the step before: feasible, no longer certainly optimal); `Choice.exact`
says whether that happened.

Thinning loses a little at every level of the tree, and on a deep chain (a 10,000-layer
ResNet's lifetimes nest 17,000 deep) the losses compound. There the choice is nearly a
knapsack, which the greedy fill solves well: undo the decisions with the largest saving per
byte first, each one that still fits. When the DP was thinned, the better of the two is taken.
"""

import bisect
import functools
from dataclasses import dataclass

from snrt.scheduler.steps import STREAMED_ROLES, backward_start

LIMIT = 64  # steps a subtree's saving-by-headroom function keeps at most
NONE = float("-inf")  # the saving where nothing fits


@dataclass(frozen=True)
class Decision:
    """One decision of the frugal plan that can be undone: `key` names it (("segment", root),
    ("tensor", buffer id) or ("parameters", node)); undone, `keeps` (buffer ids) stay on the device, costing
    `nbytes` more at frugal steps `start..end` (inclusive) and saving `saves_s` seconds."""

    key: tuple
    keeps: tuple
    nbytes: int
    start: int
    end: int
    saves_s: float


@dataclass(frozen=True)
class Choice:
    """The decisions `choose` undid, the seconds they save, and whether no step function was
    thinned (then the choice is optimal, not only feasible)."""

    undone: tuple
    saves_s: float
    exact: bool


def frugal_decisions(plan, segments, written_by, seconds, stalls):
    """The Decisions of the frugal Plan `plan` that can be undone.

    `segments` ({checkpoint: [nodes]}) are the segments it replays, `written_by[node]` the
    buffer ids a node's forward step writes, `seconds[i]` step i's predicted compute seconds
    and `stalls` the seconds the compute waits for each buffer's copies (cost.simulate).

    - A segment kept holds its nodes' tensors from their last forward use to the last replay
      of any of them (from then on the frugal plan holds the replayed copies just as long)
      and saves the replays' seconds.
    - An offloaded activation kept holds its bytes from the wait for its offload to its
      prefetch and saves the stalls at both waits.
    """
    steps = plan.steps
    last_forward_use, replays_of, offload_wait, prefetch, offloaded = {}, {}, {}, {}, []
    for i, step in enumerate(steps[:backward_start(steps)]):
        for b in (*step.reads(), *step.writes()):
            last_forward_use[b] = i
    for i, step in enumerate(steps):
        kind = step.kind
        if kind == "recompute":
            replays_of.setdefault(step.node, []).append(i)
        elif kind == "wait":
            offload_wait.setdefault(step.buffer, i)
        elif kind == "prefetch":
            prefetch[step.source] = (i, step.buffer)
        elif kind == "offload":
            offloaded.append(step.buffer)
    out = []
    for root, nodes in segments.items():
        tensors = tuple(sorted({b for n in nodes for b in written_by[n]}))
        replays = [i for n in nodes for i in replays_of.get(n, ())]
        if not replays:
            continue
        out.append(Decision(("segment", root), tensors, sum(plan.buffers[b].nbytes for b in tensors),
                            min(last_forward_use[b] for b in tensors), max(replays),
                            sum(seconds[i] for i in replays)))
    for b in offloaded:
        if plan.buffers[b].role != "activation" or b not in prefetch:
            continue
        at, copy = prefetch[b]
        out.append(Decision(("tensor", b), (b,), plan.buffers[b].nbytes, offload_wait[b], at,
                            stalls.get(b, 0.0) + stalls.get(copy, 0.0)))
    return out + _streamed_decisions(plan, stalls)


def _streamed_decisions(plan, stalls):
    """A Decision per node whose parameters and optimizer states the plan streams: kept
    resident, they hold their bytes for the whole iteration and save the stalls at the waits
    for all their copies."""
    homes, saves = {}, {}
    for b in plan.buffers:
        if b.role in STREAMED_ROLES and b.host_slot >= 0:
            node = b.name.partition(":")[0]
            if not b.is_copy:
                homes.setdefault(node, []).append(b)
            saves[node] = saves.get(node, 0.0) + stalls.get(b.id, 0.0)
    last = len(plan.steps) - 1
    return [Decision(("parameters", node), tuple(b.id for b in own), sum(b.nbytes for b in own), 0, last, saves[node])
            for node, own in homes.items()]


def choose(decisions, device_bytes, budget, limit=LIMIT):
    """The Choice of `decisions` to undo for the largest saving such that, at every step i,
    `device_bytes[i]` plus the bytes of the undone decisions whose interval holds i is at most
    `budget`. None when `device_bytes` alone exceed it.

    Decisions saving nothing are never undone (ties go to the smaller arena)."""
    if max(device_bytes, default=0) > budget:
        return None
    useful = [d for d in decisions if d.saves_s > 0 and d.nbytes > 0]
    tree = _Laminar(useful, len(device_bytes))
    need = [max((max(device_bytes[a:b + 1]) for a, b in ranges), default=0) for ranges in tree.own_ranges]
    thinned = []
    kept, best = [None] * len(useful), [None] * len(useful)
    for i in reversed(tree.order):  # children before parents
        kept[i] = _below(_sum(best[c] for c in tree.children[i]), need[i])
        taken = _shifted(kept[i], useful[i].nbytes, useful[i].saves_s, budget)
        best[i] = _thin(_max(kept[i], taken), limit, thinned)
        for c in tree.children[i]:
            best[c] = None  # no longer needed
    undone = []
    if _at(_below(_sum(best[c] for c in tree.roots), need[-1]), budget) > NONE:  # else thinned: nothing fits
        pending = [(r, budget) for r in tree.roots]
        while pending:
            i, room = pending.pop()
            d = useful[i]
            if d.nbytes <= room and d.saves_s + _at(kept[i], room - d.nbytes) > _at(kept[i], room):
                undone.append(i)
                room -= d.nbytes
            pending.extend((c, room) for c in tree.children[i])
    if thinned:
        undone = max(undone, _greedy(useful, tree, need, budget), key=lambda u: sum(useful[i].saves_s for i in u))
    undone.sort()
    return Choice(tuple(useful[i].key for i in undone), float(sum(useful[i].saves_s for i in undone)), not thinned)


def _greedy(useful, tree, need, budget):
    """The indices of `useful` decisions undone best saving per byte first, each that still fits:
    undoing decision i adds its bytes to every node of i's subtree in _Laminar `tree`, and node
    k fits while `need[k]` plus the bytes added to it is at most `budget`."""
    first = {i: at for at, i in enumerate(tree.order)}  # a preorder: each subtree is a run of it
    size = [1] * len(useful)
    for i in reversed(tree.order):
        size[i] += sum(size[c] for c in tree.children[i])
    room = _RoomTree([budget - need[i] for i in tree.order])
    undone = []
    for i in sorted(range(len(useful)), key=lambda i: (-useful[i].saves_s / useful[i].nbytes, i)):
        span = (first[i], first[i] + size[i] - 1)
        if room.least(*span) >= useful[i].nbytes:
            room.take(*span, useful[i].nbytes)
            undone.append(i)
    return undone


class _RoomTree:
    """Bytes of room at each of n positions, as a segment tree: `least(a, b)` is the smallest at
    positions a..b, `take(a, b, nbytes)` lowers each of them by `nbytes`; both O(log n)."""

    def __init__(self, room):
        self.n = len(room)  # at least one: the fill runs only when the DP thinned some decision's function
        self.low = [0] * (4 * self.n)  # a node's least room, its own takes included
        self.taken = [0] * (4 * self.n)  # bytes taken from the whole of a node's range
        self._build(1, 0, self.n - 1, room)

    def _build(self, node, lo, hi, room):
        if lo == hi:
            self.low[node] = room[lo]
            return
        mid = (lo + hi) // 2
        self._build(2 * node, lo, mid, room)
        self._build(2 * node + 1, mid + 1, hi, room)
        self.low[node] = min(self.low[2 * node], self.low[2 * node + 1])

    def least(self, a, b, node=1, lo=0, hi=None):
        hi = self.n - 1 if hi is None else hi
        if a <= lo and hi <= b:
            return self.low[node]
        mid, out = (lo + hi) // 2, float("inf")
        if a <= mid:
            out = self.least(a, b, 2 * node, lo, mid)
        if b > mid:
            out = min(out, self.least(a, b, 2 * node + 1, mid + 1, hi))
        return out - self.taken[node]

    def take(self, a, b, nbytes, node=1, lo=0, hi=None):
        hi = self.n - 1 if hi is None else hi
        if a <= lo and hi <= b:
            self.low[node] -= nbytes
            self.taken[node] += nbytes
            return
        mid = (lo + hi) // 2
        if a <= mid:
            self.take(a, b, nbytes, 2 * node, lo, mid)
        if b > mid:
            self.take(a, b, nbytes, 2 * node + 1, mid + 1, hi)
        self.low[node] = min(self.low[2 * node], self.low[2 * node + 1]) - self.taken[node]


# A step function of headroom: (bytes, saving) steps, bytes rising and savings rising; its value
# at headroom h is the saving of the last step at or below h (NONE below the first).

def _at(f, h):
    i = bisect.bisect_right(f, (h, float("inf")))
    return f[i - 1][1] if i else NONE


def _rising(points):
    """The steps of sorted (bytes, saving) `points` that raise the saving."""
    out, best, last = [], NONE, None
    for h, v in points:
        if v > best:
            if h == last:
                out[-1] = (h, v)
            else:
                out.append((h, v))
                last = h
            best = v
    return out


def _sum(functions):
    """The sum of step functions (the zero function for none; a lone one as it is, as adding
    the zero function to it changes nothing: a chain's subtrees have one child each)."""
    functions = list(functions)
    if len(functions) == 1:
        return functions[0]
    total = [(0, 0.0)]
    for f in functions:
        total = _rising(_added(total, f))
    return total


def _added(f, g):
    """(headroom, f + g) at every step of either, in one merge of the two."""
    out, i, j, fv, gv = [], 0, 0, NONE, NONE
    while i < len(f) or j < len(g):
        h = f[i][0] if j == len(g) or (i < len(f) and f[i][0] <= g[j][0]) else g[j][0]
        if i < len(f) and f[i][0] == h:
            fv = f[i][1]
            i += 1
        if j < len(g) and g[j][0] == h:
            gv = g[j][1]
            j += 1
        out.append((h, fv + gv))
    return out


def _max(f, g):
    return _rising(sorted(f + g))


def _below(f, need):
    """`f` where the headroom is at least `need`, NONE below."""
    start = _at(f, need)
    return _rising(([(need, start)] if start > NONE else []) + [(h, v) for h, v in f if h > need])


def _shifted(f, nbytes, saving, budget):
    """The steps of `f` moved up by `nbytes` of headroom and `saving` seconds, within `budget`."""
    return [(h + nbytes, v + saving) for h, v in f if h + nbytes <= budget]


def _thin(f, limit, thinned):
    """`f` with at most `limit` steps, first and last kept; appends to `thinned` when it drops any."""
    if len(f) <= limit:
        return f
    thinned.append(True)
    return [f[k] for k in _kept_steps(len(f), limit)]


@functools.lru_cache(maxsize=4096)
def _kept_steps(n, limit):
    """The indices _thin keeps of `n` steps: `limit` of them, evenly spread, first and last."""
    return sorted({round(k * (n - 1) / (limit - 1)) for k in range(limit)})


class _Laminar:
    """The decisions' intervals widened until they nest, as a forest: node i (a decision's
    index) has `children[i]`, in step order; `roots` are the outermost; `own_ranges[i]`
    (i < n) are the step ranges of i not inside a child, `own_ranges[n]` those outside
    every decision (the forest's root)."""

    def __init__(self, decisions, steps):
        n = len(decisions)
        self.order = sorted(range(n), key=lambda i: (decisions[i].start, -decisions[i].end, i))
        start = [d.start for d in decisions]
        end = [d.end for d in decisions]
        self.children = [[] for _ in range(n)]
        self.roots, stack = [], []
        for i in self.order:
            while stack and end[stack[-1]] < start[i]:
                stack.pop()
            for j in reversed(stack):  # open intervals hold start[i]; widen those i outlasts
                if end[j] >= end[i]:
                    break
                end[j] = end[i]
            (self.children[stack[-1]] if stack else self.roots).append(i)
            stack.append(i)
        self.start, self.end = start, end
        spans = [(start[i], end[i]) for i in range(n)] + [(0, steps - 1)]
        kids = self.children + [self.roots]
        self.own_ranges = [_gaps(spans[i], [(start[c], end[c]) for c in kids[i]]) for i in range(n + 1)]


def _gaps(span, inner):
    """The ranges of `span` (first, last) not covered by the sorted, disjoint `inner` ranges."""
    out, at = [], span[0]
    for first, last in inner:
        if first > at:
            out.append((at, first - 1))
        at = max(at, last + 1)
    if at <= span[1]:
        out.append((at, span[1]))
    return out
