"""A planning session: the state of one planning call (make_plan, each_plan, plan_within).

A Session holds the graph, the batch and the PlanOptions, the iteration they give, the
assemblies it lowered (each Recipe lowered once: superneurons builds on offload's plan, auto
builds every row) and the predicted seconds of each step. The iteration built last is kept
across sessions while the graph, the batch and the options build_iteration reads stay the same
(`snrt plan` plans policy after policy; ResNet-2500's iteration is about 29 MiB), with the
step seconds of each cost model; assemblies go with their session.
"""

import contextlib
import gc
import threading
from dataclasses import replace

from snrt.precision import precision_named
from snrt.scheduler import cost as cost_models
from snrt.scheduler.fuse import fuse_layers
from snrt.scheduler.lowering import Recipe, capabilities, lower
from snrt.scheduler.order import ITEMSIZE, build_iteration
from snrt.scheduler.steps import COMPUTE_KINDS, NO_COMPUTE

_LOCK = threading.RLock()  # planning calls in different threads take turns (they share _LAST)
_LAST = {}  # "key": what the iteration was built from, "iteration", "seconds": {cost model: {step key: s}}


@contextlib.contextmanager
def planning():
    """One planning call, run while no other thread plans.

    The passes make hundreds of thousands of small objects that reference counting frees; the
    cyclic collector, triggered by their sheer number, would walk every live plan object again
    and again (a third of ResNet-2500's planning time), so it is paused meanwhile."""
    with _LOCK:
        collecting = gc.isenabled()
        gc.disable()
        try:
            yield
        finally:
            if collecting:
                gc.enable()


def forget():
    """Drop the iteration kept from the last session (the next one builds its own)."""
    with _LOCK:
        _LAST.clear()


class Session:
    """Planning `graph` at `batch` under PlanOptions `options` (see the module docstring)."""

    def __init__(self, graph, batch, options):
        graph = fuse_layers(graph) if options.fuse else graph
        self.graph, self.batch, self.options = graph, batch, options
        inputs = tuple(repr(n.layer) for n in graph.nodes.values() if not n.inputs)  # shapes and dtypes
        settings = getattr(options.kernels, "settings", None)  # what else decides the kernel choice's answers
        key = (graph.fingerprint(), inputs, batch, options.iteration_key(), settings and settings())
        if _LAST.get("key") != key:
            _LAST.update(key=key, iteration=build_iteration(graph, batch, options), seconds={})
        self.iteration = _LAST["iteration"]
        self._known_seconds = _LAST["seconds"].setdefault(options.cost_model, {})
        self._itemsize = ITEMSIZE[precision_named(options.precision).storage]  # of the run's tensors
        self._assemblies, self._does = {}, {}

    def at_batch(self, batch):
        """A Session of the same graph and options at `batch`."""
        return Session(self.graph, batch, self.options)

    def with_options(self, **changes):
        """A Session of the same graph and batch with `changes` to the options."""
        return Session(self.graph, self.batch, replace(self.options, **changes))

    def recipe(self, row, hide_copies=True):
        """The Recipe of Policy `row`'s own plan (copies hidden behind compute, or just in time)."""
        return Recipe(row, self.does(row), hide_copies)

    def does(self, row):
        """What Policy `row` does under this session's options (a lowering.Does, derived once)."""
        does = self._does.get(row)
        if does is None:
            does = self._does[row] = capabilities(row, self.options)
        return does

    def assemble(self, recipe):
        """The Assembly of `recipe` (lowered once per session)."""
        assembly = self._assemblies.get(recipe)
        if assembly is None:
            assembly = self._assemblies[recipe] = lower(self, recipe)
        return assembly

    def seconds(self, steps):
        """The predicted compute seconds of each of `steps` (copies, waits and frees take none),
        each (kind, node) computed once per iteration and cost model."""
        known, out = self._known_seconds, []
        append = out.append
        for s in steps:
            kind = s.kind
            if kind in NO_COMPUTE:
                append(0.0)
                continue
            key = (kind, s.node, 0) if kind in COMPUTE_KINDS else (kind, None, getattr(s, "nbytes", 0))
            value = known.get(key)
            if value is None:
                value = known[key] = cost_models.step_seconds(s, self.graph, self.batch, self.options.cost_model,
                                                              self.options.kernels, self._itemsize)
            append(value)
        return out
