"""The layer library, one module per family. Importing this package registers every layer."""

from snrt.layers import activation, conv, dropout, input, join, linear, loss, norm, pool  # noqa: F401  (registration)
from snrt.layers.base import CHEAP, EXPENSIVE, KernelContext, Layer
from snrt.layers.registry import LAYERS, register

__all__ = ["CHEAP", "EXPENSIVE", "LAYERS", "KernelContext", "Layer", "register"]
