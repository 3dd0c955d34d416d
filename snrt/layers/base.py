"""The layer contract: configuration plus facts for the scheduler plus two kernels.

A layer instance holds configuration only (a frozen dataclass), never arrays. Every fact
method takes `in_shapes`, the full input shapes *including* the batch dimension, so that the
same method answers for any batch size. Kernels are written once against `ctx.xp` (numpy or
cupy) and write into the buffers they are given.

Facts the scheduler relies on (they must be exact, liveness is computed from them):

- `infer_shape(in_shapes) -> out_shape` (raise ShapeError on bad inputs);
- `param_specs`, `state_specs`, `aux_specs` (name -> spec), shapes independent of arrays;
- `saves`: which inputs and whether the output the backward reads (aux tensors are always
  read by the backward; that is what they are for);
- `workspace_bytes(in_shapes, phase, itemsize)`: scratch the kernel carves from
  `ctx.scratch`; a kernel that asks for more raises;
- `cost(in_shapes, phase)`: FLOPs and bytes moved;
- `recompute_cost`: CHEAP (replay it in backward) or EXPENSIVE (checkpoint its output);
- `passes_gradient` / `gradient_in_place`: whether the input gradients may take over gy's
  buffer (they are gy itself; or an elementwise function of it, written over gy).
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from snrt.errors import ShapeError

CHEAP = "cheap"
EXPENSIVE = "expensive"
FORWARD = "forward"
BACKWARD = "backward"
FLOAT32_BYTES = 4
UPDATE_PIECE_BYTES = 2**20  # the optimizers' array code updates a parameter in pieces of at most this many bytes


@dataclass(frozen=True)
class ParamSpec:
    """A trained parameter: shape, initialiser name and the fans the initialiser uses.

    `init` is one of "he_normal", "xavier_uniform", "zeros", "ones", "constant" (every entry
    `fill`). `decay` says whether weight decay applies (weights yes; biases and BN affine no).
    """

    shape: tuple
    init: str
    fan_in: int = 1
    fan_out: int = 1
    decay: bool = True
    fill: float = 0.0


@dataclass(frozen=True)
class StateSpec:
    """Non-trained state kept across iterations (BatchNorm running mean/var), filled with `fill`."""

    shape: tuple
    fill: float


@dataclass(frozen=True)
class AuxSpec:
    """A tensor forward writes for backward to read (BN mean, max-pool argmax, softmax probs).

    `dtype` is a numpy dtype name; "compute" means the dtype the layer's output is stored in
    (2 bytes in bf16 and fp16 runs, see snrt/precision.py).
    """

    shape: tuple
    dtype: str = "compute"


@dataclass(frozen=True)
class Saves:
    """What backward reads besides aux: the input indices and whether the output."""

    inputs: tuple = ()
    output: bool = False


@dataclass(frozen=True)
class Cost:
    """Work of one kernel call: floating-point operations and bytes read plus written."""

    flops: int
    bytes: int


@dataclass(frozen=True)
class Saved:
    """The tensors handed to backward: `xs[i]` is None unless input i is in `saves.inputs`."""

    xs: tuple
    y: object = None


def by_channel(array):
    """The (N, C, K) view of an (N, C, ...) array: every channel's values along the last axis."""
    return array.reshape(array.shape[0], array.shape[1], -1)


def numel(shape):
    """Number of elements of a shape tuple."""
    return math.prod(shape)


def pair(value, name):
    """Normalise an int or a 2-sequence option to a tuple of two ints."""
    if isinstance(value, bool):
        raise ValueError(f"option '{name}' must be an int or a pair of ints, got {value!r}")
    if isinstance(value, int):
        return (value, value)
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return tuple(value)
    raise ValueError(f"option '{name}' must be an int or a pair of ints, got {value!r}")


class _KeyPart:
    """A part of a KernelContext's random key (`seed`, `iteration`): reading it sets
    `read_key` on the step's context (`root`)."""

    def __set_name__(self, owner, name):
        self.slot = f"_{name}"

    def __get__(self, ctx, owner=None):
        if ctx is None:
            return self
        ctx.root.read_key = True
        return getattr(ctx, self.slot)

    def __set__(self, ctx, value):
        setattr(ctx, self.slot, value)


class KernelContext:
    """What a kernel may use besides its buffers.

    `xp` is the array module; `training` selects batch statistics and dropout; `seed`,
    `iteration` and `node_index` key the counter-based RNG; `workspace` is a flat uint8 array
    of the planned workspace bytes (or None when the step has none), handed out by `scratch`;
    `in_shapes` the full shapes of the step's inputs (None for a kernel called outside a
    plan), those of inputs the backward writes no gradient for included.

    Reading `seed` or `iteration` sets `read_key` on the step's context (`root`, shared with
    the contexts `rest` makes): the executor replays a captured iteration only where no
    kernel did, since a replay cannot draw the next iteration's random numbers.
    """

    seed = _KeyPart()
    iteration = _KeyPart()

    def __init__(self, xp, training=True, seed=0, iteration=0, node_index=0, workspace=None, root=None,
                 in_shapes=None):
        self.xp = xp
        self.training = training
        self._seed, self._iteration = seed, iteration
        self.node_index = node_index
        self.workspace = workspace
        self.in_shapes = in_shapes
        self.root = root or self
        self.read_key = False
        self._used_bytes = 0

    def scratch(self, shape, dtype):
        """A fresh view of `shape` and `dtype` carved from the workspace (contents undefined)."""
        dtype = self.xp.dtype(dtype)
        nbytes = numel(shape) * dtype.itemsize
        start = scratch_aligned(self._used_bytes)
        capacity = 0 if self.workspace is None else self.workspace.nbytes
        if start + nbytes > capacity:
            raise RuntimeError(
                f"kernel asked for {start + nbytes} workspace bytes, plan gave {capacity}"
            )
        self._used_bytes = start + nbytes
        return self.workspace[start : start + nbytes].view(dtype).reshape(shape)

    @staticmethod
    def upload(target, host):
        """Copy the host (NumPy) array `host` into `target`, a buffer or scratch view of the same
        shape and dtype: a plain copy on the CPU, a host-to-device copy on CuPy (`set`, which
        allocates nothing on the device, where `xp.asarray(host)` would)."""
        if hasattr(target, "set"):
            target.set(host)
        else:
            target[...] = host

    def release_scratch(self):
        """Forget every scratch view handed out so far (the next call starts at offset 0)."""
        self._used_bytes = 0

    def rest(self):
        """A KernelContext like this one whose workspace is what the scratch views handed out
        so far left (from the next aligned offset)."""
        start = scratch_aligned(self._used_bytes)
        rest = None if self.workspace is None else self.workspace[start:]
        return KernelContext(self.xp, self.training, self._seed, self._iteration, self.node_index, rest, self.root,
                             self.in_shapes)


SCRATCH_ALIGN = 64  # bytes: where each scratch view starts


def scratch_aligned(nbytes):
    """The first scratch offset at or after `nbytes`."""
    return -(-nbytes // SCRATCH_ALIGN) * SCRATCH_ALIGN


def scratch_bytes(*sizes):
    """Workspace needed for scratch arrays of the given byte sizes, with `scratch` alignment."""
    total = 0
    for size in sizes:
        total = scratch_aligned(total) + size
    return total


def with_reachable_strides(layer, in_shapes, spans):
    """`layer` (a windowed layer: `stride`, `padding` pairs) with each stride past what its
    axis can use brought down: along an axis of `size` values padded by `pad` on each side, a
    window of `span` values placed at `stride` keeps that stride, unless no second window fits
    after the first; then it gets the smallest stride that, too, leaves the first window alone,
    both for a window that must end inside the padded axis and for one that must only start
    inside the input or its left padding (a ceil-mode pooling's last window)."""
    stride = tuple(min(s, max(1, size + 2 * pad - span + 1, size + pad))
                   for size, span, s, pad in zip(in_shapes[0][2:], spans, layer.stride, layer.padding))
    return layer if stride == layer.stride else dataclasses.replace(layer, stride=stride)


class Layer:
    """Base of every layer. Subclasses are frozen dataclasses whose fields are the options."""

    type_name: ClassVar[str] = ""
    recompute_cost: ClassVar[str] = CHEAP
    min_inputs: ClassVar[int] = 1
    max_inputs: ClassVar = 1  # int, or None for any number
    saves: ClassVar[Saves] = Saves()
    differentiable_inputs: ClassVar = None  # None: all; else a tuple of input indices
    # every input's gradient is the output's gradient itself (gx_i = gy, same shape): the plan
    # lets input gradients take over gy's buffer (snrt/scheduler/order.py), and the kernel is
    # then given None for them
    passes_gradient: ClassVar[bool] = False
    # every input's gradient is one elementwise function of gy (Add+ReLU's: gy masked), which the
    # kernel may compute in place: the plan lets input gradients take over gy's buffer where no
    # other tensor's gradient still to be read shares it, and the kernel is then given gy's own
    # array as those inputs' gradients, to write over
    gradient_in_place: ClassVar[bool] = False
    keeps_fp32: ClassVar[bool] = False  # output and saved tensors in fp32 whatever the precision (snrt/precision.py)
    fp32_aux: ClassVar[tuple] = ()  # names of saved tensors (statistics) kept in fp32 whatever the precision

    # ---- facts -------------------------------------------------------------------------
    def infer_shape(self, in_shapes):
        """Output shape (batch first) for the given input shapes; raise ShapeError if invalid."""
        return tuple(in_shapes[0])

    def fitted(self, in_shapes):
        """This layer as the graph keeps it for inputs of `in_shapes` (after infer_shape accepted
        them): the same function, with options past what these inputs can use (a stride beyond
        the whole input) brought down to what they can, so that no kernel sizes its work by
        them. Itself, unless a layer says otherwise."""
        return self

    def output_dtype(self, in_dtypes):
        """Dtype name of the output given the inputs' dtype names."""
        return in_dtypes[0]

    def param_specs(self, in_shapes):
        """Trained parameters by name."""
        return {}

    def state_specs(self, in_shapes):
        """Non-trained persistent state by name."""
        return {}

    def aux_specs(self, in_shapes):
        """Small tensors written by forward and read by backward, by name."""
        return {}

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """Scratch bytes a kernel call of `phase` carves from the workspace."""
        return 0

    def check_training(self, in_shapes):
        """Raise ValueError if a training step cannot run on inputs of these shapes (batch first)."""

    def cost(self, in_shapes, phase):
        """Elementwise default: one FLOP per output element, every input and output moved."""
        out = numel(self.infer_shape(in_shapes))
        moved = sum(numel(s) for s in in_shapes) + out
        factor = 2 if phase == BACKWARD else 1
        return Cost(flops=factor * out, bytes=factor * moved * FLOAT32_BYTES)

    def options(self):
        """The configuration as a plain dict (YAML round trip), defaults included."""
        return {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)}

    # ---- kernels -----------------------------------------------------------------------
    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        """Write the output into `y` (and aux tensors into `aux`)."""
        raise NotImplementedError

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        """Overwrite `gxs[i]` (skip None) and every `gparams[name]` from `gy`."""
        raise NotImplementedError

    # ---- helpers for subclasses ------------------------------------------------------
    @staticmethod
    def require_rank(in_shapes, rank, what="NCHW"):
        """Raise ShapeError unless every input has `rank` dimensions."""
        for i, shape in enumerate(in_shapes):
            if len(shape) != rank:
                per_sample = list(shape[1:])
                raise ShapeError(
                    f"input {i} must be {what} ({rank - 1} dims per sample), got {per_sample}"
                )


def _plain(value):
    return list(value) if isinstance(value, tuple) else value


class LayerKernels:
    """The kernel choice that runs every layer's own `xp` code: what plans are sized with
    unless a backend brings its own.

    A kernel choice answers two questions the same way at plan time and at run time: which
    kernel runs a layer at given input shapes (`kernel_for`), and how much workspace that
    kernel wants (`workspace_bytes`, what the planner reserves; `update_workspace_bytes` for an
    optimizer step). A third, `measured_seconds`,
    is the seconds a phase of that kernel was timed to take when the choice timed it (cuDNN's
    engines, the CPU's dense convolutions), which the planner's cost model then uses; None
    leaves the step to the cost model's rates. One whose answers also depend
    on something outside it (an environment variable) offers `settings()`, which the planner
    compares before it reuses an iteration it built. The backends bring their own:
    snrt/backends/cpu_kernels.py (compiled CPU kernels) and cuda_kernels.py (cuDNN, cuBLAS,
    CUDA kernels).
    """

    def kernel_for(self, layer, in_shapes):
        return layer

    def workspace_bytes(self, layer, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return layer.workspace_bytes(in_shapes, phase, itemsize=itemsize)

    def measured_seconds(self, layer, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return None

    def update_workspace_bytes(self, param_bytes):
        """The workspace of an optimizer step whose largest parameter is `param_bytes`: the
        optimizers' array code (snrt/optim.py) keeps one temporary, and works through a larger
        parameter in pieces of UPDATE_PIECE_BYTES. A choice whose updates are one pass over
        the arrays (the CPU's compiled steps, the CUDA kernels) returns 0: no workspace."""
        return min(param_bytes, UPDATE_PIECE_BYTES)


LAYER_KERNELS = LayerKernels()
