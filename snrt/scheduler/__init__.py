"""Memory planning passes: execution order, liveness, recomputation, offload. Pure functions
from a Graph and options to a Plan; no numpy or cupy here."""
