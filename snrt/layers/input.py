"""Graph inputs: images and labels fed by the data pipeline."""

from dataclasses import dataclass

from snrt.layers.base import Cost, Layer
from snrt.layers.registry import register

DTYPES = ("float32", "float64", "int32", "int64")


@register
@dataclass(frozen=True)
class Input(Layer):
    """A tensor fed from outside: per-sample `shape` (for example [3, 224, 224]), `dtype`.

    Output: (N, *shape). No kernels: the executor copies the batch in.
    """

    type_name = "Input"
    min_inputs = 0
    max_inputs = 0
    shape: tuple
    dtype: str = "float32"

    def __post_init__(self):
        if not isinstance(self.shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.shape
        ):
            raise ValueError(f"option 'shape' must be a list of positive ints, got {self.shape!r}")
        object.__setattr__(self, "shape", tuple(self.shape))
        if self.dtype not in DTYPES:
            raise ValueError(f"option 'dtype' must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def output_dtype(self, in_dtypes):
        return self.dtype

    def cost(self, in_shapes, phase):
        return Cost(0, 0)
