"""The Plan: pure data that says everything an executor does in one training iteration.

A Plan is a buffer table and a list of steps. Each buffer has a fixed offset in one device
arena; resident buffers (parameters, optimizer state, BatchNorm state, unless streamed from a
home in the host store) stay for the whole run, the others come alive at the first step that
writes them and die at a `free` step.
`device_bytes[i]` is the bytes on the device while step i runs; `peak_bytes` their maximum.
Same graph and options give a byte-identical `to_json()`.
"""

import json
from dataclasses import dataclass, field, fields, is_dataclass

ROLES = ("activation", "gradient", "parameter", "parameter_gradient", "optimizer_state", "state", "aux", "workspace",
         "collective")
PERSISTENT_ROLES = ("parameter", "optimizer_state", "state")
STEP_KINDS = ("forward", "recompute", "backward", "update", "offload", "prefetch", "wait", "free", "allreduce",
              "allreduce_wait")


@dataclass(frozen=True, slots=True)
class Buffer:
    """One tensor of the run. `offset` is its place in the device arena, `host_slot` in the
    host store (-1 when never offloaded)."""

    id: int
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    role: str
    offset: int = -1
    host_slot: int = -1

    @property
    def resident(self):
        """True for a tensor that lives on the device for the whole run: a parameter, optimizer
        state or BatchNorm state without a home in the host store. (A streamed one has its home
        there and comes to the device, as a copy, only while steps use it.)"""
        return self.role in PERSISTENT_ROLES and self.host_slot < 0

    @property
    def is_copy(self):
        """True for a later version of a tensor ("name@k"): the same tensor brought back by a
        recompute or a prefetch, or a gradient summed over the ranks."""
        return "@" in self.name


class _Step:
    """What every step kind shares: `reads()` and `writes()`, the buffer ids it reads and writes,
    computed once per step (every pass asks again and again; `evolve` drops the memo). Steps
    and buffers keep their fields in slots: plans hold hundreds of thousands of them."""

    __slots__ = ("_read_ids", "_written_ids")

    def reads(self):
        try:
            return self._read_ids
        except AttributeError:
            return self._remember()[0]

    def writes(self):
        try:
            return self._written_ids
        except AttributeError:
            return self._remember()[1]

    def _remember(self):
        """(reads, writes), computed and kept."""
        ids = tuple(self._reads()), tuple(self._writes())
        object.__setattr__(self, "_read_ids", ids[0])
        object.__setattr__(self, "_written_ids", ids[1])
        return ids


@dataclass(frozen=True, slots=True)
class Forward(_Step):
    """Run node's forward: read `inputs`, write `output` and `aux`; `recompute` replays it."""

    node: str
    inputs: tuple
    output: int
    aux: tuple = ()  # ((name, buffer id), ...)
    params: tuple = ()
    state: tuple = ()
    workspace: int = -1
    recompute: bool = False
    kind: str = field(default="forward", init=False)

    def __post_init__(self):
        if self.recompute:
            object.__setattr__(self, "kind", "recompute")

    def _reads(self):
        return (*self.inputs, *(b for _, b in self.params), *(b for _, b in self.state))

    def _writes(self):
        return (self.output, *(b for _, b in self.aux), *_some(self.workspace))


@dataclass(frozen=True, slots=True)
class Backward(_Step):
    """Run node's backward. `grad_inputs[i]` is (buffer id, partial id) or None: the kernel
    writes the gradient of input i into the buffer, or, when `partial` is not -1, into the
    partial buffer which is then added to the gradient buffer (fan-out). Where that buffer is
    `grad_output` itself (a gradient that took over gy's), the kernel writes nothing for input
    i (Layer.passes_gradient), or writes it over gy (Layer.gradient_in_place)."""

    node: str
    grad_output: int
    saved_inputs: tuple  # buffer id or -1 per input
    saved_output: int
    aux: tuple
    params: tuple
    grad_inputs: tuple
    grad_params: tuple
    workspace: int = -1
    kind: str = field(default="backward", init=False)

    def _reads(self):
        saved = (b for b in (*self.saved_inputs, self.saved_output) if b >= 0)
        return (self.grad_output, *saved, *(b for _, b in self.aux), *(b for _, b in self.params))

    def _writes(self):
        grads = (b for g in self.grad_inputs if g is not None for b in g if b >= 0)
        return (*grads, *(b for _, b in self.grad_params), *_some(self.workspace))


@dataclass(frozen=True, slots=True)
class Update(_Step):
    """Optimizer step for one node's parameters: ((param, grad, (state, ...), decay), ...), the
    states being the optimizer's buffers of that parameter (SGD's momentum, Adam's two moments)."""

    node: str
    slots: tuple
    workspace: int = -1
    kind: str = field(default="update", init=False)

    def _reads(self):
        return tuple(b for p, g, states, _ in self.slots for b in (p, g, *states))

    def _writes(self):
        return (*(b for p, _, states, _ in self.slots for b in (p, *states)), *_some(self.workspace))


@dataclass(frozen=True, slots=True)
class Offload(_Step):
    """Copy `buffer` to its host slot on the device-to-host stream (asynchronous)."""

    buffer: int
    kind: str = field(default="offload", init=False)

    def _reads(self):
        return (self.buffer,)

    def _writes(self):
        return ()


@dataclass(frozen=True, slots=True)
class Prefetch(_Step):
    """Copy the host slot of `source` into `buffer` on the host-to-device stream (asynchronous)."""

    buffer: int
    source: int
    kind: str = field(default="prefetch", init=False)

    def _reads(self):
        return ()

    def _writes(self):
        return (self.buffer,)


@dataclass(frozen=True, slots=True)
class Wait(_Step):
    """The compute stream waits until the copy of `buffer` (an offload or a prefetch) is done."""

    buffer: int
    kind: str = field(default="wait", init=False)

    def _reads(self):
        return (self.buffer,)

    def _writes(self):
        return ()


@dataclass(frozen=True, slots=True)
class AllReduce(_Step):
    """Start summing one bucket of parameter gradients, `grads`, across the `ranks` processes
    (non-blocking): this rank packs them, in order, into its slot of `gathered` (`ranks` slots
    of `nbytes` each, slot r for rank r) and the slots are exchanged (an allgather on the
    communicator) while the backward pass goes on."""

    grads: tuple
    gathered: int
    nbytes: int
    ranks: int
    kind: str = field(default="allreduce", init=False)

    def _reads(self):
        return self.grads

    def _writes(self):
        return (self.gathered,)


@dataclass(frozen=True, slots=True)
class AllReduceWait(_Step):
    """Wait for the exchange of `gathered` (see AllReduce), then write into `sums[j]` the sum of
    every rank's j-th gradient of the bucket, added in rank order (slot 0 + slot 1 + ...), so
    the result does not depend on how the engine groups a reduction."""

    gathered: int
    sums: tuple
    nbytes: int
    ranks: int
    kind: str = field(default="allreduce_wait", init=False)

    def _reads(self):
        return (self.gathered,)

    def _writes(self):
        return self.sums


@dataclass(frozen=True, slots=True)
class Free(_Step):
    """Buffers whose last use has passed; their bytes may be reused."""

    buffers: tuple
    kind: str = field(default="free", init=False)

    def _reads(self):
        return ()

    def _writes(self):
        return ()


@dataclass(frozen=True)
class Plan:
    """Buffers, steps, predicted bytes per step, the arena size."""

    batch: int
    policy: str
    training: bool
    buffers: tuple
    steps: tuple
    device_bytes: tuple
    arena_bytes: int
    host_bytes: int = 0  # host store for offloaded buffers
    allocations: tuple = ()  # per step: ids of the buffers that come alive just before it
    inputs: tuple = ()  # ((input node name, buffer id), ...) fed from the data pipeline
    # per loss layer, in graph order: (output id, gradient seed id or -1, probs aux id, labels id,
    # weight); the last one's probabilities give the accuracy
    losses: tuple = ()
    predicted_s: float = 0.0  # iteration time by the cost model, copies on their streams
    stall_s: float = 0.0  # of which the compute stream waits for copies
    recompute_flops: int = 0
    ranks: int = 1  # data-parallel processes; the loss is the mean over all ranks' samples
    fused: bool = False  # made from the fused graph (snrt/scheduler/fuse.py: planned_graph)

    @property
    def peak_bytes(self):
        return max(self.device_bytes, default=0)

    def bytes_by_role(self):
        """Bytes of every buffer, by role (what the headline table shows)."""
        totals = {role: 0 for role in ROLES}
        for b in self.buffers:
            totals[b.role] += b.nbytes
        return totals

    def bytes_by_dtype(self):
        """Bytes of every buffer, by dtype (workspaces are uint8)."""
        totals = {}
        for b in self.buffers:
            totals[b.dtype] = totals.get(b.dtype, 0) + b.nbytes
        return totals

    def bytes_by_role_per_step(self):
        """[{role: bytes alive while step i runs}] for every step (the memory timeline)."""
        return [dict(live) for live in self._live_by("role", ROLES)]

    def peak_by_role(self):
        """{role: bytes} alive at the peak step."""
        return self._at_peak("role", ROLES)

    def peak_by_dtype(self):
        """{dtype: bytes} alive at the peak step."""
        return self._at_peak("dtype", sorted({b.dtype for b in self.buffers}))

    def _at_peak(self, field, groups):
        """{group: bytes alive at the peak step}, buffers grouped by their `field`."""
        if not self.steps:
            return {}
        peak = self.device_bytes.index(self.peak_bytes)
        for i, live in enumerate(self._live_by(field, groups)):
            if i == peak:
                return dict(live)

    def _live_by(self, field, groups):
        """For each step in turn, {group: bytes alive while it runs} (one dict, updated in
        place), buffers grouped by their `field` ("role" or "dtype"), whose values are `groups`."""
        live = dict.fromkeys(groups, 0)
        for b in self.buffers:
            if b.resident:
                live[getattr(b, field)] += b.nbytes
        buffers = self.buffers
        for step, fresh in zip(self.steps, self.allocations):
            for b in fresh:
                live[getattr(buffers[b], field)] += buffers[b].nbytes
            yield live
            if step.kind == "free":
                for b in step.buffers:
                    live[getattr(buffers[b], field)] -= buffers[b].nbytes

    def copied_bytes(self):
        """(bytes copied device to host, host to device) in one iteration: the offload and
        prefetch steps' buffers."""
        return tuple(sum(self.buffers[s.buffer].nbytes for s in self.steps if s.kind == kind)
                     for kind in ("offload", "prefetch"))

    def exchanged_bytes(self):
        """Bytes of parameter gradients each rank sends to the others in one iteration (its
        slot of every bucket; 0 for one rank)."""
        return sum(s.nbytes for s in self.steps if s.kind == "allreduce")

    def parameter_homes(self):
        """{node: "streamed" or "resident"} for every node with parameters: whether they live in
        the host store and come to the device only while used, or stay on the device."""
        homes = {}
        for b in self.buffers:
            if b.role == "parameter" and not b.is_copy:
                homes[b.name.partition(":")[0]] = "resident" if b.resident else "streamed"
        return homes

    def node_decisions(self):
        """{node: what the plan does with its output between its forward (or, for an input,
        being fed) and the backward pass}, inputs first, then in forward order: "recompute"
        (dropped, replayed in backward), "offload" (copied to the host, prefetched back), "keep"
        (stays on the device until backward reads it) or "unsaved" (backward does not read it;
        a freeing policy frees it after its last use)."""
        recomputed = {s.node for s in self.steps if s.kind == "recompute"}
        offloaded = {s.buffer for s in self.steps if s.kind == "offload"}
        saved = {b for s in self.steps if s.kind == "backward" for b in (*s.saved_inputs, s.saved_output)}
        outputs = [*self.inputs, *((s.node, s.output) for s in self.steps if s.kind == "forward")]
        decisions = {}
        for node, b in outputs:
            if node in recomputed:
                decisions[node] = "recompute"
            elif b in offloaded:
                decisions[node] = "offload"
            else:
                decisions[node] = "keep" if b in saved else "unsaved"
        return decisions

    def describe_step(self, i):
        """One line of text for step i, e.g. '12 backward conv1  reads 3 writes 2  1.2 MiB'."""
        step = self.steps[i]
        names = self._names
        if step.kind in ("offload", "prefetch", "wait"):
            what = self.buffers[step.buffer].name
        elif step.kind == "allreduce":
            what = f"{self.buffers[step.gathered].name}  from [{names(step.grads)}]"
        elif step.kind == "allreduce_wait":
            what = f"{self.buffers[step.gathered].name}  into [{names(step.sums)}]"
        elif step.kind == "free":
            what = names(step.buffers)
        else:
            what = f"{step.node}  reads [{names(step.reads())}]  writes [{names(step.writes())}]"
        return f"{i:6d}  {step.kind:9s} {what}  ({self.device_bytes[i]} bytes on device)"

    def _names(self, ids):
        return ", ".join(self.buffers[b].name for b in ids)

    def to_json(self):
        """Deterministic JSON text of the whole plan."""
        doc = _plain(self)
        doc["peak_bytes"] = self.peak_bytes
        return json.dumps(doc, sort_keys=True, separators=(",", ":"))

    @staticmethod
    def from_json(text):
        """The Plan that `to_json` wrote."""
        doc = json.loads(text)
        doc.pop("peak_bytes")
        step_types = {"forward": Forward, "recompute": Forward, "backward": Backward, "update": Update,
                      "offload": Offload, "prefetch": Prefetch, "wait": Wait, "free": Free, "allreduce": AllReduce,
                      "allreduce_wait": AllReduceWait}
        steps = []
        for s in doc["steps"]:
            kind = s.pop("kind")
            steps.append(step_types[kind](**_tuples(s)))
        doc["steps"] = tuple(steps)
        doc["buffers"] = tuple(Buffer(**_tuples(b)) for b in doc["buffers"])
        return Plan(**{k: (_tuples(v) if isinstance(v, list) else v) for k, v in doc.items()})


def evolve(record, **changes):
    """A copy of the frozen dataclass `record` (a Buffer or a step) with `changes`: what
    dataclasses.replace gives, without running __init__ and __post_init__ again (the planner
    makes hundreds of thousands). So `changes` must not touch a field that __post_init__
    derives from (Forward's `recompute`)."""
    cls = type(record)
    names = _FIELDS.get(cls) or _FIELDS.setdefault(cls, frozenset(f.name for f in fields(cls)))
    if not names.issuperset(changes):
        raise TypeError(f"{cls.__name__} has no field {', '.join(sorted(set(changes) - names))}")
    copy = object.__new__(cls)
    for name in names:  # a step's memo of its reads and writes (see _Step) is not copied
        object.__setattr__(copy, name, changes[name] if name in changes else getattr(record, name))
    return copy


def remap(step, mapping):
    """`step` with every buffer id replaced through `mapping` (ids not in it stay); its reads
    and writes are the old ones mapped (the memo carried over, not computed again)."""
    if type(step) in _ONE_BUFFER:  # the common case in a streamed plan: a copy or a wait
        b = step.buffer
        new = mapping.get(b, b)
        if new == b:
            return step
        return _copied(step, {"buffer": new}, (new,) if step.reads() else (), (new,) if step.writes() else ())
    changes = {}
    for name, remapped in _REMAPPED[type(step)]:
        value = getattr(step, name)
        new = remapped(value, mapping)
        if new != value:
            changes[name] = new
    if not changes:
        return step
    return _copied(step, changes, _ids(step.reads(), mapping), _ids(step.writes(), mapping))


def _copied(step, changes, reads, writes):
    """A copy of `step` with `changes` whose reads and writes are `reads` and `writes` (what
    evolve gives, with the memo filled in)."""
    copy = evolve(step, **changes)
    object.__setattr__(copy, "_read_ids", reads)
    object.__setattr__(copy, "_written_ids", writes)
    return copy


def _id(b, m):
    return m.get(b, b)


def _ids(ids, m):
    return tuple([m.get(b, b) for b in ids])


def _named(pairs, m):
    return tuple([(name, m.get(b, b)) for name, b in pairs])


def _grad_inputs(grads, m):
    return tuple([None if g is None else (m.get(g[0], g[0]), m.get(g[1], g[1])) for g in grads])


def _slots(slots, m):
    return tuple([(m.get(p, p), m.get(g, g), tuple([m.get(s, s) for s in states]), decay)
                  for p, g, states, decay in slots])


# per step type, the fields that hold buffer ids and how to remap each (`source` names a host
# slot; NOT_IDS are the fields that hold no id)
NOT_IDS = ("node", "kind", "recompute", "source", "nbytes", "ranks")
_REMAPPED = {
    Forward: (("inputs", _ids), ("output", _id), ("aux", _named), ("params", _named), ("state", _named),
              ("workspace", _id)),
    Backward: (("grad_output", _id), ("saved_inputs", _ids), ("saved_output", _id), ("aux", _named),
               ("params", _named), ("grad_inputs", _grad_inputs), ("grad_params", _named), ("workspace", _id)),
    Update: (("slots", _slots), ("workspace", _id)),
    Offload: (("buffer", _id),),
    Prefetch: (("buffer", _id),),
    Wait: (("buffer", _id),),
    Free: (("buffers", _ids),),
    AllReduce: (("grads", _ids), ("gathered", _id)),
    AllReduceWait: (("gathered", _id), ("sums", _ids)),
}


_ONE_BUFFER = (Offload, Prefetch, Wait)  # step types whose one id is `buffer`
_FIELDS = {}  # dataclass -> the names of its fields, what evolve copies


def _some(buffer_id):
    """() for the -1 'no buffer' marker, else (buffer_id,)."""
    return () if buffer_id < 0 else (buffer_id,)


def _plain(value):
    """`value` as dataclasses.asdict gives it (a dataclass a dict of its fields, recursively),
    for the plan's records only (dataclasses, tuples, lists, dicts, numbers, strings): a plan
    holds hundreds of thousands of them, and asdict's generality tripled to_json's time."""
    cls = type(value)
    if cls in (int, str, float, bool) or value is None:
        return value
    if cls is tuple or cls is list:
        return [_plain(v) for v in value]
    if is_dataclass(value):
        names = _FIELDS.get(cls) or _FIELDS.setdefault(cls, frozenset(f.name for f in fields(cls)))
        return {name: _plain(getattr(value, name)) for name in names}
    if cls is dict:
        return {k: _plain(v) for k, v in value.items()}
    raise TypeError(f"a plan holds no {cls.__name__}: {value!r}")


def _tuples(value):
    """Lists (from JSON) back to tuples, recursively."""
    if isinstance(value, dict):
        return {k: _tuples(v) for k, v in value.items()}
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value
