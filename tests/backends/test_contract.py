"""Both backends meet the contract of snrt/backends/base.py (the CUDA one checked where CuPy
imports; no GPU is needed to check a class)."""

import numpy as np
import pytest

import snrt
from snrt.backends import BACKENDS, backend_class
from snrt.backends.base import Backend, CopyEvent
from snrt.backends.numpy_backend import NumpyBackend
from snrt.scheduler.cost import CostModel


def backend_classes():
    classes = [NumpyBackend]
    try:
        from snrt.backends.cupy_backend import CupyBackend
    except ImportError:  # the default install has no CuPy
        return classes
    return classes + [CupyBackend]


@pytest.mark.parametrize("cls", backend_classes(), ids=lambda c: c.__name__)
def test_every_backend_implements_the_whole_contract(cls):
    assert issubclass(cls, Backend)
    assert not cls.__abstractmethods__, f"{cls.__name__} leaves {sorted(cls.__abstractmethods__)} open"
    assert cls.name in BACKENDS
    assert isinstance(cls.cost_model, CostModel)


def test_the_cpu_backend_carries_a_plan_out_through_the_contract():
    graph = snrt.load_config("configs/lenet.yaml").graph
    plan = snrt.plan(graph, batch=4, policy="offload")
    assert plan.host_bytes > 0
    backend = backend_class("cpu")(plan.arena_bytes, plan.host_bytes)
    try:
        buffer = next(b for b in plan.buffers if b.host_slot >= 0)
        backend.arena.reserve(buffer)
        view = backend.arena.view(buffer)
        backend.upload(view, np.arange(view.size, dtype=view.dtype).reshape(view.shape))
        event = backend.offload(buffer)
        assert isinstance(event, CopyEvent)
        event.wait()
        view[...] = 0
        backend.prefetch(buffer, buffer).wait()
        np.testing.assert_array_equal(backend.to_host(view).ravel(), np.arange(view.size))
        loss = next(n for n in graph.nodes.values() if n.layer.type_name == "SoftmaxCrossEntropy")
        assert backend.kernel_for(loss.layer, graph.in_shapes(loss.name, 4)) is loss.layer  # the layer's own
        norm = next(n for n in graph.nodes.values() if n.layer.type_name == "BatchNorm")
        assert backend.kernel_for(norm.layer, graph.in_shapes(norm.name, 4)).name == "numba"  # compiled
    finally:
        backend.close()


def test_the_cpu_arena_is_zeroed_memory_that_asks_for_huge_pages():
    """Arenas of HUGE_PAGE_BYTES or more: an anonymous mapping advised MADV_HUGEPAGE where the
    platform has it (zeros, as np.zeros would give); smaller ones, np.zeros."""
    import mmap

    from snrt.backends.numpy_backend import HUGE_PAGE_BYTES, zeroed_memory

    nbytes = 2 * HUGE_PAGE_BYTES + 5
    backend = NumpyBackend(nbytes)
    try:
        data = backend.arena.data
        assert data.dtype == np.uint8 and data.shape == (nbytes,) and not data.any()
        data[-1] = 7  # writable to its last byte
        assert isinstance(getattr(data.base, "obj", None), mmap.mmap) is hasattr(mmap, "MADV_HUGEPAGE")
    finally:
        backend.close()
    small = zeroed_memory(HUGE_PAGE_BYTES - 1)
    assert small.base is None and small.shape == (HUGE_PAGE_BYTES - 1,) and not small.any()
