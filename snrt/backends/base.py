"""The backend contract: what the planner, the executor and the trainer need of a device.

A backend class states, before any plan exists, what the planner needs to plan for it: its
`name`, its `cost_model` (snrt/scheduler/cost.py), its `kernel_choice()` (which kernel
runs each layer and the workspace that kernel wants; see snrt.layers.base.LayerKernels) and the
`precisions` (snrt/precision.py) it runs plans in. An
instance is made for one plan, with that plan's arena and host-store sizes, and carries it
out: the device `arena` (snrt/memory/arena.py) every tensor is a view of, the `host` store
(snrt/memory/host.py) of offloaded tensors, copies between them on their own streams with
events, uploads of host arrays and reads back to the host. Both backends (numpy_backend.py,
cupy_backend.py) implement it; the executor and the trainer use nothing else.
"""

from abc import ABC, abstractmethod

from snrt.precision import DEFAULT as DEFAULT_PRECISION
from snrt.units import MAX_BYTES


class CopyEvent(ABC):
    """The completion of one queued copy."""

    seconds = 0.0  # how long the copy itself took (read once the iteration is over)

    @abstractmethod
    def wait(self):
        """Order what the compute stream runs next after the copy (re-raising its error, if any)."""

    def poll(self):
        """Let the copy progress where it needs this process's attention (a non-blocking MPI
        collective advances only inside MPI calls); True once it is known to be done."""
        return False


class _Request(CopyEvent):
    """A non-blocking MPI collective as an event."""

    def __init__(self, request):
        self.request = request

    def wait(self):
        self.request.Wait()

    def poll(self):
        return self.request.Test()


class NotCapturable(RuntimeError):
    """A step does something a captured graph could not replay (a host copy, scalars that
    change between iterations without a row of their own)."""


class Captured:
    """An iteration captured by a backend's `capturing`: `graph` is what `replaying` runs."""

    graph = None


class Backend(ABC):
    """A device for one plan: `arena_bytes` of device memory, `host_bytes` of host store.

    `check` turns on the debug mode (memory poisoned when freed or not yet written, copies
    issued only when waited for); `kernels` is the kernel choice the plan was made with
    (`kernel_choice()` when None).
    """

    name = None  # "cpu", "cuda": what --backend says
    xp = None  # the array module of the device (numpy, cupy)
    cost_model = None  # the CostModel plans for this backend are timed with
    precisions = ("fp32",)  # the precisions of snrt/precision.py its kernels run (others are planned only)

    @classmethod
    def planning_cost_model(cls):
        """The CostModel a plan made here for this backend is timed with: `cost_model`, with the
        rates of this machine where the backend measures them."""
        return cls.cost_model

    @classmethod
    @abstractmethod
    def kernel_choice(cls, precision=DEFAULT_PRECISION, deterministic=True):
        """The kernel choice plans for this backend in `precision` (a name of snrt/precision.py)
        are sized with and run by (at fp32, the default `kernels`); `deterministic` False may
        admit kernels whose bits vary from run to run."""

    def __init__(self, arena_bytes, host_bytes=0, check=False, kernels=None):
        for what, nbytes in (("device arena", arena_bytes), ("host store", host_bytes)):
            if nbytes > MAX_BYTES:  # an allocator would overflow (OverflowError, ValueError) before saying so
                raise MemoryError(f"the {what} of this plan would hold {nbytes:,} bytes, more than any machine "
                                  f"addresses (4 EiB)")
        self.kernels = kernels if kernels is not None else self.kernel_choice()
        self.arena = self.host = None  # set by the subclass: the device Arena and the HostStore

    def kernel_for(self, layer, in_shapes):
        """The kernel the executor runs for `layer` at `in_shapes` (full shapes, batch first)."""
        return self.kernels.kernel_for(layer, in_shapes)

    @abstractmethod
    def offload(self, buffer):
        """Queue the copy of `buffer`'s device bytes to its host slot; returns a CopyEvent."""

    @abstractmethod
    def prefetch(self, buffer, source):
        """Queue the copy of `source`'s host slot into `buffer` on the device; returns a CopyEvent."""

    def update(self, optimizer, w, g, states, weight_decay, lr, count, workspace, grad_scale=1.0):
        """One optimizer update of parameter `w` on the device (snrt/optim.py's
        Optimizer.update arguments). Here: the optimizer's own code on the array module."""
        optimizer.update(self.xp, w, g, states, weight_decay, lr, count, workspace, grad_scale)

    def replay_unsupported_reason(self):
        """None when this backend can capture an iteration's steps as one graph and replay it
        (`capturing`, `replaying`); else why it runs them one by one."""
        return f"the {self.name} backend runs steps one by one"

    def capturing(self, update_rows):
        """A context manager around one iteration's steps that records their kernels and
        copies instead of running them. It yields a Captured whose `graph` is set when the
        block ends without an error; an error ends the capture and passes on, nothing run.
        Each `update` call in the block takes the next of `update_rows` rows of scalars,
        which the graph reads at each replay."""
        raise NotImplementedError(self.replay_unsupported_reason())

    def replaying(self, captured):
        """A context manager in which the iteration's `update` calls write their scalars
        (learning rate, step count...) into their rows, in the order of the capture, and
        nothing else; at its end the rows are copied and `captured.graph` runs, queued."""
        raise NotImplementedError(self.replay_unsupported_reason())

    def describe_kernels(self, executor):
        """One line on what the kernel choices of `executor`'s plan came to ('' when there
        were none to make)."""
        return ""

    def accumulate(self, total, part):
        """total += part on the device: one more contribution to a gradient with several."""
        total += part

    def convert(self, out, array):
        """out[...] = array for device arrays of one shape, converting between fp32 and a 2-byte
        storage type (snrt/layers/staging.py): rounding to nearest, ties to even."""
        out[...] = array

    def start_exchange(self, group, gathered):
        """Start exchanging the rows of the device array `gathered` (ranks, n) among the ranks
        of `group` (snrt.parallel), in place: row r is rank r's part. Returns an event whose
        `wait()` orders what the compute stream runs next after the exchange. Here: MPI's
        non-blocking allgather on host memory."""
        return _Request(group.start_allgather(gathered))

    def upload(self, view, array):
        """Copy host `array` into the device array `view`."""
        view[...] = self.xp.asarray(array)

    def feed(self, view, array):
        """Copy an iteration's input batch, host `array`, into its device array `view`: an
        upload, which a device backend may stage so that the host does not wait for it."""
        self.upload(view, array)

    @abstractmethod
    def to_host(self, array):
        """A host (NumPy) copy of a device array."""

    def synchronize(self):
        """Wait until all queued kernels and copies are done."""

    def close(self):
        """Finish queued work and give back what the backend holds (threads, streams)."""
