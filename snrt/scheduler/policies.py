"""The memory policies: one row each, saying what a policy may do to a tensor.

The planner reads a row's flags to choose its passes, the config layer and the command line
read the names; nothing else spells a policy out.

- none: every tensor kept for the whole iteration (the naive baseline);
- liveness: every tensor freed after its last use;
- recompute: liveness + cost-aware recomputation of cheap layers;
- offload: liveness + every tensor the backward reads offloaded and prefetched;
- superneurons: liveness + recomputation + offload of the remaining checkpoints, never more
  memory than offload alone: a segment whose replay stands at a step over the offload plan's
  peak is kept and offloaded instead of recomputed; with a budget, grown from the faster of
  its plan and offload's (every segment offloaded instead of replayed, where that fits; its
  own is not built when one replay of each droppable node costs more than offload's stalls): the
  segments and tensors that save the most time stay on the device in the room the plan
  leaves (as auto's budget-optimal plans do);
- auto (not a row): the fastest plan, by the cost model, whose arena fits the budget: of the
  rows, and of the budget-optimal plans grown from the rows that replay or offload, which
  keep on the device, instead of replaying, offloading or streaming, the segments, tensors and
  parameters that save the most time in the room the budget leaves (snrt/scheduler/optimal.py).

Under a budget below a row's plan, the planner prefetches just in time (rows that copy) and
then spills the tensors idle at the fullest steps (rows that free; snrt/scheduler/spill.py).
"""

from dataclasses import dataclass

from snrt.errors import SnrtError


@dataclass(frozen=True)
class Policy:
    """What a policy may do: free tensors after their last use, drop and replay cheap layers'
    outputs, copy tensors to the host and back; `capped_by` names the policy whose arena
    this one never exceeds (its replays over that plan's peak are offloaded instead, until
    its peak is within that plan's too, where a few rounds of that get there); with a
    budget, a row that `grows` keeps on the device, in the room its plan leaves, the replayed
    segments and offloaded tensors that save the most time (its budget-optimal plan)."""

    name: str
    frees: bool = False
    recomputes: bool = False
    offloads: bool = False
    capped_by: str = None
    grows: bool = False


POLICIES = {p.name: p for p in (
    Policy("none"),
    Policy("liveness", frees=True),
    Policy("recompute", frees=True, recomputes=True),
    Policy("offload", frees=True, offloads=True),
    Policy("superneurons", frees=True, recomputes=True, offloads=True, capped_by="offload", grows=True),
)}
AUTO = "auto"  # not a row: the fastest plan (a row's, or a budget-optimal one) whose arena fits the budget
CHOICES = (*POLICIES, AUTO)  # every name a user may ask for


def policy_named(name):
    """The Policy called `name` (not "auto"); an unknown name is a SnrtError listing the choices."""
    if not isinstance(name, str) or name not in POLICIES:
        raise SnrtError(f"unknown memory policy {name!r}; expected one of {', '.join(CHOICES)}")
    return POLICIES[name]


def planned_first(chosen):
    """The policies `snrt plan` plans first in its own process when detailing `chosen` (the
    others it may share with a second process, see `planning_groups`): it and the one it is
    capped by (they share that plan: without a budget it is the cap, under one the plan it may
    grow from instead); every policy for `auto`."""
    if chosen not in POLICIES:
        return set(POLICIES)
    return {chosen} | ({POLICIES[chosen].capped_by} - {None})


def planning_groups(names):
    """Policies `names` in the groups that are planned together: a policy with the one it is
    capped by (they share that plan), the rows that do the most first (each row above does
    more than the one before it)."""
    groups = {}
    for name in reversed(names):
        groups.setdefault(POLICIES[name].capped_by or name, []).append(name)
    return list(groups.values())
