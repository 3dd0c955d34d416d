"""What the CPU's compiled kernels share: numba's floating-point options and `LayerLike`, the
base that makes a kernel stand in for its layer."""

from snrt.layers.base import FLOAT32_BYTES

# reassociation lets numba vectorize a sum, in one order fixed by the compiled code (the same
# bits every run); contraction fuses multiply-adds. Nothing that changes NaN or inf handling.
FASTMATH = {"reassoc", "contract"}


class LayerLike:
    """Base of the compiled kernels: what a kernel does not define (its facts: shapes, specs,
    saves; and a forward or backward it leaves to the layer) is the layer's. A kernel uses no
    workspace unless it says so; the planner reserves the layer's own (LayerKernels), which
    covers what every kernel here uses."""

    name = "numba"

    @staticmethod
    def serves(layer, in_shapes):
        """Whether this kernel runs `layer` at `in_shapes` (else the next one asked, or the layer)."""
        return True

    def __init__(self, layer):
        self.layer = layer

    def __getattr__(self, name):
        return getattr(self.layer, name)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return 0
