"""The CUDA C source of snrt's kernels, its compilation and the launcher.

`KERNEL_SOURCE` holds every CUDA kernel the backend launches (snrt/backends/cuda_layers.py
says which layer runs which); `KernelModule` compiles it on the current device, launches its
kernels and calls cuBLAS SGEMM on the current stream; `grid_for`, `device_pointer` and
`int64_args` build a launch's grid and arguments.

The CUDA C source is one `extern "C"` module without headers, so it compiles with NVRTC on
a machine without a GPU (`compile_ptx`), which is what the static tests check. Importing
this module does not import CuPy.
"""

import ctypes
import os

import numpy as np

BLOCK = 256  # threads per block of every kernel below
MAX_GRID = 65535 * 32  # grid-stride loops cover the rest

KERNEL_SOURCE = r"""
// snrt CUDA kernels: float32, NCHW, sizes as long long. Every kernel writes only the buffers
// it is given; per-channel and per-row reductions run one block per channel (row), BatchNorm's
// in training a block per channel and slice of samples. No headers: NVRTC compiles this
// without a CUDA toolkit or a device.

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

// BatchNorm in training, over a grid of c * slices blocks: block b works on channel
// ch = b / slices and, of its n samples, on [s * per, min(n, (s + 1) * per)) with s = b % slices
// and per = ceil(n / slices); a pass writes its block's sum to partials[b] and the next kernel
// adds a channel's `slices` partials in order (snrt_bn_channel_total), so the bits depend on the
// shapes alone. In every BatchNorm kernel a null weight and bias mean weight 1 and bias 0
// (affine: false). Values of a slice are indexed with 32-bit arithmetic: per * hw < 2^32.
__device__ __forceinline__ float snrt_bn_channel_total(const float* partials, long long ch, long long slices) {
    float total = 0.0f;
    for (long long s = 0; s < slices; ++s) total = __fadd_rn(total, partials[ch * slices + s]);
    return total;
}

// The offset of a slice's k-th value (k < its count) from x: sample n0 + k / hw, pixel k % hw.
__device__ __forceinline__ long long snrt_bn_at(unsigned int k, unsigned int hw, long long n0, long long c, long long ch) {
    unsigned int sample = k / hw;
    return ((n0 + sample) * c + ch) * (long long)hw + (k - sample * hw);
}

#define SNRT_BN_SLICE(n, c, hw, slices)                                                                 \
    long long ch = blockIdx.x / (slices), per = ((n) + (slices) - 1) / (slices);                       \
    long long n0 = (blockIdx.x % (slices)) * per;                                                      \
    unsigned int count = (unsigned int)(((n0 + per < (n) ? n0 + per : (n)) - n0) * (hw));               \
    unsigned int hw32 = (unsigned int)(hw);

// Pass 1 of the training forward: partials[b] = the slice's sum of x.
extern "C" __global__ void snrt_bn_sums(const float* x, float* partials, long long n, long long c, long long hw,
                                        long long slices) {
    SNRT_BN_SLICE(n, c, hw, slices)
    float acc = 0.0f;
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) acc += x[snrt_bn_at(k, hw32, n0, c, ch)];
    acc = snrt_block_sum(acc);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// The batch mean of channel ch from pass 1's partials: their sum times 1/M rounded to float.
__device__ __forceinline__ float snrt_bn_mean(const float* sums, long long ch, long long slices, long long m) {
    return __fmul_rn(snrt_bn_channel_total(sums, ch, slices), (float)(1.0 / (double)m));
}

// Pass 2: squares[b] = the slice's sum of (x - mean)^2 (two passes, like the NumPy kernel).
extern "C" __global__ void snrt_bn_squares(const float* x, const float* sums, float* squares, long long n,
                                           long long c, long long hw, long long slices) {
    SNRT_BN_SLICE(n, c, hw, slices)
    float m = snrt_bn_mean(sums, ch, slices, n * hw), acc = 0.0f;
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) {
        float d = __fsub_rn(x[snrt_bn_at(k, hw32, n0, c, ch)], m);
        acc = __fadd_rn(acc, __fmul_rn(d, d));
    }
    acc = snrt_block_sum(acc);
    if (threadIdx.x == 0) squares[blockIdx.x] = acc;
}

// Pass 3: y = (x - mean) * (weight * inv_std) + bias over the slice, inv_std = 1/sqrt(var + eps)
// with the biased variance, and with relu (BatchNormReLU) max(y, 0) as ReLU's forward computes
// it (a NaN stays NaN); the channel's first block writes aux mean and inv_std and, unless
// recomputing, the running statistics (keep = 1 - momentum and unbias = M/(M-1) come from the
// host in float32, as NumPy rounds them).
extern "C" __global__ void snrt_bn_normalize(
        const float* x, float* y, const float* weight, const float* bias, const float* sums, const float* squares,
        float* mean, float* inv_std, float* running_mean, float* running_var, long long n, long long c, long long hw,
        long long slices, float eps, float momentum, float keep, float unbias, int update_running, int relu) {
    SNRT_BN_SLICE(n, c, hw, slices)
    float m = snrt_bn_mean(sums, ch, slices, n * hw);
    float var = snrt_bn_channel_total(squares, ch, slices) / (float)(n * hw);
    float inv = 1.0f / sqrtf(__fadd_rn(var, eps));
    if (threadIdx.x == 0 && blockIdx.x % slices == 0) {
        mean[ch] = m;
        inv_std[ch] = inv;
        if (update_running) {
            running_mean[ch] = __fadd_rn(__fmul_rn(running_mean[ch], keep), __fmul_rn(momentum, m));
            running_var[ch] = __fadd_rn(__fmul_rn(running_var[ch], keep), __fmul_rn(momentum, __fmul_rn(var, unbias)));
        }
    }
    float scale = weight ? __fmul_rn(weight[ch], inv) : inv, shift = bias ? bias[ch] : 0.0f;
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) {
        long long i = snrt_bn_at(k, hw32, n0, c, ch);
        float v = __fadd_rn(__fmul_rn(__fsub_rn(x[i], m), scale), shift);
        y[i] = (!relu || v > 0.0f) ? v : (v == v ? 0.0f : v);
    }
}

// BatchNorm eval forward: running statistics; aux mean and inv_std are written by ch < c.
extern "C" __global__ void snrt_bn_forward_eval(
        const float* x, float* y, const float* weight, const float* bias, const float* running_mean,
        const float* running_var, float* mean, float* inv_std, long long total, long long c, long long hw, float eps) {
    SNRT_GRID_LOOP(i, total) {
        long long ch = (i / hw) % c;
        float inv = 1.0f / sqrtf(__fadd_rn(running_var[ch], eps));
        float scale = weight ? __fmul_rn(weight[ch], inv) : inv;
        float shift = __fsub_rn(bias ? bias[ch] : 0.0f, __fmul_rn(running_mean[ch], scale));
        y[i] = __fadd_rn(__fmul_rn(x[i], scale), shift);
        if (i < c) {
            mean[i] = running_mean[i];
            inv_std[i] = 1.0f / sqrtf(__fadd_rn(running_var[i], eps));
        }
    }
}

// The gradient BatchNorm's backward starts from: gy itself, or with relu (BatchNormReLU) gy
// masked by ReLU's gradient at BatchNorm's output computed again from x, as the layer's
// backward computes it: sign(max(y, 0)) * gy, y = (x - mean) * scale + shift.
__device__ __forceinline__ float snrt_bn_grad_in(float g, float x, float m, float scale, float shift, int relu) {
    if (!relu) return g;
    float v = __fadd_rn(__fmul_rn(__fsub_rn(x, m), scale), shift);
    return __fmul_rn(v > 0.0f ? 1.0f : (v == v ? 0.0f : v), g);
}

// BatchNorm backward, pass 1 (the slices as in training): sums[b] = the slice's sum of g (the
// gradient snrt_bn_grad_in starts from), dots[b] = its sum of g * (x - mean).
extern "C" __global__ void snrt_bn_grad_sums(
        const float* x, const float* gy, const float* weight, const float* bias, const float* mean,
        const float* inv_std, float* sums, float* dots, long long n, long long c, long long hw, long long slices,
        int relu) {
    SNRT_BN_SLICE(n, c, hw, slices)
    float m = mean[ch], inv = inv_std[ch], acc_gy = 0.0f, acc_dot = 0.0f;
    float scale = weight ? __fmul_rn(weight[ch], inv) : inv, shift = bias ? bias[ch] : 0.0f;
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) {
        long long i = snrt_bn_at(k, hw32, n0, c, ch);
        float v = x[i], g = snrt_bn_grad_in(gy[i], v, m, scale, shift, relu);
        acc_gy = __fadd_rn(acc_gy, g);
        acc_dot = __fadd_rn(acc_dot, __fmul_rn(g, __fsub_rn(v, m)));
    }
    acc_gy = snrt_block_sum(acc_gy);
    acc_dot = snrt_block_sum(acc_dot);
    if (threadIdx.x == 0) {
        sums[blockIdx.x] = acc_gy;
        dots[blockIdx.x] = acc_dot;
    }
}

// Pass 2: the channel's first block writes gweight = sum(g * xhat) and gbias = sum(g) (both
// null without an affine part); every block, when gx is not null, writes its slice of
// training: gx = weight*inv_std * (g + x*c1 + c0), c1 = -inv_std*sum(g*xhat)/M, c0 = -mean*c1 - sum(g)/M;
// eval: gx = weight*inv_std * g.
extern "C" __global__ void snrt_bn_grad_input(
        const float* x, const float* gy, const float* weight, const float* bias, const float* mean,
        const float* inv_std, const float* sums, const float* dots, float* gx, float* gweight, float* gbias,
        long long n, long long c, long long hw, long long slices, int training, int relu) {
    SNRT_BN_SLICE(n, c, hw, slices)
    float m = mean[ch], inv = inv_std[ch];
    float sum_gy = snrt_bn_channel_total(sums, ch, slices);
    float sum_gy_xhat = __fmul_rn(snrt_bn_channel_total(dots, ch, slices), inv);
    if (threadIdx.x == 0 && blockIdx.x % slices == 0 && gweight) {
        gweight[ch] = sum_gy_xhat;
        gbias[ch] = sum_gy;
    }
    if (gx == 0) return;
    float scale = weight ? __fmul_rn(weight[ch], inv) : inv, shift = bias ? bias[ch] : 0.0f;
    float c1 = __fdiv_rn(__fmul_rn(-inv, sum_gy_xhat), (float)(n * hw));
    float c0 = __fsub_rn(__fmul_rn(-m, c1), __fdiv_rn(sum_gy, (float)(n * hw)));
    for (unsigned int k = threadIdx.x; k < count; k += blockDim.x) {
        long long i = snrt_bn_at(k, hw32, n0, c, ch);
        float v = x[i], g = snrt_bn_grad_in(gy[i], v, m, scale, shift, relu);
        gx[i] = training ? __fmul_rn(__fadd_rn(__fadd_rn(__fmul_rn(v, c1), c0), g), scale) : __fmul_rn(g, scale);
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
// j * 0x9E3779B1 + key, uint32 arithmetic), y = ((h >= threshold) * scale) * x, with one mask
// entry j = i / group per `group` consecutive elements (1 for Dropout, H*W for Dropout2d).
extern "C" __global__ void snrt_dropout(const float* x, float* y, long long total, long long group, unsigned int key,
                                         unsigned int threshold, float scale) {
    SNRT_GRID_LOOP(i, total) {
        unsigned int h = (unsigned int)(i / group) * 0x9E3779B1u + key;
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

// MaxPool, as the layer's xp code (snrt/layers/pool.py) computes it. Forward, one thread per
// output: taps in k = a * kw + b order, those outside the input skipped (they read -inf);
// y = the maximum, NaN when a tap is NaN; argmax = the last k whose tap was greater than the
// maximum before it (the first maximum). Backward, one thread per input element: every
// output whose window holds the element at offset k adds gy * (argmax == k), in k order.
#define SNRT_MAXPOOL(SUFFIX, INDEX)                                                                     \
extern "C" __global__ void snrt_maxpool_forward_##SUFFIX(                                               \
        const float* x, float* y, INDEX* argmax, long long nc, long long h, long long w, long long ho,   \
        long long wo, long long kh, long long kw, long long sh, long long sw, long long ph, long long pw) { \
    SNRT_GRID_LOOP(i, nc * ho * wo) {                                                                   \
        long long ow = i % wo, oh = (i / wo) % ho, plane = i / (wo * ho);                               \
        const float* src = x + plane * h * w;                                                           \
        float best = SNRT_NEG_INF;                                                                      \
        long long index = 0;                                                                            \
        for (long long a = 0; a < kh; ++a) {                                                            \
            long long r = oh * sh - ph + a;                                                             \
            if (r < 0 || r >= h) continue;                                                              \
            for (long long b = 0; b < kw; ++b) {                                                        \
                long long q = ow * sw - pw + b;                                                         \
                if (q < 0 || q >= w) continue;                                                          \
                float v = src[r * w + q];                                                               \
                if (v > best) index = a * kw + b;                                                       \
                best = (best != best || v != v) ? (best != best ? best : v) : fmaxf(best, v);           \
            }                                                                                           \
        }                                                                                               \
        y[i] = best;                                                                                    \
        argmax[i] = (INDEX)index;                                                                       \
    }                                                                                                   \
}                                                                                                       \
extern "C" __global__ void snrt_maxpool_backward_##SUFFIX(                                              \
        const float* gy, const INDEX* argmax, float* gx, long long nc, long long h, long long w,         \
        long long ho, long long wo, long long kh, long long kw, long long sh, long long sw, long long ph, \
        long long pw) {                                                                                 \
    SNRT_GRID_LOOP(i, nc * h * w) {                                                                     \
        long long q = i % w, r = (i / w) % h, plane = i / (w * h);                                      \
        const float* g = gy + plane * ho * wo;                                                          \
        const INDEX* at = argmax + plane * ho * wo;                                                     \
        float acc = 0.0f;                                                                               \
        for (long long a = 0; a < kh; ++a) {                                                            \
            long long top = r + ph - a;                                                                 \
            if (top < 0 || top % sh) continue;                                                          \
            long long oh = top / sh;                                                                    \
            if (oh >= ho) continue;                                                                     \
            for (long long b = 0; b < kw; ++b) {                                                        \
                long long left = q + pw - b;                                                            \
                if (left < 0 || left % sw) continue;                                                    \
                long long ow = left / sw;                                                               \
                if (ow >= wo) continue;                                                                 \
                long long o = oh * wo + ow;                                                             \
                acc = __fadd_rn(acc, __fmul_rn(g[o], (long long)at[o] == a * kw + b ? 1.0f : 0.0f));  \
            }                                                                                           \
        }                                                                                               \
        gx[i] = acc;                                                                                    \
    }                                                                                                   \
}
SNRT_MAXPOOL(u8, unsigned char)
SNRT_MAXPOOL(i32, int)

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

// out[i] = parts[i] + parts[size + i] + ... + parts[(count - 1) * size + i], added in that order
// (the pointwise weight gradient's partial sums, snrt/backends/cuda_pointwise.py)
extern "C" __global__ void snrt_sum_slices(const float* parts, float* out, long long count, long long size) {
    SNRT_GRID_LOOP(i, size) {
        float acc = parts[i];
        for (long long k = 1; k < count; ++k) acc += parts[k * size + i];
        out[i] = acc;
    }
}

// A strided 1x1 convolution's pixels (snrt/backends/cuda_pointwise.py): snrt_subsample packs
// xs[plane, oh, ow] = x[plane, oh * sh, ow * sw] over nc planes of h x w; its adjoint
// snrt_unsubsample writes every gx[plane, r, q]: gxs at the strided pixels, 0 between them.
extern "C" __global__ void snrt_subsample(const float* x, float* xs, long long nc, long long h, long long w,
                                          long long ho, long long wo, long long sh, long long sw) {
    SNRT_GRID_LOOP(i, nc * ho * wo) {
        long long ow = i % wo, oh = (i / wo) % ho, plane = i / (wo * ho);
        xs[i] = x[(plane * h + oh * sh) * w + ow * sw];
    }
}

extern "C" __global__ void snrt_unsubsample(const float* gxs, float* gx, long long nc, long long h, long long w,
                                            long long ho, long long wo, long long sh, long long sw) {
    SNRT_GRID_LOOP(i, nc * h * w) {
        long long q = i % w, r = (i / w) % h, plane = i / (w * h);
        gx[i] = (r % sh == 0 && q % sw == 0) ? gxs[(plane * ho + r / sh) * wo + q / sw] : 0.0f;
    }
}

// ReLU's input gradient in one pass: gx = sign(y) * gy (y = relu(x) >= 0, so sign(y) is the 0/1
// mask and a NaN in y stays NaN), as the layer's xp code computes it in two.
extern "C" __global__ void snrt_relu_backward(const float* y, const float* gy, float* gx, long long total) {
    SNRT_GRID_LOOP(i, total) {
        float v = y[i];
        float sign = v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : (v == 0.0f ? 0.0f : v));
        gx[i] = sign * gy[i];
    }
}

// Add's input gradients: the output gradient copied to a and, unless null, to b, reading it once.
extern "C" __global__ void snrt_copy_to_two(const float* source, float* a, float* b, long long total) {
    SNRT_GRID_LOOP(i, total) {
        float v = source[i];
        a[i] = v;
        if (b != nullptr) b[i] = v;
    }
}

// One optimizer update of n parameters in one pass, as snrt/optim.py's sgd_step and adam_step
// (their scalars from the optimizer's fused_scalars): each gradient value multiplied by scale
// and, when clip > 0, clipped to [-clip, clip] (a NaN stays NaN), as Optimizer.update does
// first; g is only read.
__device__ __forceinline__ float snrt_scaled_grad(float g, float scale, float clip) {
    g *= scale;
    return (clip > 0.0f && g == g) ? fminf(fmaxf(g, -clip), clip) : g;
}

// SGD: m null without momentum; nesterov 0 or 1.
__device__ __forceinline__ void snrt_sgd(
        float* w, const float* g, float* m, long long n, float scale, float clip,
        float weight_decay, float momentum, float nesterov, float lr) {
    SNRT_GRID_LOOP(i, n) {
        float gi = snrt_scaled_grad(g[i], scale, clip) + weight_decay * w[i];
        float step = gi;
        if (m != nullptr) {
            float mi = momentum * m[i] + gi;
            m[i] = mi;
            step = nesterov != 0.0f ? gi + momentum * mi : mi;
        }
        w[i] -= lr * step;
    }
}

// Adam (AdamW when decoupled is 1): decay is wd (AdamW: lr * wd), step_size lr / (1 - beta1^t),
// correction2 1 / sqrt(1 - beta2^t).
__device__ __forceinline__ void snrt_adam(
        float* w, const float* g, float* m, float* v, long long n, float scale, float clip,
        float decay, float beta1, float rest1, float beta2, float rest2, float eps, float step_size,
        float correction2, float decoupled) {
    SNRT_GRID_LOOP(i, n) {
        float gi = snrt_scaled_grad(g[i], scale, clip), wi = w[i];
        if (decoupled != 0.0f) wi *= 1.0f - decay; else gi += decay * wi;
        float mi = beta1 * m[i] + rest1 * gi, vi = beta2 * v[i] + rest2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        w[i] = wi - step_size * (mi / (sqrtf(vi) * correction2 + eps));
    }
}

// Each update twice: its scalars as arguments (steps run one by one), or read from a row s in
// device memory (a captured graph, whose replays find the next iteration's scalars there), in
// the order of the arguments.
extern "C" __global__ void snrt_sgd_step(
        float* w, const float* g, float* m, long long n, float scale, float clip,
        float weight_decay, float momentum, float nesterov, float lr) {
    snrt_sgd(w, g, m, n, scale, clip, weight_decay, momentum, nesterov, lr);
}

extern "C" __global__ void snrt_sgd_step_at(float* w, const float* g, float* m, long long n, const float* s) {
    snrt_sgd(w, g, m, n, s[0], s[1], s[2], s[3], s[4], s[5]);
}

extern "C" __global__ void snrt_adam_step(
        float* w, const float* g, float* m, float* v, long long n, float scale, float clip,
        float decay, float beta1, float rest1, float beta2, float rest2, float eps, float step_size,
        float correction2, float decoupled) {
    snrt_adam(w, g, m, v, n, scale, clip, decay, beta1, rest1, beta2, rest2, eps, step_size, correction2,
              decoupled);
}

extern "C" __global__ void snrt_adam_step_at(float* w, const float* g, float* m, float* v, long long n,
                                             const float* s) {
    snrt_adam(w, g, m, v, n, s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], s[8], s[9], s[10]);
}
"""

KERNEL_NAMES = (
    "snrt_channel_sum", "snrt_bias_add", "snrt_bn_sums", "snrt_bn_squares", "snrt_bn_normalize",
    "snrt_bn_forward_eval", "snrt_bn_grad_sums", "snrt_bn_grad_input",
    "snrt_xent_forward_i32", "snrt_xent_backward_i32", "snrt_xent_forward_i64", "snrt_xent_backward_i64",
    "snrt_dropout", "snrt_avgpool_forward", "snrt_avgpool_backward", "snrt_im2col", "snrt_col2im_add",
    "snrt_relu_backward", "snrt_copy_to_two", "snrt_sgd_step", "snrt_adam_step", "snrt_sgd_step_at",
    "snrt_adam_step_at", "snrt_sum_slices",
    "snrt_subsample", "snrt_unsubsample",
    "snrt_maxpool_forward_u8", "snrt_maxpool_backward_u8", "snrt_maxpool_forward_i32", "snrt_maxpool_backward_i32",
)
NVRTC_OPTIONS = ("--std=c++14",)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel source; the message holds its log."""


OLDEST_ARCH = 70  # Volta: the oldest GPUs snrt targets (CUDA 13 itself starts at Turing, 75)


def nvrtc_toolkit():
    """(CUDA version as (major, minor), the compute capabilities snrt compiles its kernels for
    with the installed NVRTC, oldest first): (70, 72, 75, ...) on CUDA 12, (75, ...) on CUDA
    13, which dropped Volta. Needs the NVRTC library, not a device."""
    from cupy_backends.cuda.libs import nvrtc

    archs = tuple(sorted(arch for arch in nvrtc.getSupportedArchs() if arch >= OLDEST_ARCH))
    return tuple(nvrtc.getVersion()), archs


def device_name():
    """The current CUDA device's name, e.g. "NVIDIA H100 80GB HBM3"."""
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"]
    return name.decode() if isinstance(name, bytes) else name


def unsupported_device_reason(device_name, capability, toolkit):
    """None when snrt's kernels compile, with `toolkit` ((major, minor), archs), for a GPU of
    compute capability `capability` (e.g. 70), else a sentence naming the GPU and the toolkit."""
    (major, minor), archs = toolkit
    if capability >= archs[0]:
        return None
    older = (f" (the gpu extra, for CUDA 12, compiles for sm_{OLDEST_ARCH} and newer)"
             if major > 12 and capability >= OLDEST_ARCH else "")
    return (f"the GPU {device_name} (sm_{capability}) is older than snrt supports on CUDA {major}.{minor} "
            f"(sm_{archs[0]} and newer){older}")


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


class DirectCublas:
    """The cuBLAS calls of `KernelModule.gemm`, made directly (ctypes) rather than through
    CuPy's wrappers: each of those sets the handle's stream first, and CuPy refuses to set a
    stream that a CUDA graph is capturing ("calling cuBLAS API during stream capture is
    currently unsupported"), where cuBLAS itself records its GEMMs (the CUDA graphs section
    of the cuBLAS guide). The same library CuPy loaded, the same handle and arguments: the
    same bits. Methods are named as CuPy's; its `cublas` module supplies the constants."""

    CALLS = {  # method: (cuBLAS symbol, argument types after the handle)
        "setStream": ("cublasSetStream_v2", (ctypes.c_void_p,)),
        "setPointerMode": ("cublasSetPointerMode_v2", (ctypes.c_int,)),
        "sgemmStridedBatched": ("cublasSgemmStridedBatched", (
            *(ctypes.c_int,) * 5, ctypes.c_void_p,  # transa, transb, m, n, k; alpha
            ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong,  # A, B
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong, ctypes.c_int)),  # beta, C, batch
        "gemmStridedBatchedEx": ("cublasGemmStridedBatchedEx", (
            *(ctypes.c_int,) * 5, ctypes.c_void_p,  # transa, transb, m, n, k; alpha
            *(ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong) * 2,  # A, B: pointer, type, ld, stride
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_longlong,  # beta; C
            ctypes.c_int, ctypes.c_int, ctypes.c_int)),  # batch, compute type, algorithm
    }

    def __init__(self, constants, library):
        self._constants = constants
        for method, (symbol, types) in self.CALLS.items():
            function = getattr(library, symbol)
            function.argtypes, function.restype = (ctypes.c_void_p, *types), ctypes.c_int
            setattr(self, method, self._checked(symbol, function))

    @staticmethod
    def _checked(symbol, function):
        def call(*args):
            status = function(*args)
            if status:
                raise RuntimeError(f"{symbol} failed with cuBLAS status {status}")
        return call

    def __getattr__(self, name):  # CUBLAS_OP_N and the other constants
        return getattr(self._constants, name)


def loaded_library(prefix):
    """A ctypes handle on the shared library this process loaded whose file name starts with
    `prefix` (e.g. "libcublas.so": CuPy's, whichever wheel or toolkit it came from)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith(prefix):
                return ctypes.CDLL(path)
    raise OSError(f"no {prefix}* is loaded in this process")


class KernelModule:
    """The compiled module on the current device (compiled on first use) and cuBLAS calls on
    the current stream; `tf32`: cuBLAS may multiply float32 matrices in TF32 on tensor cores."""

    def __init__(self, tf32=False):
        import cupy
        from cupy_backends.cuda.libs import cublas

        self.cupy, self.cublas, self.tf32 = cupy, DirectCublas(cublas, loaded_library("libcublas.so")), tf32
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
        computes C^T = op(B)^T op(A)^T: operands swap, transposes stay. SGEMM, or with `tf32`
        the same GEMM computed as CUBLAS_COMPUTE_32F_FAST_TF32 (float32 in and out)."""
        cublas, handle = self.cublas, self.cupy.cuda.device.get_cublas_handle()
        cublas.setStream(handle, self.cupy.cuda.get_current_stream().ptr)
        cublas.setPointerMode(handle, cublas.CUBLAS_POINTER_MODE_HOST)
        op = {False: cublas.CUBLAS_OP_N, True: cublas.CUBLAS_OP_T}
        beta = self._one if accumulate else self._zero
        # strides are in elements, as cuBLAS counts them
        if self.tf32:
            f32 = self.cupy.cuda.runtime.CUDA_R_32F
            cublas.gemmStridedBatchedEx(handle, op[trans_b], op[trans_a], n, m, k, self._one.ctypes.data,
                                        b, f32, ldb, stride_b, a, f32, lda, stride_a, beta.ctypes.data,
                                        c, f32, ldc, stride_c, batch, cublas.CUBLAS_COMPUTE_32F_FAST_TF32,
                                        cublas.CUBLAS_GEMM_DEFAULT)
            return
        cublas.sgemmStridedBatched(handle, op[trans_b], op[trans_a], n, m, k, self._one.ctypes.data,
                                   b, ldb, stride_b, a, lda, stride_a, beta.ctypes.data,
                                   c, ldc, stride_c, batch)


def best_seconds(stream, action, rounds):
    """The least seconds of `rounds` calls of `action` on `stream`, each between two CUDA
    events (one untimed call first); raises what `action` raises."""
    import cupy

    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    action()
    best = float("inf")
    for _ in range(rounds):
        start.record(stream)
        action()
        end.record(stream)
        end.synchronize()
        best = min(best, cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return best


def on_own_pool(measure):
    """`measure(cupy, stream)` with a memory pool of its own and a new non-blocking stream
    made current (the pool emptied after), or None when the device has no memory to spare;
    what `measure` allocates is released when it returns. The stream current before is made
    current again: CuPy's `with stream:` would restore its own stack's, the null stream, not
    the compute stream a backend made current with `use()` (then CuPy's kernels and cuDNN's
    would run on different streams, unordered)."""
    import cupy

    pool, stream = cupy.cuda.MemoryPool(), cupy.cuda.Stream(non_blocking=True)
    before = cupy.cuda.get_current_stream()
    try:
        stream.use()
        with cupy.cuda.using_allocator(pool.malloc):
            return measure(cupy, stream)
    except cupy.cuda.memory.OutOfMemoryError:
        return None
    finally:
        stream.synchronize()
        before.use()
        pool.free_all_blocks()


NULL_POINTER = np.uint64(0)  # a null device pointer as a kernel argument (an optional buffer left out)


def device_pointer(array):
    """Device address of a CuPy array (its first element)."""
    return array.data.ptr


def int64_args(*values):
    """The values as np.int64, for kernel arguments declared long long."""
    return tuple(np.int64(v) for v in values)


__all__ = ["BLOCK", "KERNEL_NAMES", "KERNEL_SOURCE", "MAX_GRID", "NULL_POINTER", "NVRTC_OPTIONS", "CompileError",
           "KernelModule", "best_seconds", "compile_ptx", "on_own_pool", "device_name", "device_pointer", "grid_for", "int64_args", "nvrtc_toolkit",
           "unsupported_device_reason"]
