"""What the CPU's compiled kernels share: numba's options (`COMPILED`, `THREADED`), the kernel
threads (`run_split`, `threads_for`, `fitting_threads`), bit casts between float32 and its bits
(`float_from_bits`, `bits_of_float`) and `LayerLike`, the base that makes a kernel stand in for
its layer.

Kernel threads: `snrt.threads.kernel_threads()` shares of a kernel that run at once
(cpu_parallel.run_split); every output value is one share's, so results do not depend on the
number of threads.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from snrt.backends import compiled_cache  # noqa: F401  (numba's cache emptied where a compiled source changed)
from snrt.layers.base import FLOAT32_BYTES
from snrt.threads import kernel_threads

# reassociation lets numba vectorize a sum, in one order fixed by the compiled code (the same
# bits every run); contraction fuses multiply-adds. Nothing that changes NaN or inf handling.
FASTMATH = {"reassoc", "contract"}
# The options of every compiled loop: cached machine code, the flags above, and NumPy's error
# model, under which a division by zero gives inf or NaN as NumPy's does (no raised error:
# without it every division carries a zero test and no loop with one vectorizes).
COMPILED = {"cache": True, "fastmath": FASTMATH, "error_model": "numpy"}
THREADED = dict(COMPILED, nogil=True)  # for kernels that run on the kernel threads
# THREADED without fastmath, for kernels whose every operation must round as written (a
# multiply-add the compiler fused would round once where the layer's NumPy code rounds twice)
EXACT = {"cache": True, "error_model": "numpy", "nogil": True}


@intrinsic
def float_from_bits(typingctx, bits):
    """The float32 whose IEEE 754 bits are the low 32 bits of the integer `bits` (a bit cast:
    in a loop it vectorizes, where a NumPy view of an int32 array would need the array)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def bits_of_float(typingctx, value):
    """The IEEE 754 bits of the float32 `value`, as a non-negative int64 (a bit cast)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(types.float32), codegen


def threads_for(values, minimum):
    """The threads a kernel without per-thread scratch splits `values` among: the kernel threads
    when it covers at least `minimum` values, else one (a hand-off costs a few µs)."""
    return kernel_threads() if values >= minimum else 1


def fitting_threads(workspace_bytes, bytes_for):
    """The kernel threads, fewer if a planned workspace of `workspace_bytes` was sized for fewer
    (threads limited after planning): the most for which bytes_for(threads) fits."""
    threads = kernel_threads()
    while threads > 1 and bytes_for(threads) > workspace_bytes:
        threads -= 1
    return threads


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
