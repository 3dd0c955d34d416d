"""The registry that picks a kernel per (layer, input shapes) for the CUDA backend.

`REGISTRY` maps a layer type to the factory of its kernel: cuDNN frontend graphs for Conv2d
and BatchNorm (snrt/backends/cudnn_graphs.py) with the CUDA kernels as their fallback, the
CUDA kernels (snrt/backends/cuda_layers.py) for the other layers whose `xp` code allocates,
BatchNormReLU as BatchNorm's kernel then ReLU's forward and one masked BatchNorm backward
(CudaReLUAfter), AddReLU as Add's kernels then ReLU's (AddThenReLU: its one-pass backward
writes over gy where the plan lets it), and the layer's own `xp` code for the rest. `CudaKernels` is the kernel
choice the CUDA backend plans and runs with. Importing this module does not import CuPy.
"""

import gc

from snrt.backends.cuda_layers import (CublasLinear, CudaAdd, CudaAvgPool, CudaBatchNorm, CudaConvTranspose2d,
                                       CudaDropout, CudaMaxPool, CudaReLU, CudaSoftmaxCrossEntropy, CudaUpsample,
                                       GemmConv2d, XpKernel)
from snrt.backends.cuda_source import KernelModule
from snrt.backends.cudnn_graphs import CudnnBatchNorm, CudnnContext, CudnnConv2d
from snrt.layers.base import BACKWARD, FLOAT32_BYTES
from snrt.layers.fused import RELU, AddThenReLU, ReLUAfter
from snrt.layers.join import Add
from snrt.layers.staging import fp32_kernel_workspace_bytes


def _cudnn_conv(layer, in_shapes, kernels):
    fallback = GemmConv2d(layer, in_shapes, kernels.module)
    return CudnnConv2d(layer, in_shapes, kernels, fallback) if kernels.use_cudnn else fallback


def _cudnn_batchnorm(layer, in_shapes, kernels):
    """cuDNN's BatchNorm needs a scale and a bias: without an affine part, the CUDA kernel."""
    fallback = CudaBatchNorm(layer, in_shapes, kernels.module)
    return CudnnBatchNorm(layer, in_shapes, kernels, fallback) if kernels.use_cudnn and layer.affine else fallback


def _upsample(layer, in_shapes, kernels):
    """Bilinear by cuBLAS; nearest is slicing, the layer's own xp code."""
    return XpKernel(layer, in_shapes) if uses_xp_code(layer) else CudaUpsample(layer, in_shapes, kernels.module)


def _add_relu(layer, in_shapes, kernels):
    """AddReLU: the kernels an Add and a ReLU of these shapes run, composed (snrt/layers/fused.py)."""
    return AddThenReLU(layer, kernels.kernel_for(Add(), in_shapes), kernels.kernel_for(RELU, in_shapes[:1]))


def _plain(kernel_class):
    return lambda layer, in_shapes, kernels: kernel_class(layer, in_shapes, kernels.module)


class CudaReLUAfter(ReLUAfter):
    """BatchNormReLU (snrt/layers/fused.py) on CUDA. Forward: the kernel of BatchNorm (the one
    an unfused node of that shape runs, cuDNN's or the CUDA kernels), then ReLU's in place; where
    that is the CUDA kernels, in float32 training, the ReLU inside their normalizing pass.
    Backward, in float32: BatchNorm's two CUDA passes with the ReLU's mask inside (the output
    computed again from x; the mask may differ from the forward's where cuDNN's arithmetic
    rounded an output across 0), so no output-sized scratch; else the layer's composition.
    Named "<BatchNorm kernel's name>+relu"; not timed as a whole (the cost model's rates time
    the step)."""

    def __init__(self, layer, in_shapes, kernels):
        super().__init__(layer, kernels.kernel_for(layer.first, in_shapes), kernels.kernel_for(RELU, in_shapes[:1]))
        self.name = f"{self.first.name}+relu"
        self.masked = CudaBatchNorm(layer.first, in_shapes, kernels.module)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if phase == BACKWARD and itemsize == FLOAT32_BYTES:
            return self.masked.own_workspace_bytes(in_shapes, phase)
        return super().workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        """Where BatchNorm's training forward runs on the CUDA kernels (not cuDNN's graph), the
        ReLU inside its normalizing pass; else BatchNorm's kernel, then ReLU's in place."""
        runs = getattr(self.first, "kernels_run", None)
        if self.masked.is_float32(xs[0]) and ctx.training and runs is not None and runs("forward"):
            return self.masked.forward(ctx, xs, params, state, y, aux, recompute, relu=True)
        super().forward(ctx, xs, params, state, y, aux, recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        if not self.masked.is_float32(gy):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        if gxs[0] is not None or gparams:
            self.masked.backward(ctx, gy, saved, params, aux, gxs, gparams, relu=True)

    def measured_seconds(self, phase):
        return None


# what may run a cuDNN graph's operation instead (cudnn_engines.faster), by name
ALTERNATIVES = {"cublas": "cuBLAS GEMMs", "cuda": "CUDA kernels"}

# layer type -> factory(layer, in_shapes, CudaKernels) -> kernel; other layers: XpKernel
REGISTRY = {
    "Conv2d": _cudnn_conv,
    "ConvTranspose2d": _plain(CudaConvTranspose2d),
    "BatchNorm": _cudnn_batchnorm,
    "Linear": _plain(CublasLinear),
    "SoftmaxCrossEntropy": _plain(CudaSoftmaxCrossEntropy),
    "Dropout": _plain(CudaDropout),
    "Dropout2d": _plain(CudaDropout),
    "AvgPool": _plain(CudaAvgPool),
    "MaxPool": _plain(CudaMaxPool),
    "ReLU": _plain(CudaReLU),
    "Add": _plain(CudaAdd),
    "Upsample": _upsample,
    "BatchNormReLU": CudaReLUAfter,
    "AddReLU": _add_relu,
}


def uses_xp_code(layer):
    """True when the CUDA backend runs `layer`'s shared xp code (which must then allocate
    nothing: tests/backends/test_xp_allocation.py): the layers without a kernel here, and
    nearest Upsample."""
    return layer.type_name not in REGISTRY or (layer.type_name == "Upsample" and layer.mode == "nearest")


class CudaKernels:
    """The kernel of every (layer, input shapes) on the current CUDA device, chosen once and
    cached, so the plan (through `workspace_bytes`) and the run use the same kernel.

    `use_cudnn` False uses the CUDA kernels (cuda_layers) for Conv2d and BatchNorm too;
    `workspace_limit_bytes` bounds the cuDNN engines considered at plan time (the fastest
    that fits is kept); `allow_tf32` (the tf32 precision) admits cuDNN's TF32 tensor-core
    engines for float32 and has cuBLAS compute in TF32; `deterministic` False admits cuDNN's
    non-deterministic engines too.
    """

    def __init__(self, use_cudnn=True, workspace_limit_bytes=None, allow_tf32=False, deterministic=True):
        self.use_cudnn, self.workspace_limit_bytes, self.allow_tf32 = use_cudnn, workspace_limit_bytes, allow_tf32
        self.deterministic = deterministic
        self._module = None
        self._cudnn = None
        self._stream = None
        self._kernels = {}

    @property
    def module(self):
        if self._module is None:
            self._module = KernelModule(tf32=self.allow_tf32)
        return self._module

    @property
    def cudnn(self):
        """The cuDNN frontend context (handle, graph building), created on first use."""
        if self._cudnn is None:
            self._cudnn = CudnnContext(self.workspace_limit_bytes, self.allow_tf32, self.deterministic)
            if self._stream is not None:
                self._cudnn.set_stream(self._stream)
        return self._cudnn

    def kernel_for(self, layer, in_shapes):
        """The kernel that runs `layer` at `in_shapes` (full shapes, batch first)."""
        key = (layer, tuple(tuple(s) for s in in_shapes))
        kernel = self._kernels.get(key)
        if kernel is None:
            factory = REGISTRY.get(layer.type_name)
            kernel = factory(layer, key[1], self) if factory else XpKernel(layer, key[1])
            self._kernels[key] = kernel
        return kernel

    def workspace_bytes(self, layer, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """What the planner should reserve for `layer`'s kernel (the planner hook): its fp32
        workspace, after the fp32 staging of 2-byte tensors (the kernels compute in fp32 on
        staged copies, snrt/layers/staging.py, as the CPU's do)."""
        return fp32_kernel_workspace_bytes(self.kernel_for(layer, in_shapes), layer, in_shapes, phase, itemsize)

    def measured_seconds(self, layer, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """The seconds `phase` of `layer`'s kernel was timed to take (its cuDNN engines'),
        or None (not timed, or 2-byte tensors, which run other code)."""
        return self.kernel_for(layer, in_shapes).measured_seconds(phase) if itemsize == FLOAT32_BYTES else None

    def update_workspace_bytes(self, param_bytes):
        """None: every update is one kernel (snrt_sgd_step, snrt_adam_step)."""
        return 0

    def set_stream(self, stream):
        """cuDNN runs on `stream` (the backend's compute stream; CUDA kernels and cuBLAS
        take the current stream, which the backend makes that one)."""
        self._stream = stream
        if self._cudnn is not None:
            self._cudnn.set_stream(stream)

    def release(self):
        """Drop every kernel and cuDNN graph and destroy the cuDNN handle, so that no library
        object outlives the backend (or the interpreter); a later `kernel_for` starts afresh."""
        self._kernels.clear()
        if self._cudnn is not None:
            gc.collect()  # the graphs, their tensors and plans go before the handle they were built on
            self._cudnn.close()
            self._cudnn = None

    def describe(self):
        """'cuDNN: G graphs, T on engines timed now, K kept from before (FILE), F on cuDNN's
        first; run instead, where timed faster: P by cuBLAS GEMMs, B by CUDA kernels; R refused
        (the CUDA kernels run them)', of the graphs built so far ('' when none): what the
        engine choice came to."""
        from snrt.backends import choice_file, cudnn_engines

        graphs = [graph for kernel in self._kernels.values() if kernel.name == "cudnn" for graph in kernel.graphs()]
        if not graphs:
            return ""
        built = [graph for graph in graphs if graph is not None]
        counts = [f"{sum(graph.chosen == how for graph in built)} {how}" for how in
                  (cudnn_engines.TIMED, cudnn_engines.KEPT, cudnn_engines.FIRST)]
        setting = cudnn_engines.setting()
        where = (choice_file.cache_path(cudnn_engines.CACHE_FILE) if setting == "measure"
                 else f"{cudnn_engines.VARIABLE}={setting}")
        refused = len(graphs) - len(built)
        instead = [f"{sum(graph.name == name for graph in built)} by {label}" for name, label in ALTERNATIVES.items()
                   if any(graph.name == name for graph in built)]
        return (f"cuDNN: {len(built)} graphs, engines {', '.join(counts)} ({where})"
                + (f"; run instead, where timed faster: {', '.join(instead)}" if instead else "")
                + (f"; {refused} refused (the CUDA kernels run them)" if refused else ""))

    def summary(self):
        """{kernel name: count} over the kernels chosen so far (e.g. {"cudnn": 53, "xp": 120})."""
        counts = {}
        for kernel in self._kernels.values():
            counts[kernel.name] = counts.get(kernel.name, 0) + 1
        return counts


__all__ = ["REGISTRY", "CudaKernels", "uses_xp_code"]
