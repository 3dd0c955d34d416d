"""Dense convolution on the CPU without the column matrix: compiled dot products over rows
stacked channels last.

The layer's im2col copies every input value kh*kw times into a column matrix before its
GEMM; for 3x3 kernels on small maps (CIFAR's ResNets) that copy costs as much as the GEMM.
Here each band of output rows packs its input once, channels last and zero-padded, with
the kh input rows each output row reads stacked side by side:

    stacked[r*Wp + q, i*C + c] = xpad[n, c, h + i, q]     (output row r = (n, h), 0 <= q < Wp)

so that output pixel (h, w)'s whole window, over (j, i, c), is the one contiguous run
stacked[r*Wp + w : r*Wp + w + kw, :] of K = kw*kh*C numbers, and its value one dot product
with the weight repacked as wt[o, (j, i, c)] = W[o, c, i, j]. The kernel computes 4 pixels
by 4 output channels at a time: 16 dot products in one loop over K, which the compiler turns
into 16 vector accumulators (8 loads for 16 multiply-adds). The packing moves each input
value kh times, in cache, where im2col writes kh*kw copies to memory.

- forward: y = conv(x, W) + b, output rows split evenly among the kernel threads, each
  packing and computing its own bands of `BAND_ROWS` rows in buffers of its own;
- data gradient: for stride 1, gx is the convolution of gy zero-padded by (kh-1-ph,
  kw-1-pw) with the flipped, transposed weight W'[c, o, i, j] = W[o, c, kh-1-i, kw-1-j],
  so the same kernel computes it;
- weight gradient: gW[o, (j, i, c)] sums gy[n, o, h, w] times the pixel's window over the
  pixels, 4 pixels by 4 output channels at a time (each window value loaded once for 16
  multiply-adds into 4 rows of gW), chunk by chunk of `GRAD_WEIGHT_ELEMENTS` stacked values,
  the output channels split among the threads. A block past a row's last pixel has weight 0
  there, so a non-finite input value can turn a weight gradient that would be infinite into
  NaN (both are non-finite, which is what check mode looks for). No BLAS call: OpenBLAS's
  threads, which spin a while after each call, do not compete with the kernel threads.

Serves stride 1, dilation 1, one group, a kernel larger than 1x1 and padding at most kernel-1
(so the data gradient's padding is not negative); everything else is the layer's im2col.
Kernel threads (cpu_common.run_split): each output value is one thread's dot product in an
order fixed by the compiled code, so results do not depend on the number of threads: the same
bits in every run and policy.
"""

import numpy as np
from numba import njit

from snrt.backends.cpu_common import THREADED, LayerLike, fitting_threads, run_split
from snrt.backends.cpu_choice import VARIABLE, cache_path, choose, setting
from snrt.layers.base import BACKWARD, FLOAT32_BYTES, FORWARD, numel, scratch_bytes
from snrt.threads import kernel_threads

BAND_ROWS = 4  # output rows packed at a time by a thread (in cache while their dot products run)
GRAD_WEIGHT_ELEMENTS = 1 << 20  # stacked values per weight-gradient chunk: about 4 MB of fp32


@njit(**THREADED)
def stack_rows(x, n, ha, hb, ph, pw, kh, band, out):
    """out[(h - ha)*Wp + q, i*C + c] = xpad[n, c, h + i, q] for output rows h in [ha, hb) of
    sample n (xpad: x zero-padded by ph rows and pw columns, Wp = W + 2*pw). x (N, C, H, W);
    band (B + kh - 1, Wp, C) scratch, B >= 1 output rows a pass; out (at least (hb - ha)*Wp,
    kh*C)."""
    _, channels, height, width = x.shape
    rows, wp, _ = band.shape
    step = rows - kh + 1
    for h0 in range(ha, hb, step):
        h1 = min(hb, h0 + step)
        for b in range(h1 - h0 + kh - 1):  # input rows h0 - ph ... into band[b], channels last
            hi = h0 + b - ph
            row = band[b]
            if hi < 0 or hi >= height:
                row[:] = 0
                continue
            row[:pw] = 0
            row[pw + width:] = 0
            for c in range(channels):
                src = x[n, c, hi]
                for q in range(width):
                    row[q + pw, c] = src[q]
        for h in range(h0, h1):
            base = (h - ha) * wp
            for i in range(kh):
                row = band[h - h0 + i]
                for q in range(wp):
                    dst = out[base + q]
                    for c in range(channels):
                        dst[i * channels + c] = row[q, c]


@njit(**THREADED)
def stack_span(x, ho, ph, pw, kh, first, r0, r1, band, out):
    """stack_rows over output rows r0 <= r < r1 (r = n*Ho + h, across samples) into out from
    its row (r0 - first)*Wp on."""
    wp = band.shape[1]
    r = r0
    while r < r1:
        n, ha = r // ho, r % ho
        hb = min(ho, ha + r1 - r)
        stack_rows(x, n, ha, hb, ph, pw, kh, band, out[(r - first) * wp:])
        r += hb - ha


@njit(**THREADED)
def dot_rows(stacked, wt, bias, n, ha, hb, wp, y):
    """y[n, o, h, w] = bias[o] + stacked[(h - ha)*Wp + w :][:K] . wt[o] for h in [ha, hb), with
    stacked flat rows of kh*C (see stack_rows) and wt (O, K). Blocks of 4 pixels by 4 output
    channels; a block past the last pixel or channel repeats it (same value, written twice).
    Empty bias: none."""
    outs, k = wt.shape
    wo = y.shape[3]
    width = stacked.shape[1]
    flat = stacked.reshape(-1)
    for h in range(ha, hb):
        base = (h - ha) * wp
        for w0 in range(0, wo, 4):
            c0, c1, c2, c3 = min(w0, wo - 1), min(w0 + 1, wo - 1), min(w0 + 2, wo - 1), min(w0 + 3, wo - 1)
            r0 = flat[(base + c0) * width:][:k]
            r1 = flat[(base + c1) * width:][:k]
            r2 = flat[(base + c2) * width:][:k]
            r3 = flat[(base + c3) * width:][:k]
            for o0 in range(0, outs, 4):
                q0, q1, q2, q3 = o0, min(o0 + 1, outs - 1), min(o0 + 2, outs - 1), min(o0 + 3, outs - 1)
                k0, k1, k2, k3 = wt[q0], wt[q1], wt[q2], wt[q3]
                a00 = a01 = a02 = a03 = a10 = a11 = a12 = a13 = np.float32(0)
                a20 = a21 = a22 = a23 = a30 = a31 = a32 = a33 = np.float32(0)
                for t in range(k):
                    x0, x1, x2, x3 = r0[t], r1[t], r2[t], r3[t]
                    b0, b1, b2, b3 = k0[t], k1[t], k2[t], k3[t]
                    a00 += x0 * b0
                    a01 += x0 * b1
                    a02 += x0 * b2
                    a03 += x0 * b3
                    a10 += x1 * b0
                    a11 += x1 * b1
                    a12 += x1 * b2
                    a13 += x1 * b3
                    a20 += x2 * b0
                    a21 += x2 * b1
                    a22 += x2 * b2
                    a23 += x2 * b3
                    a30 += x3 * b0
                    a31 += x3 * b1
                    a32 += x3 * b2
                    a33 += x3 * b3
                if bias.size:
                    e0, e1, e2, e3 = bias[q0], bias[q1], bias[q2], bias[q3]
                    a00, a10, a20, a30 = a00 + e0, a10 + e0, a20 + e0, a30 + e0
                    a01, a11, a21, a31 = a01 + e1, a11 + e1, a21 + e1, a31 + e1
                    a02, a12, a22, a32 = a02 + e2, a12 + e2, a22 + e2, a32 + e2
                    a03, a13, a23, a33 = a03 + e3, a13 + e3, a23 + e3, a33 + e3
                yq0, yq1, yq2, yq3 = y[n, q0, h], y[n, q1, h], y[n, q2, h], y[n, q3, h]
                yq0[c0], yq1[c0], yq2[c0], yq3[c0] = a00, a01, a02, a03
                yq0[c1], yq1[c1], yq2[c1], yq3[c1] = a10, a11, a12, a13
                yq0[c2], yq1[c2], yq2[c2], yq3[c2] = a20, a21, a22, a23
                yq0[c3], yq1[c3], yq2[c3], yq3[c3] = a30, a31, a32, a33


@njit(**THREADED)
def convolve_rows(x, wt, bias, ph, pw, kh, kw, r0, r1, band, stacked, y):
    """y rows r0 <= r < r1 (r = n*Ho + h) of the stride-1 convolution of x (N, C, H, W),
    zero-padded by (ph, pw), with wt (O, kw*kh*C) (see dot_rows), band by band of at most
    stacked.shape[0] // Wp output rows."""
    ho = y.shape[2]
    wp = band.shape[1]
    rows = (stacked.shape[0] - kw + 1) // wp
    r = r0
    while r < r1:
        n, ha = r // ho, r % ho
        hb = min(ho, ha + rows, ha + r1 - r)
        used = stacked[:(hb - ha) * wp + kw - 1]
        stack_rows(x, n, ha, hb, ph, pw, kh, band, used)
        used[(hb - ha) * wp:] = 0
        dot_rows(used, wt, bias, n, ha, hb, wp, y)
        r += hb - ha


@njit(**THREADED)
def _add_products(d, a, s0, s1, s2, s3):
    """d[t] += a[0]*s0[t] + a[1]*s1[t] + a[2]*s2[t] + a[3]*s3[t] over d's length."""
    a0, a1, a2, a3 = a[0], a[1], a[2], a[3]
    for t in range(d.size):
        d[t] += a0 * s0[t] + a1 * s1[t] + a2 * s2[t] + a3 * s3[t]


@njit(**THREADED)
def _add_products4(d, a, s0, s1, s2, s3):
    """_add_products for the 4 rows of d (4, K) with the 4 rows of a (4, 4) at once: each s[t]
    loaded once for 16 multiply-adds."""
    d0, d1, d2, d3 = d[0], d[1], d[2], d[3]
    a00, a01, a02, a03 = a[0, 0], a[0, 1], a[0, 2], a[0, 3]
    a10, a11, a12, a13 = a[1, 0], a[1, 1], a[1, 2], a[1, 3]
    a20, a21, a22, a23 = a[2, 0], a[2, 1], a[2, 2], a[2, 3]
    a30, a31, a32, a33 = a[3, 0], a[3, 1], a[3, 2], a[3, 3]
    for t in range(d0.size):
        x0, x1, x2, x3 = s0[t], s1[t], s2[t], s3[t]
        d0[t] += a00 * x0 + a01 * x1 + a02 * x2 + a03 * x3
        d1[t] += a10 * x0 + a11 * x1 + a12 * x2 + a13 * x3
        d2[t] += a20 * x0 + a21 * x1 + a22 * x2 + a23 * x3
        d3[t] += a30 * x0 + a31 * x1 + a32 * x2 + a33 * x3


@njit(**THREADED)
def weight_grad_rows(stacked, gy, first, rows, wp, b0, b1, gw):
    """gw[o, t] += sum over the output pixels (h, w) of `rows` output rows from row `first` (r =
    n*Ho + h) of gy[n, o, h, w] * (pixel's window in stacked)[t], for the output channels o of
    blocks b0 <= b < b1 of 4 (the last block may be short). Pixels go 4 at a time (past the
    row's end with weight 0), each channel in the same order whatever the blocks, so the sums do
    not depend on how blocks are split among threads."""
    outs, ho, wo = gy.shape[1], gy.shape[2], gy.shape[3]
    k = gw.shape[1]
    width = stacked.shape[1]
    flat = stacked.reshape(-1)
    a = np.zeros((outs, 4), gw.dtype)  # gy of a block's pixels, 0 past the row's end
    for rr in range(rows):
        n, h = (first + rr) // ho, (first + rr) % ho
        base = rr * wp
        for w0 in range(0, wo, 4):
            c1, c2, c3 = min(w0 + 1, wo - 1), min(w0 + 2, wo - 1), min(w0 + 3, wo - 1)
            s0 = flat[(base + w0) * width:][:k]
            s1 = flat[(base + c1) * width:][:k]
            s2 = flat[(base + c2) * width:][:k]
            s3 = flat[(base + c3) * width:][:k]
            for o in range(4 * b0, min(outs, 4 * b1)):
                for q in range(4):
                    a[o, q] = gy[n, o, h, w0 + q] if w0 + q < wo else 0
            for b in range(b0, b1):
                if 4 * b + 4 <= outs:
                    _add_products4(gw[4 * b:4 * b + 4], a[4 * b:4 * b + 4], s0, s1, s2, s3)
                else:
                    for o in range(4 * b, outs):
                        _add_products(gw[o], a[o], s0, s1, s2, s3)


def _size(shapes, itemsize):
    """Workspace bytes of scratch arrays of `shapes`."""
    return scratch_bytes(*(numel(shape) * itemsize for shape in shapes))


class DirectConv2d(LayerLike):
    """Conv2d by the stacked-rows kernels above where they serve (see the module docstring),
    in a workspace of its own (`workspace_bytes`)."""

    name = "direct"

    @staticmethod
    def serves(layer, in_shapes):
        (kh, kw), (ph, pw) = layer.kernel, layer.padding
        return (layer.groups == 1 and layer.stride == (1, 1) and layer.dilation == (1, 1) and kh * kw > 1
                and ph <= kh - 1 and pw <= kw - 1)

    # ---- workspace ---------------------------------------------------------------------
    def _band_shape(self, channels, width):
        """A band (BAND_ROWS + kh - 1, Wp, channels) for packing an input of `channels`
        channels, Wp wide (see stack_rows)."""
        return (BAND_ROWS + self.layer.kernel[0] - 1, width, channels)

    def _rows_shapes(self, channels, width, threads):
        """Per thread: a band and stacked rows (BAND_ROWS*Wp + kw - 1, kh*channels)."""
        kh, kw = self.layer.kernel
        return [(threads, *self._band_shape(channels, width)), (threads, BAND_ROWS * width + kw - 1, kh * channels)]

    def _grad_weight_rows(self, in_shapes):
        """Output rows per weight-gradient chunk: about GRAD_WEIGHT_ELEMENTS stacked values."""
        n, c, _, w = in_shapes[0]
        (kh, _), (_, pw) = self.layer.kernel, self.layer.padding
        ho = self.layer.infer_shape(in_shapes)[2]
        return max(1, min(n * ho, GRAD_WEIGHT_ELEMENTS // ((w + 2 * pw) * kh * c)))

    def _forward_shapes(self, in_shapes, threads):
        _, c, _, w = in_shapes[0]
        o, (kh, kw), pw = self.layer.out_channels, self.layer.kernel, self.layer.padding[1]
        return [(o, kw * kh * c), *self._rows_shapes(c, w + 2 * pw, threads)]

    def _grad_input_shapes(self, in_shapes, threads):
        _, c, _, w = in_shapes[0]
        o, (kh, kw) = self.layer.out_channels, self.layer.kernel
        return [(c, kw * kh * o), *self._rows_shapes(o, w + kw - 1, threads)]

    def _grad_weight_shapes(self, in_shapes, threads):
        _, c, _, w = in_shapes[0]
        o, (kh, kw), pw = self.layer.out_channels, self.layer.kernel, self.layer.padding[1]
        rows, wp = self._grad_weight_rows(in_shapes), w + 2 * pw
        return [(rows * wp + kw - 1, kh * c), (o, kw * kh * c), (threads, *self._band_shape(c, wp))]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """Forward: the repacked weight and each thread's band and stacked rows. Backward: the
        larger of the weight gradient's (a chunk's stacked rows, the (O, K) sums, each thread's
        band) and the data gradient's (the flipped weight, each thread's band and rows); they
        run one after the other."""
        threads = kernel_threads()
        if phase != BACKWARD:
            return _size(self._forward_shapes(in_shapes, threads), itemsize)
        return max(_size(self._grad_weight_shapes(in_shapes, threads), itemsize),
                   _size(self._grad_input_shapes(in_shapes, threads), itemsize))

    @staticmethod
    def _threads(ctx, shapes_for, itemsize):
        """The kernel threads that fit the planned workspace with arrays shapes_for(threads)."""
        return fitting_threads(ctx.workspace.nbytes, lambda threads: _size(shapes_for(threads), itemsize))

    # ---- kernels -----------------------------------------------------------------------
    def _convolve(self, ctx, x, weight_t, bias, padding, y, shapes_for):
        """y = the stride-1 convolution of x padded by `padding` with weight_t (O, C, kh, kw),
        plus bias, on the kernel threads; shapes_for(threads): its workspace arrays
        (_forward_shapes or _grad_input_shapes of the layer's input)."""
        threads = self._threads(ctx, shapes_for, x.dtype.itemsize)
        wt, bands, stacked = (ctx.scratch(shape, x.dtype) for shape in shapes_for(threads))
        outs, channels, kh, kw = weight_t.shape
        wt.reshape(outs, kw, kh, channels)[...] = weight_t.transpose(0, 3, 2, 1)  # wt[o, (j, i, c)]
        rows = y.shape[0] * y.shape[2]
        run_split(convolve_rows, 0, rows, list(zip(bands, stacked, [y] * len(bands))),
                  (x, wt, bias, *padding, kh, kw))

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x, weight = xs[0], params["weight"]
        bias = params["bias"] if self.layer.bias else weight[:0, 0, 0, 0]
        self._convolve(ctx, x, weight, bias, self.layer.padding, y, lambda t: self._forward_shapes([x.shape], t))
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, weight = saved.xs[0], params["weight"]
        if self.layer.bias:
            n, o = gy.shape[:2]
            np.sum(gy.reshape(n, o, -1), axis=(0, 2), out=gparams["bias"])
        self._grad_weight(ctx, gy, x, gparams["weight"])
        ctx.release_scratch()
        if gxs[0] is not None:
            (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
            flipped = weight[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)  # (C, O, kh, kw)
            self._convolve(ctx, gy, flipped, weight[:0, 0, 0, 0], (kh - 1 - ph, kw - 1 - pw), gxs[0],
                           lambda t: self._grad_input_shapes([x.shape], t))
            ctx.release_scratch()

    def _grad_weight(self, ctx, gy, x, gweight):
        """gweight (O, C, kh, kw) = the sum, over chunks of output rows, of weight_grad_rows on
        the chunk's stacked rows, kept as (O, kw*kh*C) until the end."""
        n, c, _, w = x.shape
        o, ho = gy.shape[1], gy.shape[2]
        (kh, kw), (ph, pw) = self.layer.kernel, self.layer.padding
        wp = w + 2 * pw
        threads = self._threads(ctx, lambda count: self._grad_weight_shapes([x.shape], count), x.dtype.itemsize)
        stacked, sums, bands = (ctx.scratch(shape, x.dtype) for shape in self._grad_weight_shapes([x.shape], threads))
        sums[...] = 0
        chunk = self._grad_weight_rows([x.shape])
        for r0 in range(0, n * ho, chunk):
            r1 = min(n * ho, r0 + chunk)
            run_split(stack_span, r0, r1, [(band, stacked) for band in bands], (x, ho, ph, pw, kh, r0))
            stacked[(r1 - r0) * wp:(r1 - r0) * wp + kw - 1] = 0
            run_split(weight_grad_rows, 0, -(-o // 4), [(sums,)] * threads, (stacked, gy, r0, r1 - r0, wp))
        np.copyto(gweight, sums.reshape(o, kw, kh, c).transpose(0, 3, 2, 1))


class ChosenConv2d(LayerLike):
    """Conv2d, each phase (forward, backward) by the layer's im2col, or by DirectConv2d where
    it serves and measured at least 10% faster at the shape on this machine
    (snrt/backends/cpu_choice.py)."""

    serves = staticmethod(DirectConv2d.serves)

    def __init__(self, layer):
        super().__init__(layer)
        self.candidates = {"im2col": layer, "direct": DirectConv2d(layer)}

    def chosen(self, in_shapes, phase):
        """The kernel that runs `phase` at `in_shapes`."""
        return self.candidates[choose(self.layer, in_shapes, phase, self.candidates)]

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return self.chosen(in_shapes, phase).workspace_bytes(in_shapes, phase, itemsize)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        self.chosen([xs[0].shape], FORWARD).forward(ctx, xs, params, state, y, aux, recompute)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        self.chosen([saved.xs[0].shape], BACKWARD).backward(ctx, gy, saved, params, aux, gxs, gparams)


def describe_choices(executor):
    """'direct kernel for F of the N dense stride-1 convolutions' forwards, B of their
    backwards (choices: FILE)': what the choices among `executor`'s kernels came to ('' when
    it has none to make)."""
    chosen = [(kernel, executor.graph.in_shapes(name, executor.plan.batch))
              for name, kernel in executor.kernels.items() if isinstance(kernel, ChosenConv2d)]
    if not chosen:
        return ""
    direct = [sum(isinstance(kernel.chosen(shapes, phase), DirectConv2d) for kernel, shapes in chosen)
              for phase in (FORWARD, BACKWARD)]
    forced = setting()
    where = f"choices: {cache_path()}" if forced == "measure" else f"{VARIABLE}={forced}"
    return (f"direct kernel for {direct[0]} of the {len(chosen)} dense stride-1 convolutions' forwards, "
            f"{direct[1]} of their backwards ({where})")
