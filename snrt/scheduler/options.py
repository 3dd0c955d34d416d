"""The planning options: what every pass needs besides the graph, the batch and the policy."""

from dataclasses import dataclass

from snrt.errors import SnrtError
from snrt.layers.base import LAYER_KERNELS
from snrt.precision import DEFAULT as DEFAULT_PRECISION, precision_named
from snrt.scheduler import cost as cost_models
from snrt.scheduler.cost import CostModel
from snrt.scheduler.reduce import BUCKET_BYTES
from snrt.units import is_count

KERNEL_CHOICE_METHODS = ("kernel_for", "workspace_bytes", "measured_seconds", "update_workspace_bytes")  # LayerKernels'


def check_flag(name, value):
    """A SnrtError naming option `name` unless `value` is True or False (a string such as
    "no", or a 0, would otherwise be taken for one)."""
    if not isinstance(value, bool):
        raise SnrtError(f"{name}: expected True or False, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class PlanOptions:
    """How one iteration is planned.

    - `training`: False gives a forward-only plan.
    - `optimizer_states`: the optimizer's buffers of each parameter (one planned buffer per
      parameter and name: SGD's ("momentum",), () without momentum, Adam's ("exp_avg",
      "exp_avg_sq")).
    - `deferred_updates`: every update runs after the whole backward pass (what clipping by
      the global gradient norm needs: all parameter gradients stay alive to the end, and the
      plan counts them) instead of each right after its layer's backward.
    - `cost_model`: the device's rates, which time steps and copies (snrt/scheduler/cost.py).
    - `precision`: a name of snrt/precision.py: the dtype activations, their gradients and
      the layers' saved tensors are stored in (parameters and optimizer state stay fp32).
    - `kernels`: the kernel choice of the backend that will run the plan: its
      `workspace_bytes(layer, in_shapes, phase, itemsize)` sizes the workspaces (cuDNN's on the
      GPU; the layers' own on the CPU).
    - `ranks`: with several (data parallel), each rank runs this plan on its batch and the
      parameter gradients are summed across the ranks in buckets of about `bucket_bytes`
      (snrt/scheduler/reduce.py).
    - `stream_parameters`: a training plan of a freeing policy keeps parameters and optimizer
      state in the host store and brings each to the device only while steps use it
      (snrt/scheduler/stream.py).
    - `fuse`: plan the graph with each ReLU folded into the BatchNorm before it
      (snrt/scheduler/fuse.py); False plans every layer as its own node.
    """

    training: bool = True
    optimizer_states: tuple = ("momentum",)
    deferred_updates: bool = False
    cost_model: CostModel = cost_models.CPU
    precision: str = DEFAULT_PRECISION
    kernels: object = LAYER_KERNELS
    ranks: int = 1
    bucket_bytes: int = BUCKET_BYTES
    stream_parameters: bool = False
    fuse: bool = True

    def __post_init__(self):
        states = self.optimizer_states
        if isinstance(states, str) or not isinstance(states, (tuple, list)) or not all(
                isinstance(s, str) for s in states):
            raise SnrtError(f"optimizer_states: expected a tuple of buffer names such as ('momentum',), got {states!r}")
        object.__setattr__(self, "optimizer_states", tuple(states))
        for name in ("ranks", "bucket_bytes"):
            value = getattr(self, name)
            if not is_count(value):
                raise SnrtError(f"{name}: expected a positive int, got {value!r}")
        for name in ("training", "deferred_updates", "stream_parameters", "fuse"):
            check_flag(name, getattr(self, name))
        if not isinstance(self.cost_model, CostModel):
            raise SnrtError(f"cost_model: expected a CostModel, got {type(self.cost_model).__name__} {self.cost_model!r}")
        if not all(callable(getattr(self.kernels, method, None)) for method in KERNEL_CHOICE_METHODS):
            raise SnrtError(f"kernels: expected a kernel choice (a backend's kernel_choice(), with "
                            f"{', '.join(KERNEL_CHOICE_METHODS)}), got {type(self.kernels).__name__} {self.kernels!r}")
        precision_named(self.precision)  # an unknown name: a SnrtError listing the choices

    def iteration_key(self):
        """The options snrt.scheduler.order.build_iteration reads: one iteration serves every
        plan whose options agree on these."""
        return (self.training, self.optimizer_states, self.precision, self.kernels, self.deferred_updates, self.ranks,
                self.bucket_bytes)
