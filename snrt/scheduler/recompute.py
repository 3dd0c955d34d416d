"""Cost-aware recomputation (SuperNeurons §4.3).

Outputs of cheap layers (BatchNorm, activations, pooling, LRN, Dropout: one input, cheap to
run again) that the backward pass reads are dropped after their last forward use and
replayed in the backward pass from the nearest checkpoint (the output of an expensive layer
or a join). A segment is the set of dropped nodes that share a checkpoint. Each segment is
replayed

- speed-centric: once, before the first backward step that needs any of it, its outputs kept
  until their last backward use, when that fits under the peak of the memory-centric plan
  (so replaying it once costs no peak memory);
- memory-centric: otherwise, once per backward step that needs it, only the chain up to the
  needed tensor, each replayed tensor freed right after its use.

The pass inserts recompute steps that write versions of the original buffers: every replayed
tensor gets a buffer id of its own ("name@k"), and later steps read the newest.
"""

from snrt.layers.base import CHEAP
from snrt.scheduler.plan import Forward, remap
from snrt.scheduler.steps import backward_start

SPEED, MEMORY = "speed", "memory"


def droppable_nodes(graph, steps, start):
    """Cheap nodes whose output or aux the backward reads, directly or through a replay.

    A node is cheap to replay when its layer is CHEAP and it has one input. (Its parameters,
    BatchNorm's scale and shift, are still unchanged when it is replayed: every replay serves
    a backward step of a node downstream, which runs before this node's own update.)
    Replaying a dropped node reads its input, so a cheap producer of that input is dropped
    (and replayed) too, back to the checkpoint.
    """
    read_later = {b for s in steps[start:] for b in s.reads()}
    forwards = {s.node: s for s in steps[:start] if s.kind == "forward"}
    producer = {s.output: n for n, s in forwards.items()}

    def cheap(name):
        step = forwards[name]
        return graph[name].layer.recompute_cost == CHEAP and len(step.inputs) == 1

    dropped = set()
    for name in reversed(list(forwards)):  # consumers before producers
        step = forwards[name]
        needed = read_later & {step.output, *(b for _, b in step.aux)}
        if cheap(name) and needed:
            dropped.add(name)
            source = producer.get(step.inputs[0])
            if source is not None and cheap(source):
                read_later.add(step.inputs[0])  # the replay reads it
    return [n for n in forwards if n in dropped]


def plan_recomputation(graph, steps, table, speed_segments=(), kept_segments=()):
    """`steps` with recompute steps inserted, each writing new versions of its node's output,
    aux and workspace (added to `table`, a BufferTable: what version_buffers would give them).

    Segments whose checkpoint (root buffer id) is in `speed_segments` are replayed
    speed-centric, those in `kept_segments` are not dropped at all (their tensors stay for
    the backward pass, to be offloaded), the others are replayed memory-centric. Returns
    (steps, {root: [nodes]} of the replayed segments).
    """
    start = backward_start(steps)
    forwards = {s.node: s for s in steps[:start] if s.kind == "forward"}
    dropped = droppable_nodes(graph, steps, start)
    if not dropped:
        return list(steps), {}
    producer = {forwards[n].output: n for n in forwards}
    dropped_set = set(dropped)

    def chain(node):
        """Dropped nodes from the checkpoint down to `node`, in forward order."""
        out = [node]
        while producer.get(forwards[out[-1]].inputs[0]) in dropped_set:
            out.append(producer[forwards[out[-1]].inputs[0]])
        return out[::-1]

    root = {n: forwards[chain(n)[0]].inputs[0] for n in dropped}
    kept_segments, speed_segments = set(kept_segments), set(speed_segments)
    dropped = [n for n in dropped if root[n] not in kept_segments]
    dropped_set = set(dropped)
    segments = {}
    for n in dropped:
        segments.setdefault(root[n], []).append(n)
    choice = {n: SPEED if root[n] in speed_segments else MEMORY for n in dropped}
    position = {n: i for i, n in enumerate(forwards)}

    made = {(forwards[n].output, n) for n in dropped} | {(b, n) for n in dropped for _, b in forwards[n].aux}
    made_by = dict(made)
    newest, count = {}, {}  # original id -> its newest version; base name -> versions made
    untouched = newest.keys().isdisjoint

    def version(b):
        new = newest[b] = table.new_version(b, count)
        return new

    def replayed(n):
        """The recompute step of node `n`: it reads the newest versions and writes new ones."""
        f = forwards[n]
        inputs = tuple([newest.get(b, b) for b in f.inputs])
        output = version(f.output)
        aux = tuple([(name, version(b)) for name, b in f.aux])
        workspace = version(f.workspace) if f.workspace >= 0 else -1
        return Forward(n, inputs, output, aux, f.params, f.state, workspace, recompute=True)

    done = set()  # speed-centric segments already replayed
    out = list(steps[:start])
    for step in steps[start:]:
        needed = [made_by[b] for b in step.reads() if b in made_by]
        replay = []
        for n in dict.fromkeys(needed):
            if choice[n] == SPEED:
                if root[n] not in done:
                    done.add(root[n])
                    replay += segments[root[n]]
            else:
                replay += chain(n)
        for n in sorted(set(replay), key=position.get):
            out.append(replayed(n))
        if newest and not (untouched(step.reads()) and untouched(step.writes())):
            step = remap(step, newest)
        out.append(step)
    return out, segments


def speed_segments_that_fit(plan, segments):
    """Roots of the segments that can be replayed speed-centric without raising the peak.

    `plan` is the all-memory-centric plan. Speed-centric keeps a segment's tensors alive from
    its first replay to the backward of its first node; a segment qualifies when the plan's
    bytes over that span plus the segment's bytes stay under the plan's peak. Accepted
    segments are counted in for the next ones.
    """
    device, peak = list(plan.device_bytes), plan.peak_bytes
    first_replay, own_backward, writes = {}, {}, {}
    for i, step in enumerate(plan.steps):
        if step.kind == "forward":
            writes[step.node] = step.writes()
        elif step.kind == "recompute":
            first_replay.setdefault(step.node, i)
        elif step.kind == "backward":
            own_backward[step.node] = i
    chosen = []
    for root, members in segments.items():
        replays = [first_replay[n] for n in members if n in first_replay]
        if not replays:
            continue
        start, end = min(replays), max(own_backward.get(n, min(replays)) for n in members)
        nbytes = sum(plan.buffers[b].nbytes for n in members for b in writes[n])
        if max(device[start:end + 1]) + nbytes <= peak:
            chosen.append(root)
            for i in range(start, end + 1):
                device[i] += nbytes
    return chosen


