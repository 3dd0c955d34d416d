"""What the CPU's compiled kernels share: numba's options (`COMPILED`) and `LayerLike`, the
base that makes a kernel stand in for its layer."""

from snrt.layers.base import FLOAT32_BYTES

# reassociation lets numba vectorize a sum, in one order fixed by the compiled code (the same
# bits every run); contraction fuses multiply-adds. Nothing that changes NaN or inf handling.
FASTMATH = {"reassoc", "contract"}
# The options of every compiled loop: cached machine code, the flags above, and NumPy's error
# model, under which a division by zero gives inf or NaN as NumPy's does (no raised error:
# without it every division carries a zero test and no loop with one vectorizes).
COMPILED = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy"}


class LayerLike:
    """Base of the compiled kernels: what a kernel does not define (its facts: shapes, specs,
    saves; and a forward or backward it leaves to the layer) is the layer's, its workspace
    included (a kernel may run the layer's own code for some calls, eval mode say); a kernel
    that never does says what it needs. The planner reserves what the kernel says."""

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
        return self.layer.workspace_bytes(in_shapes, phase, itemsize)
