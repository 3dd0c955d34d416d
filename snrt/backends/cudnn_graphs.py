"""Convolution and BatchNorm through NVIDIA's cuDNN frontend Python graph API (`import cudnn`,
the nvidia-cudnn-frontend package; CuPy 14 removed its own cuDNN module and points there).

Three layers, from pure Python to the device:

1. Translation (no cudnn, no device): `conv_spec` and `batchnorm_spec` turn a layer and its
   full input shapes into the tensor dims, strides and options cuDNN is given. snrt's
   buffers are packed row-major NCHW views of the arena; a (N, C) BatchNorm input is
   (N, C, 1, 1). The weight (O, C/groups, kh, kw) tells cuDNN the group count.
2. Description (cudnn imported, no device): `describe_conv` and `describe_batchnorm` build a
   `cudnn.pygraph` for one operation - conv_fprop, conv_dgrad, conv_wgrad, batchnorm
   (training, with the running-statistics update) and batchnorm_backward. In frontend 1.32 a
   pygraph is a Python IR: it is created and filled without a handle. It infers outputs' dims,
   but lowers only the dims and strides set on a tensor, and cuDNN picks its own layout for
   the others (channels-last for conv_fprop's output), so every tensor here is given the
   packed NCHW layout of its arena view. `validate()` and everything after it lower the graph
   to the cuDNN library and need the CUDA driver (cuInit) and a handle.
3. Building and running (device): `CudnnContext.build` validates, lowers, asks the
   heuristics (modes A, then FALLBACK) for the ranked engines, drops non-deterministic ones
   (unless the run is not deterministic: train.deterministic), TF32 tensor-core ones (unless
   the precision is tf32) and those whose workspace exceeds the limit,
   and selects the fastest that is left, timed on the device once and then kept on disk
   (snrt/backends/cudnn_engines.py). A graph is built once per (operation, shapes,
   workspace limit) and cached on its kernel. `CudnnGraph.execute` runs it on the handle's
   stream (the backend's compute stream) with raw device pointers into the arena and the
   step's workspace.

Kernels `CudnnConv2d` and `CudnnBatchNorm` have the layer contract. What cuDNN refuses (no
engine for the shape, or none within the workspace) runs on the fallback kernel of
snrt/backends/cuda_layers.py (im2col + cuBLAS, or the BatchNorm kernels), and
the reason is kept in `CudnnContext.refusals`. BatchNorm goes to cuDNN in training only
(forward and backward with an input gradient); eval uses the fallback. Some operations have
an alternative timed against the cuDNN graph's engine, which runs them where it was faster
(cudnn_engines.faster): cuBLAS GEMMs for a 1x1 convolution (snrt/backends/cuda_pointwise.py),
the CUDA kernels for BatchNorm (`KernelsInstead`).

The workspace a kernel asks the planner for (`workspace_bytes`) is its cuDNN graphs' need
under the context's `workspace_limit_bytes` (forward: conv_fprop; backward: the larger of
conv_dgrad and conv_wgrad, which run one after the other in the same workspace): the
selected engines' need, their engines timed then. At run time a kernel uses the planned
graph when it fits the step's workspace, else an engine within that workspace (not timed
while a step runs), so plans made without cuDNN's sizes run too.
"""

import logging
import math
from dataclasses import dataclass

import numpy as np

from snrt.backends import cuda_pointwise, cudnn_engines
from snrt.backends.cuda_layers import Float32Kernel, XpKernel
from snrt.backends.cuda_source import best_seconds, device_name, device_pointer, grid_for, int64_args, on_own_pool
from snrt.errors import SnrtError
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, KernelContext, Saved, numel, scratch_bytes

CONV_OPS = ("fprop", "dgrad", "wgrad")
BATCHNORM_OPS = ("forward", "backward")
CUDNN_MAX_ELEMENTS = 2 ** 31 - 1  # larger tensors go to the fallback kernels, which index with 64 bits
CUDNN_WHEELS = ("the gpu extras install it: pip install 'snrt[gpu]' (CUDA 12) or 'snrt[gpu-cuda13]' (CUDA 13)")


def import_cudnn():
    """The cuDNN frontend module (`import cudnn`) with the cuDNN 9 library loaded.

    The library is found by cuda-pathfinder, CuPy's own library finder (the nvidia-cudnn-cu12
    or -cu13 wheel, a conda environment, CUDA_HOME, the system's loader path), and loaded before
    the frontend looks for it, so the frontend uses that copy wherever the environment holds it.
    A clear SnrtError when the library or the frontend is missing."""
    try:
        from cuda import pathfinder
    except ImportError:  # a CuPy older than 14: the frontend's own search (site-packages, the loader)
        pathfinder = None
    if pathfinder is not None:
        try:
            pathfinder.load_nvidia_dynamic_lib("cudnn")
        except pathfinder.DynamicLibNotFoundError as e:
            raise SnrtError(f"cuDNN 9 (libcudnn.so.9) was not found: {CUDNN_WHEELS}, or put the folder that holds "
                            f"it on LD_LIBRARY_PATH ({e})") from None
    try:
        import cudnn
    except ImportError as e:
        raise SnrtError(f"the cuDNN frontend (nvidia-cudnn-frontend) is not installed ({e}); {CUDNN_WHEELS}") from None
    return cudnn


def cudnn_versions():
    """"cuDNN 9.27.0 (frontend 1.32.0)", or what is missing."""
    try:
        cudnn = import_cudnn()
    except SnrtError as e:
        return str(e)
    version = cudnn.backend_version()
    return f"cuDNN {version // 10000}.{version % 10000 // 100}.{version % 100} (frontend {cudnn.__version__})"


def row_major_strides(dims):
    """Element strides of a packed row-major (C-contiguous) tensor of `dims`."""
    strides, step = [], 1
    for d in reversed(dims):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


@dataclass(frozen=True)
class ConvSpec:
    """What cuDNN is told about one Conv2d call: x, w, y dims (NCHW, packed) and options."""

    x: tuple
    w: tuple
    y: tuple
    padding: tuple
    stride: tuple
    dilation: tuple
    groups: int

    @property
    def dims(self):
        return self.x, self.w, self.y


def conv_spec(layer, in_shapes):
    """The ConvSpec of a Conv2d layer at full input shapes `in_shapes` (batch first)."""
    x = tuple(in_shapes[0])
    y = tuple(layer.infer_shape(in_shapes))
    w = tuple(layer.param_specs(in_shapes)["weight"].shape)
    return ConvSpec(x, w, y, tuple(layer.padding), tuple(layer.stride), tuple(layer.dilation), layer.groups)


@dataclass(frozen=True)
class BatchNormSpec:
    """What cuDNN is told about one BatchNorm call: x as NCHW, per-channel tensors (1, C, 1, 1)."""

    x: tuple
    channels: int
    eps: float
    momentum: float

    @property
    def stats(self):
        return (1, self.channels, 1, 1)

    @property
    def dims(self):
        return self.x, self.stats


def batchnorm_spec(layer, in_shapes):
    """The BatchNormSpec of a BatchNorm layer; a (N, C) input is described as (N, C, 1, 1)."""
    shape = tuple(in_shapes[0])
    layer.infer_shape(in_shapes)  # validates the rank
    x = shape if len(shape) == 4 else (*shape, 1, 1)
    return BatchNormSpec(x, shape[1], layer.eps, layer.momentum)


def _new_graph(cudnn, name, handle):
    f32 = cudnn.data_type.FLOAT
    return cudnn.pygraph(name=name, io_data_type=f32, intermediate_data_type=f32, compute_data_type=f32,
                         handle=handle)


def _tensor(cudnn, graph, name, dims):
    return graph.tensor(name=name, dim=list(dims), stride=list(row_major_strides(dims)),
                        data_type=cudnn.data_type.FLOAT)


def _output(cudnn, tensor, dims):
    """An operation's output bound to a packed NCHW arena view. Its dims and strides are set
    explicitly: the frontend pushes only set ones to cuDNN, which otherwise picks a layout of
    its own (channels-last for a convolution's output)."""
    return (tensor.set_output(True).set_data_type(cudnn.data_type.FLOAT)
            .set_dim(list(dims)).set_stride(list(row_major_strides(dims))))


def describe_conv(cudnn, spec, op, handle=None):
    """(pygraph, {role: tensor}) of one convolution operation, `op` in CONV_OPS.

    fprop: x, w -> y; dgrad: dy, w -> dx; wgrad: x, dy -> dw (roles name the snrt buffers).
    Every tensor, outputs included, has the dims and packed strides of its snrt buffer.
    """
    graph = _new_graph(cudnn, f"snrt_conv_{op}", handle)
    options = dict(padding=list(spec.padding), stride=list(spec.stride), dilation=list(spec.dilation),
                   compute_data_type=cudnn.data_type.FLOAT)
    if op == "fprop":
        x, w = _tensor(cudnn, graph, "x", spec.x), _tensor(cudnn, graph, "w", spec.w)
        y = _output(cudnn, graph.conv_fprop(image=x, weight=w, name="fprop", **options), spec.y)
        return graph, {"x": x, "w": w, "y": y}
    if op == "dgrad":
        dy, w = _tensor(cudnn, graph, "dy", spec.y), _tensor(cudnn, graph, "w", spec.w)
        dx = _output(cudnn, graph.conv_dgrad(loss=dy, filter=w, name="dgrad", **options), spec.x)
        return graph, {"dy": dy, "w": w, "dx": dx}
    if op == "wgrad":
        x, dy = _tensor(cudnn, graph, "x", spec.x), _tensor(cudnn, graph, "dy", spec.y)
        dw = _output(cudnn, graph.conv_wgrad(image=x, loss=dy, name="wgrad", **options), spec.w)
        return graph, {"x": x, "dy": dy, "dw": dw}
    raise ValueError(f"unknown convolution operation {op!r}; expected one of {', '.join(CONV_OPS)}")


def describe_batchnorm(cudnn, spec, op, handle=None):
    """(pygraph, {role: tensor}) of one BatchNorm operation, `op` in BATCHNORM_OPS.

    forward: x, scale, bias, running mean/var in, epsilon, momentum -> y, mean, inv_std,
    running mean/var out (the executor binds in and out to the same state buffers, or, for a
    recomputed forward, out to workspace it drops);
    backward: dy, x, scale, mean, inv_std -> dx, dscale, dbias.
    epsilon and momentum are pass-by-value (host) scalars.
    """
    graph = _new_graph(cudnn, f"snrt_batchnorm_{op}", handle)
    stats = spec.stats
    if op == "forward":
        t = {role: _tensor(cudnn, graph, role, spec.x if role == "x" else stats)
             for role in ("x", "scale", "bias", "running_mean", "running_var")}
        scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.FLOAT, is_pass_by_value=True)
        t["epsilon"] = graph.tensor(name="epsilon", **scalar)
        t["momentum"] = graph.tensor(name="momentum", **scalar)
        y, mean, inv_std, next_mean, next_var = graph.batchnorm(
            name="bn", input=t["x"], scale=t["scale"], bias=t["bias"], epsilon=t["epsilon"], momentum=t["momentum"],
            in_running_mean=t["running_mean"], in_running_var=t["running_var"])
        t["y"] = _output(cudnn, y, spec.x)
        for role, tensor in (("mean", mean), ("inv_std", inv_std), ("next_running_mean", next_mean),
                             ("next_running_var", next_var)):
            t[role] = _output(cudnn, tensor, stats)
        return graph, t
    if op == "backward":
        t = {"dy": _tensor(cudnn, graph, "dy", spec.x), "x": _tensor(cudnn, graph, "x", spec.x),
             "scale": _tensor(cudnn, graph, "scale", stats), "mean": _tensor(cudnn, graph, "mean", stats),
             "inv_std": _tensor(cudnn, graph, "inv_std", stats)}
        dx, dscale, dbias = graph.batchnorm_backward(name="dbn", grad=t["dy"], input=t["x"], scale=t["scale"],
                                                     mean=t["mean"], inv_variance=t["inv_std"])
        t["dx"], t["dscale"], t["dbias"] = _output(cudnn, dx, spec.x), _output(cudnn, dscale, stats), _output(cudnn, dbias, stats)
        return graph, t
    raise ValueError(f"unknown BatchNorm operation {op!r}; expected one of {', '.join(BATCHNORM_OPS)}")


class CudnnGraph:
    """A built graph: its tensors by role, its engine (a cudnn_engines.Engine), the engine's
    measured seconds (None when not timed), how the engine was chosen (cudnn_engines.TIMED,
    KEPT or FIRST), the workspace it needs, and `execute`."""

    name = "cudnn"

    def __init__(self, graph, tensors, handle, engine, seconds=None, chosen=cudnn_engines.FIRST):
        self.graph, self.tensors, self.handle = graph, tensors, handle
        self.engine, self.seconds, self.chosen = engine, seconds, chosen
        self.workspace_bytes = int(graph.get_workspace_size())

    def execute(self, pointers, workspace_ptr):
        """Run on the handle's stream; `pointers` maps roles to device (or, for
        pass-by-value scalars, host) addresses as ints."""
        pack = {self.tensors[role].uid: int(ptr) for role, ptr in pointers.items()}
        self.graph.execute(pack, workspace_ptr if self.workspace_bytes else None, handle=self.handle)


class CudnnContext:
    """One cuDNN handle on the current device, and graph building with engine selection."""

    def __init__(self, workspace_limit_bytes=None, allow_tf32=False, deterministic=True):
        import cupy

        cudnn_engines.setting()  # a bad SNRT_CUDNN_ENGINES is an error now, not a refused graph later
        cudnn = import_cudnn()
        # The frontend also offers Python engine families ("frost"); some import torch and,
        # with a CPU-only torch installed, fail to load with a logged traceback. snrt's graphs
        # only use the library's engines, so that log is noise: keep it quiet.
        logging.getLogger("cudnn.engines.manifest").setLevel(logging.CRITICAL)
        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        self.workspace_limit_bytes = workspace_limit_bytes
        self.allow_tf32, self.deterministic = allow_tf32, deterministic
        self.refusals = {}  # description -> why cuDNN did not serve it
        self.stream_ptr = 0  # the handle's stream: the default one until set_stream
        self._choices_key = (f"{device_name()} sm_{cupy.cuda.Device().compute_capability} | "
                             f"{cudnn_versions()} | {'deterministic' if deterministic else 'any'}"
                             f"{', TF32' if allow_tf32 else ''}")

    def choice_key(self, description, limit):
        """The key of a choice about `description` under workspace `limit` in the choices file:
        the device, the cuDNN versions and the context's filters come first."""
        return f"{self._choices_key} | {description} | workspace limit {limit}"

    def set_stream(self, stream):
        self.stream_ptr = stream.ptr
        self.cudnn.set_stream(self.handle, stream.ptr)

    def close(self):
        """Destroy the handle (the graphs built on it must be dropped first)."""
        if self.handle is not None:
            self.cudnn.destroy_handle(self.handle)
            self.handle = None

    def build(self, description, describe, limit, timed=False):
        """The CudnnGraph from `describe(cudnn, handle)` with the fastest engine whose
        workspace is at most `limit` bytes (None: any), or None when cuDNN has none.
        `timed`: time the engines when no choice is kept for this graph (at planning time;
        never while a step runs); else the kept choice or cuDNN's first
        (snrt/backends/cudnn_engines.py)."""
        cudnn = self.cudnn
        try:
            graph, tensors = describe(cudnn, self.handle)
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            notes = [cudnn.numerical_note.NONDETERMINISTIC] if self.deterministic else []
            if not self.allow_tf32:  # float32 on tensor cores is TF32, which down-converts the inputs
                notes += [cudnn.numerical_note.TENSOR_CORE, cudnn.numerical_note.DOWN_CONVERT_INPUTS]
            if notes:
                graph.deselect_numeric_notes(notes)
            if limit is not None:
                graph.deselect_workspace_greater_than(int(limit))
            graph.check_support()
            engine, seconds, chosen = cudnn_engines.select(
                graph, self.choice_key(description, limit), limit,
                (lambda graph, engines: self.time_engines(graph, tensors, engines)) if timed else None)
            return CudnnGraph(graph, tensors, self.handle, engine, seconds, chosen)
        except Exception as e:  # cudnnGraphNotSupportedError, or a lowering the library rejects
            self.refusals[f"{description} (workspace limit {limit})"] = f"{type(e).__name__}: {e}"
            return None

    def time_engines(self, graph, tensors, engines):
        """The best seconds of each of `engines` (cudnn_engines.Engine) of `graph` over
        cudnn_engines.ROUNDS calls after an untimed one, each call between two CUDA events on
        a stream of its own, on device buffers of the graph's shapes (every value 0.5) and a
        workspace for the largest need, from a memory pool of their own that is emptied
        after; an engine that fails to run takes forever (never selected); None when the
        device has no memory to spare for them."""

        def measure(cupy, stream):
            self.cudnn.set_stream(self.handle, stream.ptr)
            try:
                return self._time_on(cupy, stream, graph, tensors, engines)
            finally:
                self.cudnn.set_stream(self.handle, self.stream_ptr)

        return on_own_pool(measure)

    def _time_on(self, cupy, stream, graph, tensors, engines):
        """time_engines' measurement, with the pool and stream current (its buffers are
        released when it returns)."""
        held, pack = [], {}
        for tensor in tensors.values():
            if tensor.get_is_pass_by_value():  # host scalars (BatchNorm's epsilon and momentum)
                held.append(np.full(1, 0.5, np.float32))
                pack[tensor.uid] = held[-1].ctypes.data
            else:
                held.append(cupy.full(numel(tensor.get_dim()), 0.5, np.float32))
                pack[tensor.uid] = held[-1].data.ptr
        need = max(engine.workspace_bytes for engine in engines)
        held.append(cupy.empty(need, np.uint8) if need else None)
        workspace = held[-1].data.ptr if need else None
        seconds = []
        for engine in engines:
            try:
                seconds.append(best_seconds(stream, lambda: graph.execute_plan_at_index(
                    pack, workspace, index=engine.index, handle=self.handle), cudnn_engines.ROUNDS))
            except Exception as e:  # the library's error for this engine: it is not chosen
                self.refusals[f"timing {engine.name}"] = f"{type(e).__name__}: {e}"
                seconds.append(math.inf)
        return seconds


class KernelsInstead:
    """A layer's CUDA kernels (a cuDNN kernel's fallback) as the alternative to one phase's
    cuDNN graph (cudnn_engines.faster): their workspace, and `time()`, the best seconds of
    that phase on temporary device buffers of the layer's shapes (every value 0.5; the
    backward after one forward, for its statistics), from a memory pool of their own."""

    name = "cuda"

    def __init__(self, kernel, in_shapes, phase):
        self.kernel, self.in_shapes, self.phase = kernel, in_shapes, phase
        self.workspace_bytes = kernel.own_workspace_bytes(in_shapes, phase)
        self.seconds, self.chosen = None, cudnn_engines.FIRST

    def time(self):
        return on_own_pool(self._time_on)

    def _time_on(self, cupy, stream):
        layer, in_shapes, kernel = self.kernel.layer, self.in_shapes, self.kernel

        def filled(specs):
            return {name: cupy.full(spec.shape, 0.5, np.float32) for name, spec in specs.items()}

        xs = [cupy.full(shape, 0.5, np.float32) for shape in in_shapes]
        params, state, aux = filled(layer.param_specs(in_shapes)), filled(layer.state_specs(in_shapes)), \
            filled(layer.aux_specs(in_shapes))
        y = cupy.empty(layer.infer_shape(in_shapes), np.float32)
        workspace = cupy.empty(max(kernel.own_workspace_bytes(in_shapes, phase) for phase in (FORWARD, BACKWARD)),
                               np.uint8)

        def context():
            return KernelContext(cupy, training=True, workspace=workspace if workspace.size else None)

        kernel.forward(context(), xs, params, state, y, aux, recompute=True)
        if self.phase == FORWARD:
            return best_seconds(stream, lambda: kernel.forward(context(), xs, params, state, y, aux, recompute=True),
                                cudnn_engines.ROUNDS)
        gy, gxs, gparams = cupy.full(y.shape, 0.5, np.float32), [cupy.empty_like(x) for x in xs], \
            {name: cupy.empty_like(p) for name, p in params.items()}
        return best_seconds(stream, lambda: kernel.backward(context(), gy, Saved(tuple(xs), y), params, aux, gxs,
                                                            gparams), cudnn_engines.ROUNDS)


def _workspace(ctx):
    """(capacity in bytes, address) of the step's workspace."""
    if ctx.workspace is None:
        return 0, 0
    return ctx.workspace.nbytes, device_pointer(ctx.workspace)


class _CudnnKernel(Float32Kernel):
    """Graph caching shared by the cuDNN kernels: one graph per (operation, workspace limit),
    or the `alternative` of that operation where it was timed faster (cudnn_engines.faster)."""

    name = "cudnn"
    describe = None  # describe_conv or describe_batchnorm
    OPS = {}  # phase -> the operations (describe's `op`) it runs, in order

    def __init__(self, layer, in_shapes, kernels, fallback, spec):
        super().__init__(layer, in_shapes, kernels.module)
        self.kernels, self.fallback, self.spec = kernels, fallback, spec
        self._graphs = {}  # (op, limit) -> CudnnGraph, or None where cuDNN refused
        self._chosen = {}  # (op, limit) -> the graph or its alternative, whichever runs the operation

    @property
    def context(self):
        return self.kernels.cudnn

    def alternative(self, op, limit):
        """What else could run `op` within `limit` workspace bytes (None: nothing)."""
        return None

    def graph(self, op, limit, timed=False):
        """What runs `op` under workspace `limit`: its cuDNN graph (built on first use, its
        engines `timed` if so: CudnnContext.build) or the alternative timed faster; None when
        cuDNN refused."""
        built = self._cudnn_graph(op, limit, timed)
        if built is None or cudnn_engines.setting() == "heuristic":
            return built
        key = (op, limit)
        if key not in self._chosen:
            other = self.alternative(op, limit)
            self._chosen[key] = built if other is None else cudnn_engines.faster(
                built, other, self.context.choice_key(f"{self.layer.type_name} {op} {self.spec} | {other.name}", limit),
                timed)
        return self._chosen[key]

    def _cudnn_graph(self, op, limit, timed):
        key = (op, limit)
        if key not in self._graphs and max(numel(dims) for dims in self.spec.dims) > CUDNN_MAX_ELEMENTS:
            self.context.refusals[f"{self.layer.type_name} {self.spec}"] = (
                f"a tensor of more than {CUDNN_MAX_ELEMENTS} elements: not handed to cuDNN")
            self._graphs[key] = None
        if key not in self._graphs:
            describe = type(self).describe
            self._graphs[key] = self.context.build(
                f"{self.layer.type_name} {op} {self.spec}",
                lambda cudnn, handle: describe(cudnn, self.spec, op, handle), limit, timed)
        return self._graphs[key]

    def measured_seconds(self, phase):
        """The planned graphs' timed seconds for `phase` (OPS[phase] run one after another),
        or None when one of them was not timed or is not cuDNN's."""
        seconds = [getattr(self.graph(op, self.context.workspace_limit_bytes, timed=True), "seconds", None)
                   for op in self.OPS[phase]]
        return None if None in seconds else sum(seconds)

    def graphs(self):
        """What runs each operation built so far: a CudnnGraph, its alternative, or None where
        cuDNN refused."""
        return [self._chosen.get(key, graph) for key, graph in self._graphs.items()]

    def graph_within(self, op, capacity):
        """The planned graph when it fits `capacity` workspace bytes, else the fastest that does."""
        planned = self.graph(op, self.context.workspace_limit_bytes)
        if planned is not None and planned.workspace_bytes <= capacity:
            return planned
        return self.graph(op, capacity)


class CudnnConv2d(_CudnnKernel):
    """Conv2d by cuDNN conv_fprop / conv_dgrad / conv_wgrad, or for a pointwise convolution (1x1,
    any stride) each of them by cuBLAS GEMMs where those were timed faster
    (snrt/backends/cuda_pointwise.py);
    the bias by snrt_bias_add and snrt_channel_sum; whatever cuDNN refuses by the GEMM fallback."""

    describe = staticmethod(describe_conv)
    OPS = {FORWARD: ("fprop",), BACKWARD: ("dgrad", "wgrad")}  # the graphs a phase runs

    def __init__(self, layer, in_shapes, kernels, fallback):
        super().__init__(layer, in_shapes, kernels, fallback, conv_spec(layer, in_shapes))
        self.pointwise = cuda_pointwise.pointwise_shape(self.spec)

    def alternative(self, op, limit):
        """cuBLAS GEMMs for a pointwise convolution (cuda_pointwise.PointwiseGemm), where their
        workspace fits `limit`."""
        if self.pointwise is None:
            return None
        gemm = cuda_pointwise.PointwiseGemm(self.module, op, self.pointwise, limit)
        return gemm if limit is None or gemm.workspace_bytes <= limit else None

    def own_workspace_bytes(self, in_shapes, phase):
        limit = self.context.workspace_limit_bytes
        needs = []
        for op in self.OPS[phase]:
            built = self.graph(op, limit, timed=True)
            needs.append(built.workspace_bytes if built is not None else self.fallback.own_workspace_bytes(in_shapes, phase))
        return max(needs)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return XpKernel.forward(self, ctx, xs, params, state, y, aux, recompute)
        capacity, workspace = _workspace(ctx)
        built = self.graph_within("fprop", capacity)
        if built is None:
            return self.fallback.forward(ctx, xs, params, state, y, aux, recompute)
        built.execute({"x": device_pointer(x), "w": device_pointer(params["weight"]), "y": device_pointer(y)},
                      workspace)
        if self.layer.bias:
            o, plane = y.shape[1], numel(y.shape[2:])
            self.module.launch("snrt_bias_add", grid_for(y.size), (y, params["bias"], *int64_args(y.size, o, plane)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, gx = saved.xs[0], gxs[0]
        if not self.is_float32(x):
            return XpKernel.backward(self, ctx, gy, saved, params, aux, gxs, gparams)
        capacity, workspace = _workspace(ctx)
        wgrad = self.graph_within("wgrad", capacity)
        dgrad = self.graph_within("dgrad", capacity) if gx is not None else None
        if self.layer.bias:
            n, o = gy.shape[:2]
            self.module.launch("snrt_channel_sum", o, (gy, gparams["bias"], *int64_args(n, o, numel(gy.shape[2:]))))
        if wgrad is None or (gx is not None and dgrad is None):
            self.fallback.backward_parts(ctx, gy, x, gx if dgrad is None else None, params, gparams,
                                         weight_grad=wgrad is None, bias_grad=False)
        if wgrad is not None:
            wgrad.execute({"x": device_pointer(x), "dy": device_pointer(gy), "dw": device_pointer(gparams["weight"])},
                          workspace)
        if dgrad is not None:
            dgrad.execute({"dy": device_pointer(gy), "w": device_pointer(params["weight"]), "dx": device_pointer(gx)},
                          workspace)


class CudnnBatchNorm(_CudnnKernel):
    """BatchNorm training forward and backward by cuDNN, or by the CUDA kernels (CudaBatchNorm)
    where those were timed faster; eval, a backward without an input gradient, and what cuDNN
    refuses by the CUDA kernels.

    A recomputed forward runs the very graph of the first one (so y, mean and inv_std are
    bit for bit the same), with the running statistics it computes written to the front of
    the step's workspace and dropped; the graph's own workspace follows them."""

    describe = staticmethod(describe_batchnorm)
    OPS = {FORWARD: ("forward",), BACKWARD: ("backward",)}

    def __init__(self, layer, in_shapes, kernels, fallback):
        super().__init__(layer, in_shapes, kernels, fallback, batchnorm_spec(layer, in_shapes))
        self.in_shapes = in_shapes
        self._eps = np.full(1, layer.eps, np.float32)  # pass-by-value scalars live on the host
        self._momentum = np.full(1, layer.momentum, np.float32)
        self._dropped_bytes = scratch_bytes(2 * self.spec.channels * FLOAT32_BYTES, 0)  # aligned for what follows

    def alternative(self, op, limit):
        """The CUDA kernels (the fallback), where their workspace fits `limit`."""
        instead = KernelsInstead(self.fallback, self.in_shapes, FORWARD if op == "forward" else BACKWARD)
        return instead if limit is None or instead.workspace_bytes <= limit else None

    def own_workspace_bytes(self, in_shapes, phase):
        """The cuDNN graph's, or the CUDA kernels' where they run the phase (they also run eval,
        a backward without gx and what cuDNN refuses, so their few bytes are always kept)."""
        kernels = self.fallback.own_workspace_bytes(in_shapes, phase)
        built = self.graph("forward" if phase == FORWARD else "backward", self.context.workspace_limit_bytes, timed=True)
        if built is None or built.name != "cudnn":
            return kernels
        return max(kernels, (self._dropped_bytes if phase == FORWARD else 0) + built.workspace_bytes)

    def kernels_run(self, op):
        """True where the CUDA kernels (the fallback) run `op` in training: timed faster than
        cuDNN's graph, or cuDNN refused it."""
        planned = self.graph(op, self.context.workspace_limit_bytes)
        return planned is None or planned.name != "cudnn"

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x) or not ctx.training or self.kernels_run("forward"):
            return self.fallback.forward(ctx, xs, params, state, y, aux, recompute)
        self.layer.check_training([x.shape])
        capacity, workspace = _workspace(ctx)
        built = self.graph_within("forward", capacity - self._dropped_bytes) if capacity >= self._dropped_bytes else None
        if built is None:
            return self.fallback.forward(ctx, xs, params, state, y, aux, recompute)
        channel_bytes = self.spec.channels * FLOAT32_BYTES
        next_mean, next_var = ((workspace, workspace + channel_bytes) if recompute else
                               (device_pointer(state["running_mean"]), device_pointer(state["running_var"])))
        built.execute({"x": device_pointer(x), "scale": device_pointer(params["weight"]),
                       "bias": device_pointer(params["bias"]), "epsilon": self._eps.ctypes.data,
                       "momentum": self._momentum.ctypes.data, "y": device_pointer(y),
                       "mean": device_pointer(aux["mean"]), "inv_std": device_pointer(aux["inv_std"]),
                       "running_mean": device_pointer(state["running_mean"]),
                       "running_var": device_pointer(state["running_var"]),
                       "next_running_mean": next_mean, "next_running_var": next_var},
                      workspace + self._dropped_bytes)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, gx = saved.xs[0], gxs[0]
        if not self.is_float32(x) or not ctx.training or gx is None or self.kernels_run("backward"):
            return self.fallback.backward(ctx, gy, saved, params, aux, gxs, gparams)
        capacity, workspace = _workspace(ctx)
        built = self.graph_within("backward", capacity)
        if built is None:
            return self.fallback.backward(ctx, gy, saved, params, aux, gxs, gparams)
        built.execute({"dy": device_pointer(gy), "x": device_pointer(x), "scale": device_pointer(params["weight"]),
                       "mean": device_pointer(aux["mean"]), "inv_std": device_pointer(aux["inv_std"]),
                       "dx": device_pointer(gx), "dscale": device_pointer(gparams["weight"]),
                       "dbias": device_pointer(gparams["bias"])}, workspace)

