"""The CUDA backend: CuPy arena, pinned host store, three CUDA streams, cuDNN kernels.

It implements the backend contract (snrt/backends/base.py) and runs the same plans as
`NumpyBackend`. The layers' kernels are shared with the CPU backend (written against `xp`);
its kernel choice (CudaKernels) hands the executor a faster or allocation-free kernel where
snrt/backends/cuda_kernels.py registers one (cuDNN convolution and BatchNorm, cuBLAS Linear,
CUDA kernels for the layers whose xp code allocates).

The CUDA-only surface, all of it in this file, cuda_source.py (kernel source, NVRTC, launches),
cuda_layers.py (the kernels), cudnn_graphs.py, cudnn_engines.py and cuda_kernels.py (the
per-layer choice) and cuda_rates.py (the cost model's rates, measured on the GPU):

- arena: one device allocation of `plan.arena_bytes` (`Arena(cupy, ...)`, from a memory
  pool of its own), carved into views at the planned offsets; every tensor and every
  workspace is such a view;
- pinned host memory: `cupyx.empty_pinned`, for the host store only when the plan offloads
  (`host_bytes` > 0), and two slots per input that batches are fed through (`feed`);
- streams: compute (one per process, made current on the creating thread, so every CuPy
  kernel, cuBLAS and cuDNN call, the executor's own xp calls included, runs on it in
  program order), device-to-host and host-to-device (per backend), all
  `cupy.cuda.Stream(non_blocking=True)`;
- events: a copy is issued after an event recorded on the compute stream (what was queued
  before the offload or prefetch step is done), timed by start/end events on its copy
  stream; `wait` makes the compute stream wait on the end event (the host does not block);
- copies: `cudaMemcpyAsync` between arena offsets and host slots;
- data parallel: one GPU per rank (the launcher's local rank modulo the GPUs this process
  sees), the gradient exchange an in-place NCCL allgather (`cupy.cuda.nccl`, the
  nvidia-nccl-cu12 wheel) on a collective stream of its own, its communicator made on the
  first exchange from a unique id that rank 0 sends over MPI;
- the allocator: `cupy.cuda.set_allocator` (see below);
- kernels: NVRTC-compiled `RawModule` (cuda_source.KERNEL_SOURCE), cuBLAS SGEMM through
  `cupy_backends.cuda.libs.cublas`, cuDNN frontend graphs (cudnn_graphs), and CuPy's own
  elementwise and reduction kernels for the shared xp code;
- `cudaMemGetInfo` (`memory_report`) to cross-check the arena's measured bytes;
- CUDA graphs (`capturing`, `replaying`): the executor's iteration captured on the compute
  stream (the copy streams fork from it and join it again) and replayed with one launch;
  the updates' scalars live in UpdateRows, a few bytes per parameter outside the arena,
  counted with the allocations outside kernel steps.

Allocation policy: why a guard and not a carved scratch region. Every byte a kernel may use
is planned: its buffers and its workspace (`ctx.scratch`) are arena views, and the CUDA
kernels here use nothing else. So instead of carving an extra scratch region for CuPy's
pool (bytes the plan would have to guess), the backend points CuPy's allocator at an
`AllocationGuard`: while a kernel step runs (the guard is armed by the kernel wrappers that
`kernel_for` returns), any allocation raises `ArenaAllocationError` naming the layer, so an
unplanned temporary is a loud bug, not a silent leak past the accounting. Outside kernel
steps (the executor copying a batch in, parameters loaded, results read back) allocations
are served by a separate pool and counted (`memory_report()["outside_arena_peak_bytes"]`).
CuPy's CUB accelerator is switched off while the backend lives, because CUB reductions take
temporary storage from the pool; CuPy's plain reduction kernels with `out=` take none.
cuBLAS and cuDNN keep their handles and cuBLAS its small internal workspace outside CuPy's
allocator: `memory_report()` reports the device bytes cudaMemGetInfo sees beyond the arena
and the counted pool, so they are visible too.

Check mode (`check=True`) mirrors the CPU backend: the arena poisons freed and unwritten
memory, and copies are issued only when the plan waits for them, so a step that reads a
prefetched buffer before its wait sees the poison.
"""

import atexit
import contextlib
import weakref

import cupy
import cupyx
import numpy as np
from cupy.cuda import runtime

from snrt.backends.base import Backend, Captured, CopyEvent, NotCapturable
from snrt.backends.cuda_kernels import CudaKernels
from snrt.backends.cuda_rates import measured_cost_model
from snrt.backends.cuda_source import NULL_POINTER, device_name, grid_for, nvrtc_toolkit, unsupported_device_reason
from snrt.backends.cudnn_graphs import cudnn_versions
from snrt.errors import SnrtError
from snrt.precision import DEFAULT as DEFAULT_PRECISION, precision_named
from snrt.memory.arena import Arena
from snrt.memory.host import HostStore
from snrt.parallel import launcher_local_rank, launcher_size
from snrt.scheduler import cost
from snrt.summary import human_bytes

FEED_SLOTS = 2  # pinned buffers per input: one is filled while the copy out of the other is queued
NCCL_TYPES = {"float32": 7, "float64": 8}  # ncclFloat32, ncclFloat64 (nccl.h's ncclDataType_t)


class ArenaAllocationError(SnrtError):
    """A kernel asked CuPy for device memory outside the arena: it needs planned workspace."""


class AllocationGuard:
    """CuPy's allocator while a CupyBackend lives.

    Disarmed, allocations come from a pool of its own and are counted (`peak_bytes` is the
    most that was live at once). Armed (`with guard.armed(what)`), any allocation raises.
    """

    def __init__(self):
        self.pool = cupy.cuda.MemoryPool()
        self.armed_by = None
        self.peak_bytes = 0
        self.allocations = 0
        self._previous = None

    def malloc(self, nbytes):
        if self.armed_by is not None:
            raise ArenaAllocationError(
                f"{self.armed_by} asked CuPy for {nbytes} bytes of device memory outside the arena; every "
                "temporary a kernel uses must be planned workspace (ctx.scratch), see snrt/backends/cuda_layers.py")
        pointer = self.pool.malloc(nbytes)
        self.allocations += 1
        self.peak_bytes = max(self.peak_bytes, self.pool.used_bytes())
        return pointer

    @contextlib.contextmanager
    def armed(self, what):
        """Refuse every allocation while the block runs (`what` names the kernel)."""
        previous, self.armed_by = self.armed_by, what
        try:
            yield
        finally:
            self.armed_by = previous

    def install(self):
        self._previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(self.malloc)

    def uninstall(self):
        if self._previous is not None:
            cupy.cuda.set_allocator(self._previous)
            self._previous = None


class CudaCopyEvent(CopyEvent):
    """One copy on a copy stream.

    `wait` makes the compute stream wait for the copy (asynchronous for the host). `seconds`
    is the copy's duration from its CUDA events, measured when first read (that blocks the
    host until the copy is done). A copy in a capture is not `timed`: its events only order
    the graph's streams, and it has no time of its own.
    """

    def __init__(self, compute_stream, what, timed=True):
        self.compute_stream, self.what = compute_stream, what
        self.start, self.end = cupy.cuda.Event(disable_timing=not timed), cupy.cuda.Event(disable_timing=not timed)
        self._issue = None  # set for lazy copies (check mode): issued at wait time
        self._seconds = None

    def wait(self):
        if self._issue is not None:
            issue, self._issue = self._issue, None
            issue()
        self.compute_stream.wait_event(self.end)

    def poll(self):
        return self._issue is None and self.end.done

    @property
    def seconds(self):
        if self._seconds is None:
            self.end.synchronize()
            self._seconds = cupy.cuda.get_elapsed_time(self.start, self.end) / 1e3
        return self._seconds


class UpdateRows:
    """The scalars of a captured iteration's updates: one row of WIDTH float32 values per
    update kernel, in its order, in pinned host memory (written by the update steps every
    iteration) and on the device (copied there before each launch; snrt_*_step_at read it).
    `mode` is "capture" (an update writes its row and launches its kernel), "replay" (it only
    writes its row) or None (neither: steps run one by one)."""

    WIDTH = 16  # floats: Adam's update takes 11

    def __init__(self, rows):
        self.host = cupyx.empty_pinned((max(rows, 1), self.WIDTH), dtype=np.float32)
        self.device = cupy.zeros(self.host.shape, dtype=np.float32)
        self.copied = cupy.cuda.Event(disable_timing=True)  # the last copy of the rows to the device
        self.mode, self.next = None, 0

    def write(self, scalars):
        """The next row, holding `scalars`: its device array."""
        if self.next == len(self.host):
            raise NotCapturable(f"the iteration updates more parameters than the {len(self.host)} the capture planned")
        row, self.next = self.next, self.next + 1
        self.host[row, :len(scalars)] = scalars
        return self.device[row]


class GuardedKernel:
    """A kernel from CudaKernels run with the allocation guard armed (and, when profiling,
    timed with events on the compute stream)."""

    def __init__(self, kernel, backend):
        self.kernel, self.backend = kernel, backend
        self.layer = kernel.layer
        self.name = kernel.name

    def workspace_bytes(self, in_shapes, phase, itemsize=4):
        return self.kernel.workspace_bytes(in_shapes, phase, itemsize)

    @contextlib.contextmanager
    def _running(self, phase):
        what = f"{self.layer.type_name} {phase} ({self.kernel.name} kernel)"
        with self.backend.guard.armed(what), self.backend.timed("compute", what):
            yield

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        with self._running("forward"):
            self.kernel.forward(ctx, xs, params, state, y, aux, recompute=recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        with self._running("backward"):
            self.kernel.backward(ctx, gy, saved, params, aux, gxs, gparams)


class CupyBackend(Backend):
    """The arena, host store and streams of one plan on the current CUDA device.

    `kernels` (a CudaKernels) is the kernel choice the plan was made with (the process's
    `default_kernels()` when None); `profile` records CUDA events around every kernel and
    copy (`timeline`).
    """

    name = "cuda"
    xp = cupy
    cost_model = cost.CUDA

    precisions = ("fp32", "tf32", "bf16", "fp16")  # 2 bytes: fp32 kernels on staged copies

    @classmethod
    def planning_cost_model(cls):
        """cost.CUDA with this GPU's measured rates (snrt/backends/cuda_rates.py)."""
        return measured_cost_model(cls.cost_model)

    @classmethod
    def kernel_choice(cls, precision=DEFAULT_PRECISION, deterministic=True):
        return default_kernels(precision_named(precision).tensor_core_math, deterministic)

    def __init__(self, arena_bytes, host_bytes=0, check=False, kernels=None, profile=False, host_folder=None):
        if host_folder:
            raise SnrtError("a host store on disk (memory.host_store) is offered on the CPU backend only; on CUDA "
                            "the host store is pinned memory")
        if launcher_size() > 1:  # one GPU per rank
            cupy.cuda.Device(launcher_local_rank() % runtime.getDeviceCount()).use()
        total_bytes = runtime.memGetInfo()[1]
        if arena_bytes > total_bytes:
            raise SnrtError(f"the plan's arena ({human_bytes(arena_bytes)}) is larger than the GPU's memory "
                            f"({device_name()}, {human_bytes(total_bytes)}): lower the batch or the image size, or "
                            "set a budget (--budget) that a memory policy plans within")
        super().__init__(arena_bytes, host_bytes, check, kernels)
        self.profile = profile
        self.lazy = check
        self._events = []  # (kind, what, start event, end event) when profiling
        self._closed = False
        self._device = _DeviceState.acquire()
        _ALIVE.add(self)
        self.compute_stream, self.guard = self._device.compute_stream, self._device.guard
        self.to_host_stream = cupy.cuda.Stream(non_blocking=True)
        self.to_device_stream = cupy.cuda.Stream(non_blocking=True)
        self.collective_stream = cupy.cuda.Stream(non_blocking=True)
        self._nccl = None  # the NCCL communicator, made by the first exchange
        self._arena_pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(self._arena_pool.malloc):
            self.arena = Arena(cupy, arena_bytes, check=check)
        self.host = HostStore(cupyx.empty_pinned((host_bytes,), dtype=np.uint8) if host_bytes > 0 else None)
        self._feed_slots = {}  # {input view's address: [(pinned batch, its copy's event)], next first}
        self.kernels.set_stream(self.compute_stream)
        self._rows = None  # the UpdateRows of a captured iteration
        self._origin = cupy.cuda.Event()
        self._origin.record(self.compute_stream)

    # ---- kernels -------------------------------------------------------------------------
    def kernel_for(self, layer, in_shapes):
        """The kernel the executor runs for `layer` at `in_shapes` (the guard armed around it)."""
        return GuardedKernel(self.kernels.kernel_for(layer, in_shapes), self)

    def update(self, optimizer, w, g, states, weight_decay, lr, count, workspace, grad_scale=1.0):
        """One kernel per float32 parameter (snrt_sgd_step or snrt_adam_step, gradient
        scaling and clipping included) instead of the optimizer's four to twelve xp calls.
        In a capture or replay its scalars go to its row of UpdateRows (snrt_*_step_at)."""
        rows = self._rows if self._rows is not None and self._rows.mode else None
        if not all(a.dtype == np.float32 for a in (w, g, *states)):
            if rows is not None:
                raise NotCapturable(f"a {w.dtype} parameter is updated by array code, whose scalars a graph "
                                    "would keep from the capture")
            return super().update(optimizer, w, g, states, weight_decay, lr, count, workspace, grad_scale)
        arrays = [w, g, *states]  # CuPy passes an array as its device pointer
        if optimizer.fused_name == "sgd" and not states:
            arrays.append(NULL_POINTER)  # no momentum buffer
        scalars = (grad_scale, optimizer.clip_value, *optimizer.fused_scalars(weight_decay, lr, count))
        if rows is None:
            self.kernels.module.launch(f"snrt_{optimizer.fused_name}_step", grid_for(w.size),
                                       (*arrays, np.int64(w.size), *(np.float32(s) for s in scalars)))
            return
        row = rows.write(scalars)
        if rows.mode == "capture":
            self.kernels.module.launch(f"snrt_{optimizer.fused_name}_step_at", grid_for(w.size),
                                       (*arrays, np.int64(w.size), row))

    # ---- CUDA graphs -----------------------------------------------------------------------
    def replay_unsupported_reason(self):
        return None

    @contextlib.contextmanager
    def capturing(self, update_rows):
        """The block's work on the compute stream (and the copy streams it forks) captured, not
        run, with every CuPy allocation refused (base.Backend.capturing)."""
        if self._rows is None or len(self._rows.host) < update_rows:
            self._rows = UpdateRows(update_rows)  # allocated before the capture begins
        rows, stream, captured = self._rows, self.compute_stream, Captured()
        rows.copied.synchronize()  # a launch in flight has read its rows
        rows.mode, rows.next = "capture", 0
        stream.begin_capture()
        try:
            with self.guard.armed("a step of a CUDA graph's capture"):
                yield captured
                self._join_copy_streams()
        except BaseException:
            with contextlib.suppress(Exception):  # the capture may be invalidated already
                stream.end_capture()
            raise
        finally:
            rows.mode = None
        captured.graph = stream.end_capture()

    def _join_copy_streams(self):
        """Make the capture's origin, the compute stream, wait for each copy stream the capture
        forked to (a capture ends only with every stream it reached joined)."""
        for stream in (self.to_host_stream, self.to_device_stream):
            if stream.is_capturing():
                joined = cupy.cuda.Event(disable_timing=True)
                joined.record(stream)
                self.compute_stream.wait_event(joined)

    @contextlib.contextmanager
    def replaying(self, captured):
        """The block's updates write their rows; then the rows are copied to the device and
        the graph launched, both queued on the compute stream (base.Backend.replaying)."""
        rows, stream = self._rows, self.compute_stream
        rows.copied.synchronize()  # the last launch's copy is done: the rows may be rewritten
        rows.mode, rows.next = "replay", 0
        try:
            yield
        finally:
            rows.mode = None
        runtime.memcpyAsync(rows.device.data.ptr, rows.host.ctypes.data, rows.host.nbytes,
                            runtime.memcpyHostToDevice, stream.ptr)
        rows.copied.record(stream)
        captured.graph.launch(stream)

    @contextlib.contextmanager
    def timed(self, kind, what):
        """Record start/end events on the compute stream around the block when profiling."""
        if not self.profile:
            yield
            return
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(self.compute_stream)
        yield
        end.record(self.compute_stream)
        self._events.append((kind, what, start, end))

    def describe_kernels(self, executor):
        """How cuDNN's engines were chosen for the plan's graphs (CudaKernels.describe)."""
        return self.kernels.describe()

    # ---- copies --------------------------------------------------------------------------
    def _host_address(self, buffer):
        return self.host.slot(buffer).ctypes.data

    def _copy(self, stream, target, source, nbytes, kind, what):
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(self.compute_stream)  # the kernels queued before this step are done
        timed = self._rows is None or self._rows.mode != "capture"
        event = CudaCopyEvent(self.compute_stream, what, timed)

        def issue():
            stream.wait_event(ready)
            if timed:
                event.start.record(stream)
            runtime.memcpyAsync(target, source, nbytes, kind, stream.ptr)
            event.end.record(stream)

        if self.lazy:
            event._issue = issue
        else:
            issue()
        if self.profile:
            self._events.append(("copy", what, event.start, event.end))
        return event

    def offload(self, buffer):
        source = self.arena.data.data.ptr + buffer.offset
        return self._copy(self.to_host_stream, self._host_address(buffer), source, buffer.nbytes,
                          runtime.memcpyDeviceToHost, f"offload {buffer.name}")

    def prefetch(self, buffer, source):
        target = self.arena.data.data.ptr + buffer.offset
        return self._copy(self.to_device_stream, target, self._host_address(source), source.nbytes,
                          runtime.memcpyHostToDevice, f"prefetch {buffer.name}")

    # ---- gradient exchange -----------------------------------------------------------------
    def start_exchange(self, group, gathered):
        """NCCL's in-place allgather of the rows of `gathered` (ranks, n) on the collective
        stream, after what the compute stream queued before (the packing of this rank's row);
        the event's `wait` makes the compute stream wait for it."""
        ready = cupy.cuda.Event(disable_timing=True)
        ready.record(self.compute_stream)
        event = CudaCopyEvent(self.compute_stream, "gradient exchange")
        communicator, stream = self._communicator(group), self.collective_stream
        count = gathered.size // group.size
        stream.wait_event(ready)
        event.start.record(stream)
        communicator.allGather(gathered[group.rank].data.ptr, gathered.data.ptr, count,
                               NCCL_TYPES[gathered.dtype.name], stream.ptr)
        event.end.record(stream)
        return event

    def _communicator(self, group):
        if self._nccl is None:
            from cupy.cuda import nccl

            unique_id = group.broadcast(nccl.get_unique_id() if group.rank == 0 else None)
            self._nccl = nccl.NcclCommunicator(group.size, unique_id, group.rank)
        return self._nccl

    # ---- host side -----------------------------------------------------------------------
    def to_host(self, array):
        """A host (NumPy) copy (waits for the compute stream)."""
        return cupy.asnumpy(array, stream=self.compute_stream)

    def upload(self, view, array):
        """Copy host `array` into the device `view` without a staging allocation (on the
        compute stream)."""
        view.set(np.ascontiguousarray(array, dtype=view.dtype).reshape(view.shape), stream=self.compute_stream)

    def feed(self, view, array):
        """Copy an input batch into `view` through pinned memory, on the compute stream (the
        view is an arena buffer the previous iteration may still be using): a DMA the host
        queues and does not wait for. Each input has FEED_SLOTS pinned slots used in turn; a
        slot is refilled once the copy out of it is done."""
        slots = self._feed_slots.get(view.data.ptr)
        if slots is None:
            slots = self._feed_slots[view.data.ptr] = [
                (cupyx.empty_pinned(view.shape, dtype=view.dtype), cupy.cuda.Event()) for _ in range(FEED_SLOTS)]
        staged, copied = slots[0]
        slots.append(slots.pop(0))  # the next batch goes to the next slot
        copied.synchronize()
        staged[...] = np.asarray(array).reshape(view.shape)
        view.set(staged, stream=self.compute_stream)
        copied.record(self.compute_stream)

    def synchronize(self):
        """Wait for the compute and both copy streams."""
        for stream in (self.compute_stream, self.to_host_stream, self.to_device_stream, self.collective_stream):
            stream.synchronize()

    def timeline(self):
        """[(kind, what, start_s, end_s)] of the recorded kernels ("compute") and copies
        ("copy"), seconds from the backend's creation, from CUDA events (synchronizes)."""
        self.synchronize()
        out = []
        for kind, what, start, end in self._events:
            out.append((kind, what, cupy.cuda.get_elapsed_time(self._origin, start) / 1e3,
                        cupy.cuda.get_elapsed_time(self._origin, end) / 1e3))
        return out

    def clear_timeline(self):
        self._events.clear()

    def memory_report(self):
        """Device bytes, each measured: the arena (capacity, measured peak of live planned
        bytes, what its pool holds), CuPy allocations outside kernel steps (counted by the
        guard), and `untracked_bytes`: what cudaMemGetInfo sees in use on the device beyond
        every memory pool of snrt's backends and CuPy's default pool (the CUDA context, cuBLAS
        and cuDNN handles and workspaces, loaded kernels, and any other process on the GPU).
        The pools hold memory from cudaMalloc, so it is never negative. Pinned host memory
        (the host store) is host memory and reported apart."""
        free_bytes, total_bytes = runtime.memGetInfo()
        pools = [backend._arena_pool for backend in _ALIVE] + [self.guard.pool, cupy.get_default_memory_pool()]
        pooled = sum(pool.total_bytes() for pool in pools)
        return {
            "arena_bytes": self.arena.capacity_bytes,
            "arena_peak_bytes": self.arena.peak_bytes,
            "arena_allocated_bytes": self._arena_pool.total_bytes(),
            "outside_arena_peak_bytes": self.guard.peak_bytes,  # shared by the process's backends
            "outside_arena_held_bytes": self.guard.pool.total_bytes(),
            "pooled_bytes": pooled,
            "device_used_bytes": total_bytes - free_bytes,
            "untracked_bytes": total_bytes - free_bytes - pooled,
            "device_total_bytes": total_bytes,
            "pinned_host_bytes": 0 if self.host.data is None else self.host.data.nbytes,
        }

    def close(self):
        """Finish queued work; kernels the caller brought are released
        (the process's default ones live until `release_all`); the last backend to close gives
        CuPy its allocator, accelerators and current stream back. Every run closes its
        backend, whatever ends it (`release_all` at exit closes any left open)."""
        if self._closed:
            return
        self._closed = True
        self.synchronize()
        if self.kernels is not default_kernels():
            self.kernels.release()
        self._device.release()


class _DeviceState:
    """What every CupyBackend of the process shares: one compute stream (made current, so
    that CuPy kernels, cuBLAS and cuDNN of every backend and of the executor's own xp calls
    queue on it in program order), the allocation guard installed as CuPy's allocator, and
    CUB switched off. Set up by the first backend, undone when the last one closes."""

    current = None

    def __init__(self):
        self.users = 0
        self.previous_stream = cupy.cuda.get_current_stream()
        self.compute_stream = cupy.cuda.Stream(non_blocking=True)
        self.guard = AllocationGuard()
        self.accelerators = _disable_cub()
        self.compute_stream.use()
        self.guard.install()

    @classmethod
    def acquire(cls):
        if cls.current is None:
            cls.current = cls()
        cls.current.users += 1
        cls.current.compute_stream.use()
        return cls.current

    def release(self):
        self.users -= 1
        if self.users > 0 or _DeviceState.current is not self:
            return
        _DeviceState.current = None
        self.compute_stream.synchronize()
        self.guard.uninstall()
        self.guard.pool.free_all_blocks()
        _restore_cub(self.accelerators)
        self.previous_stream.use()


_DEFAULT_KERNELS = {}  # (allow_tf32, deterministic) -> the process's CudaKernels
_ALIVE = weakref.WeakSet()  # the backends not garbage-collected yet (their arena pools may hold memory)


def default_kernels(allow_tf32=False, deterministic=True):
    """The process's CudaKernels (one cuDNN handle, one graph cache) with or without TF32
    (the tf32 precision) and non-deterministic engines, unless a caller brings its own."""
    key = (allow_tf32, deterministic)
    if key not in _DEFAULT_KERNELS:
        _DEFAULT_KERNELS[key] = CudaKernels(allow_tf32=allow_tf32, deterministic=deterministic)
    return _DEFAULT_KERNELS[key]


@atexit.register
def release_all():
    """Close every backend still open and release the default kernels (their cuDNN graphs and
    handle): run at exit, before the interpreter tears the library bindings down, so that none
    of their objects outlives it."""
    for backend in list(_ALIVE):
        backend.close()  # a no-op for those closed already
    while _DEFAULT_KERNELS:
        _DEFAULT_KERNELS.popitem()[1].release()


def _disable_cub():
    """Switch CuPy's CUB accelerator off (its reductions allocate); returns what to restore."""
    from cupy._core import _accelerator

    saved = (_accelerator.get_reduction_accelerators(), _accelerator.get_routine_accelerators())
    _accelerator.set_reduction_accelerators([])
    _accelerator.set_routine_accelerators([])
    return saved


def _restore_cub(saved):
    from cupy._core import _accelerator

    _accelerator.set_reduction_accelerators(saved[0])
    _accelerator.set_routine_accelerators(saved[1])


def device_unsupported_reason():
    """None when the installed NVRTC compiles for the current GPU, else a sentence naming both."""
    return unsupported_device_reason(device_name(), int(cupy.cuda.Device().compute_capability), nvrtc_toolkit())


def device_summary():
    """One line about the current CUDA device (name, compute capability, memory) and the CUDA
    software snrt runs on it with."""
    free_bytes, total_bytes = runtime.memGetInfo()
    (major, minor), _ = nvrtc_toolkit()
    return (f"{device_name()} (sm_{cupy.cuda.Device().compute_capability}), {total_bytes / 2**30:.1f} GiB, "
            f"{free_bytes / 2**30:.1f} GiB free; driver {_version(runtime.driverGetVersion())}, "
            f"CUDA runtime {_version(runtime.runtimeGetVersion())}, NVRTC {major}.{minor}, CuPy {cupy.__version__}, "
            f"{cudnn_versions()}")


def _version(number):
    """CUDA's integer version (13000) as "13.0"."""
    return f"{number // 1000}.{number % 1000 // 10}"
