"""CUDA kernels for the layers whose generic `xp` code allocates on CuPy, and the registry
that picks a kernel per (layer, input shapes) for the CUDA backend.

Why these layers. The generic kernels in snrt/layers are written against `xp` and run on
CuPy unchanged, but some of them create temporaries that CuPy takes from its own memory
pool, outside the planned arena (see `NUMPY_ONLY` for the list and the reason per layer).
On CUDA those layers get a kernel here that uses only its buffers and the planned
workspace, so the backend's allocation guard (snrt/backends/cupy_backend.py) can refuse
every other allocation while kernels run. The other layers (ReLU, LeakyReLU, Sigmoid, Tanh,
Add, Concat, Flatten, MaxPool, GlobalAvgPool, LRN) and the optimizer run their shared `xp`
code on CuPy: the CPU tests exercise the same logic.

A kernel here is "layer-like": it has the layer's `forward`, `backward` and
`workspace_bytes` signatures and delegates everything else to the layer. Each one fits in
the workspace the NumPy layer plans (Dropout, SoftmaxCrossEntropy, AvgPool and the
BatchNorm/Linear kernels need none; the GEMM convolution cuts its column matrix into bands
of output rows that fit whatever the plan gave), so existing plans run as they are, and
`workspace_bytes` says what each would like when the planner asks the backend
(`CudaKernels.workspace_bytes`).

Everything is float32; a float64 plan runs the layers' own `xp` code. Dropout's mask and
AvgPool are bit-identical to the NumPy kernels (same integer hash, same summation order);
BatchNorm, the softmax and the GEMMs sum in a different order, so they agree to rounding.

The CUDA C source is one `extern "C"` module without headers, so it compiles with NVRTC on
a machine without a GPU (`compile_ptx`), which is what the static tests check. Importing
this module does not import CuPy.
"""

from dataclasses import dataclass

import numpy as np

from snrt.layers.base import FLOAT32_BYTES, numel
from snrt.layers.random import stream_key

# Layers whose generic xp kernel allocates on CuPy, and what allocates (checked by reading
# snrt/layers/*.py; none uses np.lib.stride_tricks, ufunc.at or np-only functions).
NUMPY_ONLY = {
    "BatchNorm": "einsum (no out=, allocates its result and operands), (C,)-sized temporaries "
                 "(var, scale, sum_gy, c1) from arithmetic on arrays",
    "Conv2d": "matmul with out= a non-contiguous view (CuPy computes into a temporary and copies)",
    "Linear": "matmul with a transposed operand may stage a contiguous copy",
    "SoftmaxCrossEntropy": "arange and fancy indexing (probs[rows, labels], gx[rows, labels] -= 1)",
    "Dropout": "arange of the whole tensor for the hash counters",
    "AvgPool": "the (Ho, Wo) divisor table from arange/minimum/maximum",
}
# CuPy's CUB reductions take temporary storage from the memory pool; the backend turns the
# CUB accelerator off while it runs so the shared xp reductions (GlobalAvgPool) allocate
# nothing. Elementwise ufuncs with out=, slicing, fill and copyto allocate nothing.

BLOCK = 256  # threads per block of every kernel below
MAX_GRID = 65535 * 32  # grid-stride loops cover the rest

KERNEL_SOURCE = r"""
// snrt CUDA kernels: float32, NCHW, sizes as long long. Every kernel writes only the buffers
// it is given; per-channel and per-row reductions run one block per channel (row). No
// headers: NVRTC compiles this without a CUDA toolkit or a device.

#define SNRT_NEG_INF __int_as_float(0xff800000)
// A grid-stride loop of i over [0, total).
#define SNRT_GRID_LOOP(i, total) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (total); i += (long long)gridDim.x * blockDim.x)

// snrt_block_sum / snrt_block_max: the block's total (maximum), returned to every thread
// (blockDim.x a multiple of 32, at most 1024), by warp shuffles and one shared slot per warp.
#define SNRT_BLOCK_REDUCE(NAME, COMBINE, IDENTITY)                                                      \
__device__ __forceinline__ float NAME##_warp(float v) {                                                 \
    for (int offset = 16; offset > 0; offset >>= 1) v = COMBINE(v, __shfl_down_sync(0xffffffffu, v, offset)); \
    return v;                                                                                           \
}                                                                                                       \
__device__ float NAME(float v) {                                                                        \
    __shared__ float partial[32];                                                                       \
    __shared__ float total;                                                                             \
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;               \
    v = NAME##_warp(v);                                                                                 \
    if (lane == 0) partial[warp] = v;                                                                   \
    __syncthreads();                                                                                    \
    if (warp == 0) {                                                                                    \
        float t = NAME##_warp(lane < warps ? partial[lane] : (IDENTITY));                              \
        if (lane == 0) total = t;                                                                       \
    }                                                                                                   \
    __syncthreads();                                                                                    \
    float result = total;                                                                               \
    __syncthreads(); /* partial and total are reused by the next call */                               \
    return result;                                                                                      \
}

__device__ __forceinline__ float snrt_add(float a, float b) { return a + b; }
SNRT_BLOCK_REDUCE(snrt_block_sum, snrt_add, 0.0f)
SNRT_BLOCK_REDUCE(snrt_block_max, fmaxf, SNRT_NEG_INF)

// out[ch] = sum over n and hw of x[n, ch, hw]   (bias gradients; Linear: hw = 1)
extern "C" __global__ void snrt_channel_sum(const float* x, float* out, long long n, long long c, long long hw) {
    long long ch = blockIdx.x, count = n * hw;
    float acc = 0.0f;
    for (long long k = threadIdx.x; k < count; k += blockDim.x) acc += x[((k / hw) * c + ch) * hw + k % hw];
    acc = snrt_block_sum(acc);
    if (threadIdx.x == 0) out[ch] = acc;
}

// y[n, ch, hw] += b[ch]
extern "C" __global__ void snrt_bias_add(float* y, const float* b, long long total, long long c, long long hw) {
    SNRT_GRID_LOOP(i, total)
        y[i] += b[(i / hw) % c];
}

// BatchNorm training forward, one block per channel: batch mean and biased variance (two
// passes, like the NumPy kernel), aux mean and inv_std = 1/sqrt(var + eps), the running
// statistics (unless recomputing), and y = (x - mean) * (weight * inv_std) + bias.
// keep = 1 - momentum and unbias = M/(M-1) come from the host in float32, as NumPy rounds them.
extern "C" __global__ void snrt_bn_forward_train(
        const float* x, float* y, const float* weight, const float* bias, float* mean, float* inv_std,
        float* running_mean, float* running_var, long long n, long long c, long long hw,
        float eps, float momentum, float keep, float unbias, int update_running) {
    long long ch = blockIdx.x, count = n * hw;
    float acc = 0.0f;
    for (long long k = threadIdx.x; k < count; k += blockDim.x) acc += x[((k / hw) * c + ch) * hw + k % hw];
    float m = __fmul_rn(snrt_block_sum(acc), (float)(1.0 / (double)count));
    acc = 0.0f;
    for (long long k = threadIdx.x; k < count; k += blockDim.x) {
        float d = __fsub_rn(x[((k / hw) * c + ch) * hw + k % hw], m);
        acc = __fadd_rn(acc, __fmul_rn(d, d));
    }
    float var = snrt_block_sum(acc) / (float)count;
    float inv = 1.0f / sqrtf(__fadd_rn(var, eps));
    if (threadIdx.x == 0) {
        mean[ch] = m;
        inv_std[ch] = inv;
        if (update_running) {
            running_mean[ch] = __fadd_rn(__fmul_rn(running_mean[ch], keep), __fmul_rn(momentum, m));
            running_var[ch] = __fadd_rn(__fmul_rn(running_var[ch], keep), __fmul_rn(momentum, __fmul_rn(var, unbias)));
        }
    }
    float scale = __fmul_rn(weight[ch], inv), shift = bias[ch];
    for (long long k = threadIdx.x; k < count; k += blockDim.x) {
        long long i = ((k / hw) * c + ch) * hw + k % hw;
        y[i] = __fadd_rn(__fmul_rn(__fsub_rn(x[i], m), scale), shift);
    }
}

// BatchNorm eval forward: running statistics; aux mean and inv_std are written by ch < c.
extern "C" __global__ void snrt_bn_forward_eval(
        const float* x, float* y, const float* weight, const float* bias, const float* running_mean,
        const float* running_var, float* mean, float* inv_std, long long total, long long c, long long hw, float eps) {
    SNRT_GRID_LOOP(i, total) {
        long long ch = (i / hw) % c;
        float inv = 1.0f / sqrtf(__fadd_rn(running_var[ch], eps));
        float scale = __fmul_rn(weight[ch], inv);
        float shift = __fsub_rn(bias[ch], __fmul_rn(running_mean[ch], scale));
        y[i] = __fadd_rn(__fmul_rn(x[i], scale), shift);
        if (i < c) {
            mean[i] = running_mean[i];
            inv_std[i] = 1.0f / sqrtf(__fadd_rn(running_var[i], eps));
        }
    }
}

// BatchNorm backward, one block per channel (gx may be null):
// gweight = sum(gy * xhat), gbias = sum(gy); training:
// gx = weight*inv_std * (gy + x*c1 + c0), c1 = -inv_std*sum(gy*xhat)/M, c0 = -mean*c1 - sum(gy)/M;
// eval: gx = weight*inv_std * gy.
extern "C" __global__ void snrt_bn_backward(
        const float* x, const float* gy, const float* weight, const float* mean, const float* inv_std,
        float* gx, float* gweight, float* gbias, long long n, long long c, long long hw, int training) {
    long long ch = blockIdx.x, count = n * hw;
    float acc_gy = 0.0f, acc_dot = 0.0f;
    for (long long k = threadIdx.x; k < count; k += blockDim.x) {
        long long i = ((k / hw) * c + ch) * hw + k % hw;
        acc_gy += gy[i];
        acc_dot += gy[i] * x[i];
    }
    float sum_gy = snrt_block_sum(acc_gy);
    float dot = snrt_block_sum(acc_dot);
    float m = mean[ch], inv = inv_std[ch];
    float sum_gy_xhat = __fmul_rn(__fsub_rn(dot, __fmul_rn(m, sum_gy)), inv);
    if (threadIdx.x == 0) {
        gweight[ch] = sum_gy_xhat;
        gbias[ch] = sum_gy;
    }
    if (gx == 0) return;
    float scale = __fmul_rn(weight[ch], inv);
    float c1 = __fdiv_rn(__fmul_rn(-inv, sum_gy_xhat), (float)count);
    float c0 = __fsub_rn(__fmul_rn(-m, c1), __fdiv_rn(sum_gy, (float)count));
    for (long long k = threadIdx.x; k < count; k += blockDim.x) {
        long long i = ((k / hw) * c + ch) * hw + k % hw;
        gx[i] = training ? __fmul_rn(__fadd_rn(__fadd_rn(__fmul_rn(x[i], c1), c0), gy[i]), scale)
                         : __fmul_rn(gy[i], scale);
    }
}

// Softmax cross-entropy, one block per row: probs = softmax(x), loss = logsumexp(x) - x[label].
#define SNRT_XENT(SUFFIX, LABEL)                                                                        \
extern "C" __global__ void snrt_xent_forward_##SUFFIX(                                                  \
        const float* logits, const LABEL* labels, float* probs, float* loss, long long n, long long k) { \
    long long row = blockIdx.x;                                                                         \
    const float* x = logits + row * k;                                                                  \
    float* p = probs + row * k;                                                                         \
    float top = SNRT_NEG_INF;                                                                              \
    for (long long j = threadIdx.x; j < k; j += blockDim.x) top = fmaxf(top, x[j]);                     \
    top = snrt_block_max(top);                                                                          \
    float acc = 0.0f;                                                                                   \
    for (long long j = threadIdx.x; j < k; j += blockDim.x) {                                           \
        float e = expf(__fsub_rn(x[j], top));                                                           \
        p[j] = e;                                                                                       \
        acc += e;                                                                                       \
    }                                                                                                   \
    float total = snrt_block_sum(acc);                                                                  \
    for (long long j = threadIdx.x; j < k; j += blockDim.x) p[j] = p[j] / total;                        \
    if (threadIdx.x == 0) loss[row] = __fadd_rn(-__fsub_rn(x[labels[row]], top), logf(total));         \
}                                                                                                       \
extern "C" __global__ void snrt_xent_backward_##SUFFIX(                                                 \
        const float* probs, const LABEL* labels, const float* gy, float* gx, long long n, long long k) { \
    SNRT_GRID_LOOP(i, n * k) {                                                                          \
        long long row = i / k, j = i % k;                                                               \
        float g = probs[i];                                                                             \
        if (j == (long long)labels[row]) g = __fsub_rn(g, 1.0f);                                        \
        gx[i] = __fmul_rn(g, gy[row]);                                                                  \
    }                                                                                                   \
}
SNRT_XENT(i32, int)
SNRT_XENT(i64, long long)

// Dropout: the counter-based hash of snrt/layers/random.py (murmur3 finaliser of
// i * 0x9E3779B1 + key, uint32 arithmetic), y = ((h >= threshold) * scale) * x.
extern "C" __global__ void snrt_dropout(const float* x, float* y, long long total, unsigned int key,
                                         unsigned int threshold, float scale) {
    SNRT_GRID_LOOP(i, total) {
        unsigned int h = (unsigned int)i * 0x9E3779B1u + key;
        h ^= h >> 16; h *= 0x85EBCA6Bu;
        h ^= h >> 13; h *= 0xC2B2AE35u;
        h ^= h >> 16;
        float mask = h >= threshold ? 1.0f : 0.0f;
        y[i] = __fmul_rn(__fmul_rn(mask, scale), x[i]);
    }
}

// The number of window elements AvgPool divides by, along one axis.
__device__ __forceinline__ long long snrt_window(long long o, long long size, long long k, long long s, long long p,
                                                  int include_pad) {
    long long start = o * s - p, end = min(start + k, size + p);
    if (include_pad) return end - start;
    return min(end, size) - max(start, 0LL);
}

// AvgPool forward, one thread per output: taps summed in (i, j) order, then * 1/divisor.
extern "C" __global__ void snrt_avgpool_forward(
        const float* x, float* y, long long nc, long long h, long long w, long long ho, long long wo,
        long long kh, long long kw, long long sh, long long sw, long long ph, long long pw, int include_pad) {
    long long total = nc * ho * wo;
    SNRT_GRID_LOOP(i, total) {
        long long ow = i % wo, oh = (i / wo) % ho, plane = i / (wo * ho);
        const float* src = x + plane * h * w;
        float acc = 0.0f;
        for (long long a = 0; a < kh; ++a) {
            long long r = oh * sh - ph + a;
            if (r < 0 || r >= h) continue;
            for (long long b = 0; b < kw; ++b) {
                long long q = ow * sw - pw + b;
                if (q >= 0 && q < w) acc += src[r * w + q];
            }
        }
        double divisor = (double)(snrt_window(oh, h, kh, sh, ph, include_pad) * snrt_window(ow, w, kw, sw, pw, include_pad));
        y[i] = __fmul_rn(acc, (float)(1.0 / divisor));
    }
}

// AvgPool backward, one thread per input element: gy/divisor gathered in (i, j) order.
extern "C" __global__ void snrt_avgpool_backward(
        const float* gy, float* gx, long long nc, long long h, long long w, long long ho, long long wo,
        long long kh, long long kw, long long sh, long long sw, long long ph, long long pw, int include_pad) {
    long long total = nc * h * w;
    SNRT_GRID_LOOP(i, total) {
        long long q = i % w, r = (i / w) % h, plane = i / (w * h);
        const float* src = gy + plane * ho * wo;
        float acc = 0.0f;
        for (long long a = 0; a < kh; ++a) {
            long long top = r + ph - a;
            if (top < 0 || top % sh) continue;
            long long oh = top / sh;
            if (oh >= ho) continue;
            for (long long b = 0; b < kw; ++b) {
                long long left = q + pw - b;
                if (left < 0 || left % sw) continue;
                long long ow = left / sw;
                if (ow >= wo) continue;
                double divisor = (double)(snrt_window(oh, h, kh, sh, ph, include_pad) * snrt_window(ow, w, kw, sw, pw, include_pad));
                acc += __fmul_rn(src[oh * wo + ow], (float)(1.0 / divisor));
            }
        }
        gx[i] = acc;
    }
}

// im2col for one sample and output rows [r0, r0 + rows): col (C*kh*kw, rows*Wo), rows of
// col ordered (c, i, j), columns (oh - r0, ow); zero where the window reads padding.
extern "C" __global__ void snrt_im2col(
        const float* x, float* col, long long c, long long h, long long w, long long wo,
        long long kh, long long kw, long long sh, long long sw, long long ph, long long pw,
        long long dh, long long dw, long long r0, long long rows) {
    long long columns = rows * wo, total = c * kh * kw * columns;
    SNRT_GRID_LOOP(i, total) {
        long long column = i % columns, row = i / columns;
        long long b = row % kw, a = (row / kw) % kh, ch = row / (kw * kh);
        long long oh = r0 + column / wo, ow = column % wo;
        long long r = oh * sh - ph + a * dh, q = ow * sw - pw + b * dw;
        col[i] = (r >= 0 && r < h && q >= 0 && q < w) ? x[(ch * h + r) * w + q] : 0.0f;
    }
}

// The adjoint of snrt_im2col for one band: gx[c, r, q] += sum of the band's column entries
// read from (r, q), for input rows [in0, in0 + in_rows) (the rows the band can touch).
extern "C" __global__ void snrt_col2im_add(
        const float* col, float* gx, long long c, long long h, long long w, long long wo,
        long long kh, long long kw, long long sh, long long sw, long long ph, long long pw,
        long long dh, long long dw, long long r0, long long rows, long long in0, long long in_rows) {
    long long columns = rows * wo, total = c * in_rows * w;
    SNRT_GRID_LOOP(i, total) {
        long long q = i % w, r = in0 + (i / w) % in_rows, ch = i / (w * in_rows);
        float acc = 0.0f;
        for (long long a = 0; a < kh; ++a) {
            long long top = r + ph - a * dh;
            if (top < 0 || top % sh) continue;
            long long oh = top / sh;
            if (oh < r0 || oh >= r0 + rows) continue;
            for (long long b = 0; b < kw; ++b) {
                long long left = q + pw - b * dw;
                if (left < 0 || left % sw) continue;
                long long ow = left / sw;
                if (ow >= wo) continue;
                acc += col[((ch * kh + a) * kw + b) * columns + (oh - r0) * wo + ow];
            }
        }
        gx[(ch * h + r) * w + q] += acc;
    }
}
"""

KERNEL_NAMES = (
    "snrt_channel_sum", "snrt_bias_add", "snrt_bn_forward_train", "snrt_bn_forward_eval", "snrt_bn_backward",
    "snrt_xent_forward_i32", "snrt_xent_backward_i32", "snrt_xent_forward_i64", "snrt_xent_backward_i64",
    "snrt_dropout", "snrt_avgpool_forward", "snrt_avgpool_backward", "snrt_im2col", "snrt_col2im_add",
)
NVRTC_OPTIONS = ("--std=c++14",)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message holds its log."""


def compile_ptx(source=KERNEL_SOURCE, arch="compute_80", options=NVRTC_OPTIONS):
    """PTX of `source` from NVRTC for virtual architecture `arch`. Needs the NVRTC library
    (the nvidia-cuda-nvrtc-cu12 wheel CuPy loads), not a GPU or a driver: CuPy's own
    `compile_using_nvrtc` and `RawModule.compile` ask the device for its architecture first."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, "snrt_kernels.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(program, (f"-arch={arch}", *options))
        except nvrtc.NVRTCError as e:
            raise CompileError(f"{e}\n{nvrtc.getProgramLog(program)}") from None
        return nvrtc.getPTX(program)
    finally:
        nvrtc.destroyProgram(program)


def grid_for(total):
    """Blocks of BLOCK threads for a grid-stride loop over `total` elements."""
    return max(1, min(MAX_GRID, -(-total // BLOCK)))


class KernelModule:
    """The compiled module on the current device (compiled on first use) and cuBLAS calls on
    the current stream."""

    def __init__(self):
        import cupy
        from cupy_backends.cuda.libs import cublas

        self.cupy, self.cublas = cupy, cublas
        self.module = cupy.RawModule(code=KERNEL_SOURCE, options=NVRTC_OPTIONS)
        self.functions = {}
        self._one = np.ones(1, np.float32)  # host scalars for cuBLAS (pointer mode host)
        self._zero = np.zeros(1, np.float32)

    def launch(self, name, blocks, args, threads=BLOCK):
        """Run kernel `name` on the current stream."""
        function = self.functions.get(name)
        if function is None:
            function = self.functions[name] = self.module.get_function(name)
        function((blocks,), (threads,), args)

    def gemm(self, trans_a, trans_b, m, n, k, a, lda, b, ldb, c, ldc, accumulate=False,
             batch=1, stride_a=0, stride_b=0, stride_c=0):
        """Row-major C (m x n) = op(A) @ op(B) (+ C when `accumulate`), pointers as ints,
        `batch` times with the given element strides. cuBLAS is column-major, so this
        computes C^T = op(B)^T op(A)^T: operands swap, transposes stay."""
        cublas, handle = self.cublas, self.cupy.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.cupy.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        op = {False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T}
        beta = self._one if accumulate else self._zero
        # strides are in elements, as cuBLAS counts them
        cublas.sgemmStridedBatched(handle, op[trans_b], op[trans_a], n, m, k, self._one.ctypes.data,
                                   b, ldb, stride_b, a, lda, stride_a, beta.ctypes.data,
                                   c, ldc, stride_c, batch)


def _ptr(array):
    """Device address of a CuPy array (its first element)."""
    return array.data.ptr


def _i64(*values):
    return tuple(np.int64(v) for v in values)


# ---- kernels -------------------------------------------------------------------------------

class XpKernel:
    """The layer's own xp code (shared with the CPU backend)."""

    name = "xp"

    def __init__(self, layer, in_shapes, module=None):
        self.layer = layer

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.layer.workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.layer.forward(ctx, xs, params, state, y, aux, recompute=recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        self.layer.backward(ctx, gy, saved, params, aux, gxs, gparams)


class _Float32Kernel(XpKernel):
    """Base of the CUDA kernels: float32 runs here, anything else on the layer's xp code."""

    def __init__(self, layer, in_shapes, module):
        super().__init__(layer, in_shapes)
        self.module = module

    def own_workspace_bytes(self, in_shapes, phase):
        return 0

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        if itemsize != FLOAT32_BYTES:
            return self.layer.workspace_bytes(in_shapes, phase, itemsize)
        return self.own_workspace_bytes(in_shapes, phase)

    @staticmethod
    def is_float32(array):
        return array.dtype == np.float32


class CudaBatchNorm(_Float32Kernel):
    """BatchNorm by snrt_bn_* (one block per channel); cuDNN's is in cudnn_graphs."""

    name = "cuda"

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        n, c = x.shape[:2]
        hw = numel(x.shape[2:])
        if ctx.training:
            self.layer.check_training([x.shape])
            count = n * hw
            momentum = self.layer.momentum
            self.module.launch("snrt_bn_forward_train", c, (
                x, y, params["weight"], params["bias"], aux["mean"], aux["inv_std"],
                state["running_mean"], state["running_var"], *_i64(n, c, hw), np.float32(self.layer.eps),
                np.float32(momentum), np.float32(1 - momentum), np.float32(count / (count - 1)),
                np.int32(0 if recompute else 1)))
        else:
            self.module.launch("snrt_bn_forward_eval", grid_for(x.size), (
                x, y, params["weight"], params["bias"], state["running_mean"], state["running_var"],
                aux["mean"], aux["inv_std"], *_i64(x.size, c, hw), np.float32(self.layer.eps)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        n, c = x.shape[:2]
        gx = gxs[0]
        self.module.launch("snrt_bn_backward", c, (
            x, gy, params["weight"], aux["mean"], aux["inv_std"], np.uint64(0) if gx is None else gx,
            gparams["weight"], gparams["bias"], *_i64(n, c, numel(x.shape[2:])), np.int32(bool(ctx.training))))


class CudaSoftmaxCrossEntropy(_Float32Kernel):
    """Loss and softmax by snrt_xent_* (one block per row); labels int32 or int64."""

    name = "cuda"

    @staticmethod
    def _suffix(labels):
        return {np.dtype(np.int32): "i32", np.dtype(np.int64): "i64"}.get(np.dtype(labels.dtype))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        logits, labels = xs
        suffix = self._suffix(labels)
        if not self.is_float32(logits) or suffix is None:
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        n, k = logits.shape
        self.module.launch(f"snrt_xent_forward_{suffix}", n, (logits, labels, aux["probs"], y, *_i64(n, k)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        labels, gx = saved.xs[1], gxs[0]
        suffix = self._suffix(labels)
        if gx is None:
            return
        if not self.is_float32(gx) or suffix is None:
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        n, k = gx.shape
        self.module.launch(f"snrt_xent_backward_{suffix}", grid_for(n * k),
                           (aux["probs"], labels, gy, gx, *_i64(n, k)))


class CudaDropout(_Float32Kernel):
    """Dropout by snrt_dropout: the same mask as the NumPy kernel, without workspace."""

    name = "cuda"

    def _apply(self, ctx, source, target):
        p = self.layer.p
        threshold = self.layer.threshold
        key = stream_key(ctx.seed, ctx.iteration, ctx.node_index)
        self.module.launch("snrt_dropout", grid_for(target.size), (
            source, target, np.int64(target.size), np.uint32(key), np.uint32(threshold), np.float32(1.0 / (1.0 - p))))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not self.is_float32(y) or not ctx.training or self.layer.p == 0:
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        self._apply(ctx, xs[0], y)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None or not self.is_float32(gx) or not ctx.training or self.layer.p == 0:
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self._apply(ctx, gy, gx)


class CudaAvgPool(_Float32Kernel):
    """AvgPool by snrt_avgpool_* (a gather per output / per input), no workspace."""

    name = "cuda"

    def _geometry(self, x_shape, y_shape):
        layer = self.layer
        n, c, h, w = x_shape
        return (*_i64(n * c, h, w, y_shape[2], y_shape[3], *layer.kernel, *layer.stride, *layer.padding),
                np.int32(bool(layer.count_include_pad)))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        self.module.launch("snrt_avgpool_forward", grid_for(y.size), (x, y, *self._geometry(x.shape, y.shape)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        if not self.is_float32(gx):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self.module.launch("snrt_avgpool_backward", grid_for(gx.size), (gy, gx, *self._geometry(gx.shape, gy.shape)))


class CublasLinear(_Float32Kernel):
    """Linear by cuBLAS SGEMM on the given buffers: y = x W^T + b, gx = gy W, gW = gy^T x."""

    name = "cublas"

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        n, o = y.shape
        i = x.size // n
        self.module.gemm(False, True, n, o, i, _ptr(x), i, _ptr(params["weight"]), i, _ptr(y), o)
        if self.layer.bias:
            self.module.launch("snrt_bias_add", grid_for(y.size), (y, params["bias"], *_i64(y.size, o, 1)))

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        n, o = gy.shape
        i = x.size // n
        if gxs[0] is not None:
            self.module.gemm(False, False, n, i, o, _ptr(gy), o, _ptr(params["weight"]), i, _ptr(gxs[0]), i)
        self.module.gemm(True, False, o, i, n, _ptr(gy), o, _ptr(x), i, _ptr(gparams["weight"]), i)
        if self.layer.bias:
            self.module.launch("snrt_channel_sum", o, (gy, gparams["bias"], *_i64(n, o, 1)))


GEMM_WORKSPACE_CAP_BYTES = 64 << 20  # the GEMM convolution's preferred column band, at most


@dataclass(frozen=True)
class ConvGeometry:
    """Sizes of one convolution, from the layer and its input shape."""

    n: int
    c: int
    h: int
    w: int
    o: int
    ho: int
    wo: int
    kh: int
    kw: int
    sh: int
    sw: int
    ph: int
    pw: int
    dh: int
    dw: int
    groups: int

    @staticmethod
    def of(layer, in_shapes):
        n, c, h, w = in_shapes[0]
        _, o, ho, wo = layer.infer_shape(in_shapes)
        return ConvGeometry(n, c, h, w, o, ho, wo, *layer.kernel, *layer.stride, *layer.padding,
                            *layer.dilation, layer.groups)

    @property
    def pointwise(self):
        return (self.kh, self.kw, self.sh, self.sw, self.ph, self.pw, self.dh, self.dw) == (1, 1, 1, 1, 0, 0, 1, 1)

    @property
    def col_rows(self):
        return self.c * self.kh * self.kw

    def band_rows(self, workspace_bytes):
        """Output rows per band whose column matrix fits `workspace_bytes` (all of them on
        the 1x1 path, which reads x in place)."""
        if self.pointwise:
            return self.ho
        return min(self.ho, workspace_bytes // (self.col_rows * self.wo * FLOAT32_BYTES))

    def preferred_workspace_bytes(self):
        """One sample's column matrix, capped at GEMM_WORKSPACE_CAP_BYTES in whole rows (at
        least one row, even when a row is larger)."""
        if self.pointwise:
            return 0
        row = self.col_rows * self.wo * FLOAT32_BYTES
        return min(self.ho, max(1, GEMM_WORKSPACE_CAP_BYTES // row)) * row

    def bands(self, workspace_bytes):
        rows = self.band_rows(workspace_bytes)
        if rows < 1:
            need = self.col_rows * self.wo * FLOAT32_BYTES
            raise RuntimeError(f"the GEMM convolution needs at least {need} workspace bytes (one output row "
                               f"of the column matrix), the plan gave {workspace_bytes}")
        return [(r0, min(rows, self.ho - r0)) for r0 in range(0, self.ho, rows)]

    def input_rows(self, r0, rows):
        """[in0, in0 + count) of input rows a band of output rows [r0, r0 + rows) reads."""
        lo = max(0, r0 * self.sh - self.ph)
        hi = min(self.h, (r0 + rows - 1) * self.sh - self.ph + (self.kh - 1) * self.dh + 1)
        return lo, max(0, hi - lo)


class GemmConv2d(_Float32Kernel):
    """Convolution by im2col + cuBLAS SGEMM, sample by sample in bands of output rows that
    fit the step's workspace (the fallback where cuDNN refuses a shape).

    Forward, per sample n, band, group g:  y[n, g][:, band] = W[g] @ col[g]  (written in place,
    ldc = Ho*Wo), then + b. Backward: gb = channel sums of gy; gW[g] += gy[n, g][:, band] @
    col[g]^T (beta 1 after the first band); gcol[g] = W[g]^T @ gy[n, g][:, band] over col, then
    col2im adds it into gx[n] (zeroed first). The 1x1 path reads x[n] / writes gx[n] directly.
    """

    name = "gemm"

    def own_workspace_bytes(self, in_shapes, phase):
        return ConvGeometry.of(self.layer, in_shapes).preferred_workspace_bytes()

    def _workspace(self, ctx, g):
        """(band list, column buffer or None) from the step's workspace."""
        capacity = 0 if ctx.workspace is None else ctx.workspace.nbytes
        bands = g.bands(capacity)
        if g.pointwise:
            return bands, None
        rows = max(rows for _, rows in bands)
        return bands, ctx.scratch((g.col_rows * rows * g.wo,), np.float32)

    def _im2col(self, g, x_ptr, col, r0, rows):
        self.module.launch("snrt_im2col", grid_for(g.col_rows * rows * g.wo), (
            np.uint64(x_ptr), col, *_i64(g.c, g.h, g.w, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw, g.dh, g.dw, r0, rows)))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        if not self.is_float32(x):
            return super().forward(ctx, xs, params, state, y, aux, recompute)
        g = ConvGeometry.of(self.layer, [x.shape])
        bands, col = self._workspace(ctx, g)
        og, cg = g.o // g.groups, g.c // g.groups
        kk, plane = g.kh * g.kw, g.ho * g.wo
        w_ptr, f = _ptr(params["weight"]), FLOAT32_BYTES
        for n in range(g.n):
            x_n, y_n = _ptr(x) + n * g.c * g.h * g.w * f, _ptr(y) + n * g.o * plane * f
            for r0, rows in bands:
                columns = rows * g.wo
                if col is not None:
                    self._im2col(g, x_n, col, r0, rows)
                for k in range(g.groups):
                    if col is None:  # 1x1: x[n, group] (Cg, H*W) is the column matrix
                        b, ldb = x_n + (k * cg * plane + r0 * g.wo) * f, plane
                    else:
                        b, ldb = _ptr(col) + k * cg * kk * columns * f, columns
                    self.module.gemm(False, False, og, columns, cg * kk, w_ptr + k * og * cg * kk * f, cg * kk,
                                     b, ldb, y_n + (k * og * plane + r0 * g.wo) * f, plane)
        if self.layer.bias:
            self.module.launch("snrt_bias_add", grid_for(y.size), (y, params["bias"], *_i64(y.size, g.o, plane)))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x = saved.xs[0]
        if not self.is_float32(x):
            return super().backward(ctx, gy, saved, params, aux, gxs, gparams)
        self.backward_parts(ctx, gy, x, gxs[0], params, gparams)

    def backward_parts(self, ctx, gy, x, gx, params, gparams, weight_grad=True, bias_grad=True):
        """The gradients asked for: gW when `weight_grad`, gb when `bias_grad` (and the layer
        has a bias), gx when `gx` is not None (cuDNN serves the rest)."""
        g = ConvGeometry.of(self.layer, [x.shape])
        og, cg = g.o // g.groups, g.c // g.groups
        kk, plane, f = g.kh * g.kw, g.ho * g.wo, FLOAT32_BYTES
        if bias_grad and self.layer.bias:
            self.module.launch("snrt_channel_sum", g.o, (gy, gparams["bias"], *_i64(g.n, g.o, plane)))
        if not weight_grad and gx is None:
            return
        bands, col = self._workspace(ctx, g)
        if gx is not None and col is not None:
            gx.fill(0)
        w_ptr, gw_ptr = _ptr(params["weight"]), _ptr(gparams["weight"])
        first = True
        for n in range(g.n):
            x_n, gy_n = _ptr(x) + n * g.c * g.h * g.w * f, _ptr(gy) + n * g.o * plane * f
            for r0, rows in bands:
                columns = rows * g.wo
                if col is not None and weight_grad:  # gx alone overwrites col with the column gradient
                    self._im2col(g, x_n, col, r0, rows)
                for k in range(g.groups):
                    gy_band = gy_n + (k * og * plane + r0 * g.wo) * f
                    if col is None:
                        b, ldb = x_n + (k * cg * plane + r0 * g.wo) * f, plane
                    else:
                        b, ldb = _ptr(col) + k * cg * kk * columns * f, columns
                    if weight_grad:
                        self.module.gemm(False, True, og, cg * kk, columns, gy_band, plane, b, ldb,
                                         gw_ptr + k * og * cg * kk * f, cg * kk, accumulate=not first)
                    if gx is None:
                        continue
                    target, ldc = b, ldb  # gcol over col; the 1x1 path writes gx[n] where x[n] is
                    if col is None:
                        target = _ptr(gx) + n * g.c * g.h * g.w * f + (k * cg * plane + r0 * g.wo) * f
                    self.module.gemm(True, False, cg * kk, columns, og, w_ptr + k * og * cg * kk * f, cg * kk,
                                     gy_band, plane, target, ldc)
                first = False
                if gx is not None and col is not None:
                    in0, in_rows = g.input_rows(r0, rows)
                    gx_n = _ptr(gx) + n * g.c * g.h * g.w * f
                    self.module.launch("snrt_col2im_add", grid_for(g.c * in_rows * g.w), (
                        col, np.uint64(gx_n), *_i64(g.c, g.h, g.w, g.wo, g.kh, g.kw, g.sh, g.sw, g.ph, g.pw,
                                                     g.dh, g.dw, r0, rows, in0, in_rows)))
        ctx.release_scratch()


# ---- the registry ---------------------------------------------------------------------------

def _cudnn_conv(layer, in_shapes, kernels):
    from snrt.backends.cudnn_graphs import CudnnConv2d

    fallback = GemmConv2d(layer, in_shapes, kernels.module)
    return CudnnConv2d(layer, in_shapes, kernels, fallback) if kernels.use_cudnn else fallback


def _cudnn_batchnorm(layer, in_shapes, kernels):
    from snrt.backends.cudnn_graphs import CudnnBatchNorm

    fallback = CudaBatchNorm(layer, in_shapes, kernels.module)
    return CudnnBatchNorm(layer, in_shapes, kernels, fallback) if kernels.use_cudnn else fallback


def _plain(kernel_class):
    return lambda layer, in_shapes, kernels: kernel_class(layer, in_shapes, kernels.module)


# layer type -> factory(layer, in_shapes, CudaKernels) -> kernel; other layers: XpKernel
REGISTRY = {
    "Conv2d": _cudnn_conv,
    "BatchNorm": _cudnn_batchnorm,
    "Linear": _plain(CublasLinear),
    "SoftmaxCrossEntropy": _plain(CudaSoftmaxCrossEntropy),
    "Dropout": _plain(CudaDropout),
    "AvgPool": _plain(CudaAvgPool),
}


class CudaKernels:
    """The kernel of every (layer, input shapes) on the current CUDA device, chosen once and
    cached, so the plan (through `workspace_bytes`) and the run use the same kernel.

    `use_cudnn` False uses the CUDA kernels above for Conv2d and BatchNorm too;
    `workspace_limit_bytes` bounds the cuDNN engines considered at plan time (the fastest
    that fits is kept); `allow_tf32` admits cuDNN's TF32 tensor-core engines for float32.
    """

    def __init__(self, use_cudnn=True, workspace_limit_bytes=None, allow_tf32=False):
        self.use_cudnn, self.workspace_limit_bytes, self.allow_tf32 = use_cudnn, workspace_limit_bytes, allow_tf32
        self._module = None
        self._cudnn = None
        self._stream = None
        self._kernels = {}

    @property
    def module(self):
        if self._module is None:
            self._module = KernelModule()
        return self._module

    @property
    def cudnn(self):
        """The cuDNN frontend context (handle, graph building), created on first use."""
        if self._cudnn is None:
            from snrt.backends.cudnn_graphs import CudnnContext

            self._cudnn = CudnnContext(self.workspace_limit_bytes, self.allow_tf32)
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
        """What the planner should reserve for `layer`'s kernel (the planner hook)."""
        return self.kernel_for(layer, in_shapes).workspace_bytes(in_shapes, phase, itemsize)

    def set_stream(self, stream):
        """cuDNN runs on `stream` (the backend's compute stream; CUDA kernels and cuBLAS
        take the current stream, which the backend makes that one)."""
        self._stream = stream
        if self._cudnn is not None:
            self._cudnn.set_stream(stream)

    def summary(self):
        """{kernel name: count} over the kernels chosen so far (e.g. {"cudnn": 53, "xp": 120})."""
        counts = {}
        for kernel in self._kernels.values():
            counts[kernel.name] = counts.get(kernel.name, 0) + 1
        return counts


__all__ = ["BLOCK", "KERNEL_NAMES", "KERNEL_SOURCE", "NUMPY_ONLY", "REGISTRY", "CompileError", "ConvGeometry",
           "CudaKernels", "GemmConv2d", "XpKernel", "compile_ptx"]
