"""snrt: train networks deeper and wider than device memory.

A network is a layer graph (YAML or Python); a static scheduler plans which tensors live on
the device, which are offloaded and prefetched, and which are recomputed; executors carry the
plan out on NumPy (CPU) or CuPy (CUDA).

The names below load on first use, so that `import snrt` (and the `snrt` command's start-up,
when a signal may already arrive) stays light.
"""

import importlib
import os
import sys

# OpenBLAS's threads spin for 2**28 cycles (~0.1 s) after each GEMM before they sleep, holding
# cores that snrt's own threads need right after it (the compiled kernels' threads, the copy
# streams). 2**16 cycles (~20 us) still bridges back-to-back GEMMs. On a 2-core machine
# (results/blas_timeout.md), seconds an iteration at 2**28, 2**16 and 2**4 cycles: CIFAR
# ResNet-110 b32 0.60, 0.23, 0.23; ResNet-50 112x112 b8 0.60, 0.30, 0.30. OpenBLAS reads this when
# numpy loads it, so it holds where snrt is imported before numpy (the `snrt` command); a value
# the user set is kept. Where numpy came first, a CPU backend warns (snrt.threads.warn_if_blas_spins).
BLAS_LOADED_FIRST = "numpy" in sys.modules and "OPENBLAS_THREAD_TIMEOUT" not in os.environ
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

_EXPORTS = {
    "Config": "snrt.config", "load_config": "snrt.config",
    "ConfigError": "snrt.errors", "GraphError": "snrt.errors", "ShapeError": "snrt.errors", "SnrtError": "snrt.errors",
    "Graph": "snrt.graph", "LAYERS": "snrt.layers", "POLICIES": "snrt.scheduler", "Plan": "snrt.scheduler",
    "plan": "snrt.scheduler", "limit_threads": "snrt.threads", "usable_cores": "snrt.threads", "Trainer": "snrt.train",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'snrt' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
