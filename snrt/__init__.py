"""snrt: train networks deeper and wider than device memory.

A network is a layer graph (YAML or Python); a static scheduler plans which tensors live on
the device, which are offloaded and prefetched, and which are recomputed; executors carry the
plan out on NumPy (CPU) or CuPy (CUDA).
"""

from snrt.config import Config, load_config
from snrt.errors import ConfigError, GraphError, ShapeError, SnrtError
from snrt.graph import Graph
from snrt.layers import LAYERS
from snrt.scheduler import POLICIES, Plan, plan
from snrt.threads import limit_threads, usable_cores
from snrt.train import Trainer

__all__ = ["Config", "ConfigError", "Graph", "GraphError", "LAYERS", "POLICIES", "Plan", "ShapeError", "SnrtError",
           "Trainer", "limit_threads", "load_config", "plan", "usable_cores"]
__version__ = "0.1.0"
