"""Parameter and state initialisation from a seed (host NumPy arrays).

Each parameter draws from its own generator keyed by (seed, node name, parameter name), so
one network's weights do not depend on the order in which the others were drawn.
"""

import math
import os
import zlib

import numpy as np

_WEIGHT_INITS = ("he_normal", "xavier_uniform")


def _generator(seed, node, name):
    return np.random.default_rng([seed, zlib.crc32(f"{node}:{name}".encode())])


def _require_host_room(shape, dtype, node, name):
    """MemoryError naming the tensor when it is larger than this machine's memory: refused
    before NumPy is asked (on a host that overcommits, NumPy would hand out the array and the
    kernel would kill the process while it is being filled)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if nbytes > physical:
        raise MemoryError(f"{node}:{name} needs {nbytes} bytes of host memory, more than this machine has "
                          f"({physical})")


def initial_value(spec, seed, node, name, mode="default", dtype=np.float32):
    """The initial array of ParamSpec `spec`.

    `mode` "he" or "xavier" overrides the initialiser of every weight that uses one of them.
    """
    _require_host_room(spec.shape, dtype, node, name)
    init = spec.init
    if mode != "default" and init in _WEIGHT_INITS:
        init = {"he": "he_normal", "xavier": "xavier_uniform"}[mode]
    if init == "zeros":
        return np.zeros(spec.shape, dtype)
    if init == "ones":
        return np.ones(spec.shape, dtype)
    if init == "constant":
        return np.full(spec.shape, spec.fill, dtype)
    rng = _generator(seed, node, name)
    if init == "he_normal":
        return (rng.standard_normal(spec.shape) * math.sqrt(2.0 / spec.fan_in)).astype(dtype)
    if init == "xavier_uniform":
        bound = math.sqrt(6.0 / (spec.fan_in + spec.fan_out))
        return rng.uniform(-bound, bound, spec.shape).astype(dtype)
    raise ValueError(f"unknown initialiser {init!r} for {node}:{name}")


def initial_parameters(graph, seed, mode="default"):
    """{(node, name): array} for every trained parameter of `graph`."""
    return dict(each_initial_parameter(graph, seed, mode))


def each_initial_parameter(graph, seed, mode="default"):
    """((node, name), array) for every trained parameter of `graph`, one array at a time (so
    that loading them into a device never holds more than one host copy)."""
    for node, specs in graph.param_specs().items():
        for name, spec in specs.items():
            yield (node, name), initial_value(spec, seed, node, name, mode)


def initial_state(graph):
    """{(node, name): array} for every persistent state tensor (BatchNorm running stats)."""
    return dict(each_initial_state(graph))


def each_initial_state(graph):
    """((node, name), array) for every persistent state tensor, one array at a time."""
    for node, specs in graph.state_specs().items():
        for name, spec in specs.items():
            _require_host_room(spec.shape, np.float32, node, name)
            yield (node, name), np.full(spec.shape, spec.fill, np.float32)
