"""2-byte tensors, fp32 math: a step's 2-byte arrays staged in fp32 in its workspace.

In a bf16 plan (snrt/precision.py) activations, their gradients and the layers' saved tensors
are stored in 2 bytes, while every kernel computes in fp32. `Staged` runs a kernel on fp32
copies: each 2-byte array the step reads is copied (widened) into an fp32 view carved from the
step's planned workspace, each 2-byte array it writes gets an fp32 view there too, the kernel
runs on the fp32 views with the rest of the workspace as its own, and what it wrote is rounded
back (to nearest, ties to even). Parameters, their gradients, state and statistics are fp32
and passed through. The planner reserves the staging bytes (`staging_bytes`) ahead of the
kernel's own fp32 workspace, so no byte is allocated outside the arena.

The arrays are carved in one order, which `staging_bytes` sizes for the largest case (every
input 2 bytes): forward: the inputs, the output, the saved tensors; backward: the output's
gradient, the inputs and the output the layer saves (`Layer.saves`), the saved tensors, the
inputs' gradients.
"""

import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy, so that its name is a dtype)
import numpy as np

from snrt.layers.base import BACKWARD, FLOAT32_BYTES, Saved, numel, scratch_aligned, scratch_bytes
from snrt.precision import PRECISIONS

# the dtypes of 2-byte storage (compared as dtypes: a dtype's name is formatted at each ask)
TWO_BYTE = frozenset(np.dtype(p.storage) for p in PRECISIONS.values() if p.two_bytes)


def is_two_byte(array):
    """Whether `array` (or None) holds 2-byte floats."""
    return array is not None and array.dtype in TWO_BYTE


def staging_bytes(layer, in_shapes, phase):
    """The fp32 staging bytes a step of `layer` at `in_shapes` needs at most (see the module
    docstring for the order): backward stages only the inputs and output the layer saves."""
    out = numel(layer.infer_shape(in_shapes))
    ins = [numel(s) for s in in_shapes]
    saved_ins = [ins[k] for k in layer.saves.inputs]
    aux = [numel(spec.shape) for name, spec in layer.aux_specs(in_shapes).items()
           if spec.dtype == "compute" and name not in layer.fp32_aux]
    if layer.keeps_fp32:  # its output and saved tensors are fp32: only what it reads or writes upstream
        counts = [*saved_ins, *ins] if phase == BACKWARD else ins
    elif phase == BACKWARD:
        counts = [out, *saved_ins, *([out] if layer.saves.output else []), *aux, *ins]
    else:
        counts = [*ins, out, *aux]
    return scratch_bytes(*(n * FLOAT32_BYTES for n in counts))


def staged_workspace_bytes(layer, in_shapes, phase, own_bytes):
    """Workspace of a staged step: the staging, then (aligned) the kernel's own `own_bytes`."""
    staging = staging_bytes(layer, in_shapes, phase)
    return scratch_aligned(staging) + own_bytes if own_bytes else staging


def fp32_kernel_workspace_bytes(kernel, layer, in_shapes, phase, itemsize):
    """What a backend's kernel choice reserves for `kernel`, a kernel of `layer` computing in
    fp32: its own fp32 workspace, after the fp32 staging when tensors are stored in 2 bytes
    (`itemsize` 2)."""
    own = kernel.workspace_bytes(in_shapes, phase, FLOAT32_BYTES)
    return own if itemsize == FLOAT32_BYTES else staged_workspace_bytes(layer, in_shapes, phase, own)


class Staged:
    """`kernel` (a layer or a kernel of one) run on fp32 copies of its step's 2-byte arrays;
    `convert(out, array)` copies between the two widths (the backend's `convert`)."""

    def __init__(self, kernel, convert):
        self.kernel, self.convert = kernel, convert

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        stage = _Stage(ctx, self.convert)
        xs32 = [stage.read(x) for x in xs]
        y32 = stage.write(y)
        aux32 = {name: stage.write(a) for name, a in aux.items()}
        self.kernel.forward(stage.ctx.rest(), xs32, params, state, y32, aux32, recompute=recompute)
        stage.round_back()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        stage = _Stage(ctx, self.convert)
        gy32 = stage.read(gy)
        saved32 = Saved(tuple(stage.read(x) for x in saved.xs), stage.read(saved.y))
        aux32 = {name: stage.read(a) for name, a in aux.items()}
        gxs32 = [stage.write(g) for g in gxs]
        self.kernel.backward(stage.ctx.rest(), gy32, saved32, params, aux32, gxs32, gparams)
        stage.round_back()


class _Stage:
    """The fp32 views of one step, carved from the front of `ctx`'s workspace."""

    def __init__(self, ctx, convert):
        ctx.release_scratch()
        self.ctx, self.convert, self.written = ctx, convert, []

    def read(self, array):
        """`array`, or its fp32 copy when it is 2 bytes."""
        if not is_two_byte(array):
            return array
        wide = self.ctx.scratch(array.shape, "float32")
        self.convert(wide, array)
        return wide

    def write(self, array):
        """`array`, or an fp32 view rounded back into it by `round_back` when it is 2 bytes."""
        if not is_two_byte(array):
            return array
        wide = self.ctx.scratch(array.shape, "float32")
        self.written.append((array, wide))
        return wide

    def round_back(self):
        for narrow, wide in self.written:
            self.convert(narrow, wide)
