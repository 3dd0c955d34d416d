"""The set-up of a run, with no data yet: the plan, the backend, the executor, and the
persistent values (parameters, BatchNorm statistics) in their buffers.

Training, evaluation and the benchmark scripts all start here, so a plan is always made with
the cost model and kernel choice of the backend that runs it.
"""

from dataclasses import dataclass

from snrt.backends import backend_class
from snrt.errors import SnrtError
from snrt.executor import Executor
from snrt.precision import unsupported
from snrt.scheduler.plan import PERSISTENT_ROLES
from snrt.scheduler.planner import make_plan
from snrt.scheduler.reduce import BUCKET_BYTES


@dataclass
class Runtime:
    """A plan carried out on a backend; `executor.run(feed, ...)` runs one iteration."""

    plan: object
    backend: object
    executor: Executor

    def load(self, values):
        """Write `values` ({(node, name): host array}, e.g. ("conv1", "weight"), or an iterable
        of such pairs, consumed one at a time) into their persistent buffers."""
        for key, value in (values.items() if isinstance(values, dict) else values):
            self.executor.load(*key, value)

    def host_arrays(self, roles=PERSISTENT_ROLES):
        """{(node, name): host copy} of the persistent buffers with the given roles."""
        return {(node, name): fetch() for node, name, fetch in self.persistent_tensors(roles)}

    def persistent_tensors(self, roles=PERSISTENT_ROLES):
        """(node, name, fetch) of every persistent buffer with the given roles, `fetch()` giving
        a host copy of it: one tensor at a time, for writes that must not copy them all at once."""
        fetch = self.executor.fetch
        for b in self.plan.buffers:
            if b.role in roles and not b.is_copy:
                node, _, name = b.name.partition(":")
                yield node, name, lambda node=node, name=name: fetch(node, name)

    def close(self):
        self.backend.close()


def check_trainable(graph, batch):
    """Raise SnrtError naming the first node whose training step cannot run at `batch`."""
    for name, node in graph.nodes.items():
        if node.inputs:
            try:
                node.layer.check_training(graph.in_shapes(name, batch))
            except ValueError as error:
                raise SnrtError(f"node {name!r} ({node.layer.type_name}) cannot train at batch {batch}: {error}") from None


def backend_planning(backend, precision="fp32", deterministic=True):
    """{"cost_model", "kernels"}: the cost model and kernel choice a plan for the backend called
    `backend` is made with in `precision` (the PlanOptions fields; its step times and
    workspaces are those of the kernels it will run). Raises SnrtError when the backend is not
    available or cannot run `precision`."""
    device_class = backend_class(backend)
    refused = unsupported(precision, device_class)
    if refused:
        raise refused
    return {"cost_model": device_class.planning_cost_model(),
            "kernels": device_class.kernel_choice(precision, deterministic)}


def plan_run(graph, batch, policy="none", budget=None, backend="cpu", training=True, optimizer_states=("momentum",),
             deferred_updates=False, group=None, bucket_bytes=BUCKET_BYTES, stream_parameters=False, precision="fp32",
             deterministic=True, fuse=True):
    """The plan `prepare` carries out with the same arguments, made with the cost model and
    kernel choice of the backend called `backend` (backend_planning); nothing is allocated.
    Raises SnrtError when the backend is not available or cannot run `precision`, the graph
    cannot train at `batch`, or (BudgetError) no plan fits `budget`."""
    if training:
        check_trainable(graph, batch)
    choices = backend_planning(backend, precision, deterministic)
    ranks = group.size if group is not None and training else 1
    return make_plan(graph, batch, policy, budget=budget, training=training, optimizer_states=optimizer_states,
                     deferred_updates=deferred_updates, ranks=ranks, bucket_bytes=bucket_bytes,
                     stream_parameters=stream_parameters, precision=precision, fuse=fuse, **choices)


def prepare(graph, batch, policy="none", budget=None, backend="cpu", training=True, optimizer_states=("momentum",),
            check=False, values=None, deferred_updates=False, group=None, bucket_bytes=BUCKET_BYTES,
            stream_parameters=False, host_folder=None, plan=None, precision="fp32", deterministic=True, fuse=True,
            replay=True):
    """The Runtime of `graph` at `batch` under memory `policy` and `budget` (bytes) on the
    backend called `backend`, with `values` ({(node, name): host array}, or an iterable of
    such pairs) loaded.

    `training` False plans the forward pass only; `optimizer_states` names the optimizer's
    buffers of every parameter and `deferred_updates` whether the updates wait for the whole
    backward pass (snrt.optim: `optimizer.plan_options` gives both); `check` is the debug mode
    (poisoned memory, every step verified against the plan). With a `group` of several ranks
    (snrt.parallel), `batch` is this rank's part and a training plan sums the gradients over
    the group in buckets of about `bucket_bytes`. `stream_parameters` keeps parameters and
    optimizer state in the host store, on the device only while steps use them; `host_folder`
    (CPU) puts the host store in a file there instead of memory. `precision` (snrt/precision.py)
    is the one the plan stores tensors in; `deterministic` False lets the GPU run kernels whose
    bits vary from run to run (faster cuDNN engines); `fuse` False plans every layer as its own
    node (snrt/scheduler/fuse.py); `replay` False runs every iteration step by step where the
    backend could replay a captured one (snrt/executor.py). `plan`, when given, is the one
    `plan_run` made with the same arguments (not made again).
    """
    if plan is None:
        plan = plan_run(graph, batch, policy, budget, backend, training=training, optimizer_states=optimizer_states,
                        deferred_updates=deferred_updates, group=group, bucket_bytes=bucket_bytes,
                        stream_parameters=stream_parameters, precision=precision, deterministic=deterministic,
                        fuse=fuse)
    device_class = backend_class(backend)
    on_disk = {"host_folder": host_folder} if host_folder else {}
    kernels = device_class.kernel_choice(precision, deterministic)
    device = device_class(plan.arena_bytes, plan.host_bytes, check=check, kernels=kernels,
                          **on_disk)
    runtime = Runtime(plan, device, Executor(graph, plan, device, group, replay=replay))
    runtime.load(values or {})
    return runtime
