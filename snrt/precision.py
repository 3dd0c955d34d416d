"""Training precisions: the element type tensors are stored in, and what each kind keeps in fp32.

- fp32: every tensor in 4 bytes, fp32 math (the default);
- tf32: fp32 storage; convolutions and matrix products may use TF32 tensor-core math where the
  device has it (a CUDA GPU of compute capability 8.0 or newer; elsewhere it is fp32);
- bf16, fp16: activations, their gradients and the layers' saved tensors in 2 bytes; master
  parameters, their gradients and the optimizer state in fp32; the layers that keep fp32 (losses,
  softmax) and normalization statistics stay in fp32 (see `Layer.keeps_fp32` and docs/layers.md).
  fp16's narrow range needs dynamic loss scaling.

The planner stores each buffer in the dtype this table and the layer give it, so every policy,
offload and budget counts the bytes a precision really needs. Which precisions a backend runs is
its `precisions` (both backends: all four, 2-byte tensors through snrt/layers/staging.py into
fp32 kernels).
"""

from dataclasses import dataclass

from snrt.errors import SnrtError

FP32 = "float32"


@dataclass(frozen=True)
class Precision:
    """One row: `storage`, the dtype of activations, their gradients and the layers' saved
    tensors; `tensor_core_math`, whether matrix products may run on tensor cores in reduced
    precision; `loss_scaling`, whether gradients need a dynamic loss scale to stay in range."""

    name: str
    storage: str
    tensor_core_math: bool = False
    loss_scaling: bool = False

    @property
    def two_bytes(self):
        """Whether activations are stored in 2 bytes."""
        return self.storage != FP32


PRECISIONS = {p.name: p for p in (
    Precision("fp32", FP32),
    Precision("tf32", FP32, tensor_core_math=True),
    Precision("bf16", "bfloat16", tensor_core_math=True),
    Precision("fp16", "float16", tensor_core_math=True, loss_scaling=True),
)}
DEFAULT = "fp32"


@dataclass
class LossScale:
    """Dynamic loss scaling (fp16, as torch.amp.GradScaler): the loss's gradient is multiplied
    by `scale` so that small gradients stay above fp16's smallest value, and the parameter
    gradients (fp32) are divided by it before the update. An iteration whose gradients overflow
    skips every update and halves the scale; after `growth_interval` iterations in a row without
    an overflow the scale doubles. `good` counts those iterations."""

    scale: float = 2.0 ** 16
    good: int = 0
    growth_interval: int = 2000

    def after(self, overflowed):
        """Move on after an iteration whose gradients did (or did not) overflow."""
        if overflowed:
            self.scale, self.good = self.scale / 2, 0
        else:
            self.good += 1
            if self.good == self.growth_interval:
                self.scale, self.good = self.scale * 2, 0


class PrecisionError(SnrtError):
    """A backend cannot run a plan's precision (the planner knows no file: the caller names it)."""


def unsupported(precision, backend_class):
    """A PrecisionError when Backend class `backend_class` does not run `precision`; else None."""
    if precision_named(precision).name in backend_class.precisions:
        return None
    *others, last = backend_class.precisions
    runs = f"{', '.join(others)} and {last}" if others else last
    return PrecisionError(f"train.precision: the {backend_class.name} backend runs {runs}; {precision} is planned "
                          f"but not run yet "
                          f"(snrt plan --precision {precision} shows its memory)")


def precision_named(name):
    """The Precision called `name`; an unknown one is a SnrtError listing the choices."""
    if not isinstance(name, str) or name not in PRECISIONS:
        raise SnrtError(f"unknown precision {name!r}; expected one of {', '.join(PRECISIONS)}")
    return PRECISIONS[name]
