"""2-D convolution (cross-correlation, PyTorch semantics) by im2col/col2im and BLAS GEMM.

Column matrix. For a chunk of the batch (samples [n0, n1), output rows [r0, r1)) the planned
workspace holds `col` of shape (C*kh*kw, columns), rows ordered (c, i, j) and columns
(n, ho, wo) of the chunk:

    col[(c, i, j), (n, ho, wo)] = x[n, c, ho*sh + i*dh - ph, wo*sw + j*dw - pw]   (0 outside x)

It is filled by kh*kw strided slice copies of x (one per kernel tap), zeroing only the
strips where the window falls into the padding, so no padded copy of x is made. With stride
1 and "same" width a tap's band of rows is one contiguous span of the flattened image, so the
copy runs over long spans rather than single rows. Each group is then one GEMM per chunk:

    forward   y[chunk, g] (Og, columns)      = W[g] (Og, Cg*kh*kw) @ col[g] (Cg*kh*kw, columns)
    backward  gW[g] (Og, Cg*kh*kw)          += gy[chunk, g] @ col[g]^T
              gcol[g] (Cg*kh*kw, columns)    = W[g]^T @ gy[chunk, g]   (over col), then col2im

Chunks hold about `GEMM_COLUMNS` columns: BLAS runs at full speed from about 800 columns
on (a per-sample GEMM on a 14x14 image is about 20 % slower), and a smaller column matrix
is still in cache when its GEMM reads it. So the workspace is one chunk's, not the batch's:
small images group samples, big ones are cut into bands of rows in forward (backward keeps
whole samples, see `Conv2d._chunking`). When a chunk holds several samples its output (or
output gradient) is staged batch-transposed, (O, columns), in a second workspace array;
a single-sample chunk's GEMM reads and writes y[n] / gy[n] in place. Backward sums the
weight gradient of later chunks through one (O, C/groups*kh*kw) workspace array; for up to
TRANSPOSED_WEIGHT_GRAD_MAX_OUT output channels per group every chunk's weight gradient is
computed transposed into a (C/groups*kh*kw, O/groups) array instead (a faster GEMM there).

A 1x1 kernel with stride 1, no padding and no dilation on a map of at least `GEMM_COLUMNS`
pixels needs no column matrix: x[n] (C, H*W) already is one, a GEMM's worth of columns. Its
forward uses no workspace; its backward only the weight-gradient partial. On smaller maps it
groups samples like any other kernel (its column matrix a copy of the chunk's x): one GEMM
per sample of a 7x7 map would have 49 columns, and a weight gradient per sample rewrites all
of gW through the partial for each.
"""

import functools
from dataclasses import dataclass
from typing import ClassVar

from snrt.errors import ShapeError
from snrt.layers.base import (
    BACKWARD,
    EXPENSIVE,
    FORWARD,
    FLOAT32_BYTES,
    Cost,
    Layer,
    ParamSpec,
    Saves,
    numel,
    pair,
    scratch_bytes,
    with_reachable_strides,
)
from snrt.layers.registry import register

GEMM_COLUMNS = 1024  # GEMM columns per chunk: BLAS runs at full speed from about 800 on
# Up to this many output channels per group, the weight gradient is computed transposed,
# gW^T (Cg*kh*kw, Og) = col @ gy^T, and copied back: OpenBLAS runs that orientation 1.1-2.3x
# faster for Og <= 64 and 1.3-4x slower from Og = 128 on (results/bench_conv.md has the
# measurement).
TRANSPOSED_WEIGHT_GRAD_MAX_OUT = 64
TAP_ELEMENTS = 1 << 16  # elements per tap copy, at least: amortises a numpy call's overhead


def _pair_at_least(value, name, low, expected):
    """`pair(value, name)` with both entries >= `low`; else a ValueError saying the option must
    be `expected`."""
    message = f"option '{name}' must be {expected}, got {value!r}"
    try:
        result = pair(value, name)
    except ValueError:
        raise ValueError(message) from None
    if min(result) < low:
        raise ValueError(message)
    return result


def _positive_int(value, name):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"option '{name}' must be a positive int, got {value!r}")


def _check_options(layer):
    """Check a convolution's out_channels, groups and bias; kernel, stride and dilation become
    pairs of positive ints."""
    _positive_int(layer.out_channels, "out_channels")
    _positive_int(layer.groups, "groups")
    if not isinstance(layer.bias, bool):
        raise ValueError(f"option 'bias' must be true or false, got {layer.bias!r}")
    for name in ("kernel", "stride", "dilation"):
        value = _pair_at_least(getattr(layer, name), name, 1, "a positive int or pair of positive ints")
        object.__setattr__(layer, name, value)


def _non_negative_pair(layer, name, alternatives=""):
    """Option `name` of `layer` becomes a pair of non-negative ints (`alternatives` names the
    other values the message should offer)."""
    expected = f"a non-negative int, a pair of non-negative ints{alternatives}"
    object.__setattr__(layer, name, _pair_at_least(getattr(layer, name), name, 0, expected))


def _tap_range(size, out_size, offset, stride):
    """Output positions [lo, hi) whose input position o*stride + offset lies in [0, size)."""
    lo = min(out_size, max(0, -(offset // stride)))
    hi = max(lo, min(out_size, (size - 1 - offset) // stride + 1))
    return lo, hi


def _zero_outside(block, h0, h1, w0, w1):
    """Zero block[:, :, r, c] (block (C, N, Ho, Wo)) outside rows [h0, h1) x columns [w0, w1)."""
    block[:, :, :h0] = 0
    block[:, :, h1:] = 0
    block[:, :, h0:h1, :w0] = 0
    block[:, :, h0:h1, w1:] = 0


def _prefix(buffer, shape):
    """A C-contiguous view of `shape` over the first elements of a contiguous `buffer`."""
    return buffer.reshape(-1)[: numel(shape)].reshape(shape)


@register
@dataclass(frozen=True)
class Conv2d(Layer):
    """y[n, o] = b[o] + sum_{c in group(o), i, j} W[o, c, i, j] * xpad[n, c, s*h + d*i, s*w + d*j].

    x (N, C, H, W), W (O, C/groups, kh, kw), b (O,), y (N, O, Ho, Wo) with
    Ho = floor((H + 2*ph - dh*(kh-1) - 1)/sh) + 1 (likewise Wo); `padding` is symmetric zero
    padding per spatial dim; output channel o sees the input channels of its group
    o // (O/groups). Backward reads the input and the weight only:
    gW = sum_n gy[n] (*) x[n], gb = sum_{n,h,w} gy, gx = the transposed convolution of gy.
    """

    type_name = "Conv2d"
    recompute_cost = EXPENSIVE
    saves = Saves(inputs=(0,))
    gemm_columns: ClassVar[int] = GEMM_COLUMNS
    tap_elements: ClassVar[int] = TAP_ELEMENTS
    out_channels: int  # required
    kernel: int | tuple = 3  # int or (kh, kw); normalised to a pair
    stride: int | tuple = 1
    padding: int | tuple | str = 0  # symmetric zero padding per spatial dim, or "same" (stride 1)
    dilation: int | tuple = 1
    groups: int = 1
    bias: bool = True

    def __post_init__(self):
        _check_options(self)
        if self.padding == "same":
            object.__setattr__(self, "padding", self._same_padding())
        _non_negative_pair(self, "padding", " or 'same'")

    def _same_padding(self):
        """The symmetric padding that keeps the input size: stride 1 and an odd dilated kernel."""
        if self.stride != (1, 1):
            raise ValueError(f"option 'padding' 'same' needs stride 1, got stride {list(self.stride)}")
        spans = [d * (k - 1) for k, d in zip(self.kernel, self.dilation)]
        if any(span % 2 for span in spans):
            raise ValueError(f"option 'padding' 'same' needs an odd (dilated) kernel to pad both sides alike, "
                             f"got kernel {list(self.kernel)} with dilation {list(self.dilation)}")
        return tuple(span // 2 for span in spans)

    # ---- facts -------------------------------------------------------------------------
    def _geometry(self, in_shapes):
        """(N, C, H, W, Ho, Wo) after validating the input shape against the options."""
        self.require_rank(in_shapes, 4)
        n, c, h, w = in_shapes[0]
        if c % self.groups:
            raise ShapeError(f"input channels {c} are not divisible by groups {self.groups}")
        if self.out_channels % self.groups:
            raise ShapeError(
                f"out_channels {self.out_channels} is not divisible by groups {self.groups}"
            )
        out = []
        for size, k, s, p, d in zip((h, w), self.kernel, self.stride, self.padding, self.dilation):
            out.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
        if min(out) < 1:
            window = [d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation)]
            raise ShapeError(
                f"output spatial size {out[0]}x{out[1]} < 1: input {h}x{w} with padding "
                f"{list(self.padding)} is smaller than the dilated kernel {window[0]}x{window[1]}"
            )
        return n, c, h, w, out[0], out[1]

    def infer_shape(self, in_shapes):
        n, _, _, _, ho, wo = self._geometry(in_shapes)
        return (n, self.out_channels, ho, wo)

    def fitted(self, in_shapes):
        return with_reachable_strides(self, in_shapes, [d * (k - 1) + 1 for k, d in zip(self.kernel, self.dilation)])

    def param_specs(self, in_shapes):
        _, c, _, _, _, _ = self._geometry(in_shapes)
        kh, kw = self.kernel
        fan_in = c // self.groups * kh * kw
        fan_out = self.out_channels * kh * kw // self.groups
        weight = (self.out_channels, c // self.groups, kh, kw)
        specs = {"weight": ParamSpec(weight, "he_normal", fan_in, fan_out)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_channels,), "zeros", fan_in, fan_out, decay=False)
        return specs

    def _is_direct(self, ho, wo):
        """1x1 kernel, stride 1, no padding, no dilation, on a map of at least `gemm_columns`
        pixels: each sample's input is its own column matrix, a GEMM's worth."""
        return (self.kernel == (1, 1) and self.stride == (1, 1) and self.padding == (0, 0)
                and self.dilation == (1, 1) and ho * wo >= self.gemm_columns)

    def _chunking(self, n, c, ho, wo, phase):
        """(samples, output rows) per GEMM: about `gemm_columns` columns, whole rows.

        Forward cuts a sample with more columns than that into bands of rows (the band's
        column matrix stays in cache for its GEMM); backward keeps whole samples, as col2im
        adds run much slower on band-length rows. Smaller samples are grouped. A tap's copy
        moves at least `tap_elements` (C * columns), so that few input channels do not turn
        im2col into a loop of tiny numpy calls. Chunks are balanced so the last one is not
        much smaller than the rest. The direct 1x1 path works sample by sample (its column
        matrix is x[n] itself).
        """
        if self._is_direct(ho, wo):
            return 1, ho
        columns = max(self.gemm_columns, -(-self.tap_elements // c))
        rows = min(ho, -(-columns // wo))
        if rows < ho and phase != BACKWARD:
            return 1, -(-ho // -(-ho // rows))
        nb = min(n, -(-columns // (ho * wo)))
        return -(-n // -(-n // nb)), ho

    def _chunk_ranges(self, n, c, ho, wo, phase):
        """(n0, n1, r0, r1) for every chunk: samples [n0, n1), output rows [r0, r1)."""
        nb, rb = self._chunking(n, c, ho, wo, phase)
        for n0 in range(0, n, nb):
            for r0 in range(0, ho, rb):
                yield n0, min(n, n0 + nb), r0, min(ho, r0 + rb)

    def _scratch_shapes(self, in_shapes, phase, weight_grad=True):
        """Shapes of the workspace arrays a kernel call carves, in the order it carves them
        (a backward without the weight gradient needs no partial for it)."""
        n, c, _, _, ho, wo = self._geometry(in_shapes)
        kh, kw = self.kernel
        o, g = self.out_channels, self.groups
        nb, rb = self._chunking(n, c, ho, wo, phase)
        shapes = []
        if not self._is_direct(ho, wo):
            shapes.append((c * kh * kw, nb * rb * wo))  # column matrix of one chunk
        if nb > 1:
            shapes.append((o, nb * rb * wo))  # the chunk's y or gy, batch-transposed
        if phase == BACKWARD and weight_grad and self._weight_grad_transposed():
            shapes.append((g, c // g * kh * kw, o // g))  # every chunk's weight gradient, transposed
        elif phase == BACKWARD and weight_grad and (n > nb or ho > rb):
            shapes.append((g, o // g, c // g * kh * kw))  # weight gradient of a later chunk
        return shapes

    def _weight_grad_transposed(self):
        """True when the weight gradient's GEMM runs faster transposed (see
        TRANSPOSED_WEIGHT_GRAD_MAX_OUT)."""
        return self.out_channels // self.groups <= TRANSPOSED_WEIGHT_GRAD_MAX_OUT

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """Column matrix of one batch chunk, staging for its output, weight-gradient partial.

        See the module docstring; the direct 1x1 path needs no workspace in forward.
        """
        return scratch_bytes(*(numel(shape) * itemsize for shape in self._scratch_shapes(in_shapes, phase)))

    def cost(self, in_shapes, phase):
        """FLOPs of the GEMMs (2 per multiply-add) plus the bias; bytes of x, W, y (and grads)."""
        n, c, h, w, ho, wo = self._geometry(in_shapes)
        kh, kw = self.kernel
        gemm = 2 * n * self.out_channels * ho * wo * (c // self.groups) * kh * kw
        x_size, y_size = n * c * h * w, n * self.out_channels * ho * wo
        w_size = self.out_channels * (c // self.groups) * kh * kw
        bias = y_size if self.bias else 0  # bias add, or bias gradient sum
        if phase == BACKWARD:  # gx = col2im(W^T gy), gW = gy col^T, gb = sum gy
            return Cost(2 * gemm + bias, (2 * x_size + 2 * w_size + y_size) * FLOAT32_BYTES)
        return Cost(gemm + bias, (x_size + w_size + y_size) * FLOAT32_BYTES)

    # ---- im2col / col2im ---------------------------------------------------------------
    def _tap_slices(self, in_hw, out_hw, i, j, rows):
        """For kernel tap (i, j) and output rows [r0, r1): ((h0, h1), (w0, w1)), the output
        ranges (rows relative to r0) whose input lies inside x, and the (rows, cols) slices of
        x they read. Outside those ranges the tap reads padding."""
        out_ranges, in_slices = [], []
        bands = (rows, (0, out_hw[1]))
        for size, out_size, (b0, b1), tap, s, p, d in zip(
            in_hw, out_hw, bands, (i, j), self.stride, self.padding, self.dilation
        ):
            offset = tap * d - p
            lo, hi = _tap_range(size, out_size, offset, s)
            lo, hi = max(lo, b0), min(hi, b1)
            hi = max(hi, lo)
            out_ranges.append((lo - b0, hi - b0))
            start = lo * s + offset
            in_slices.append(slice(start, start + (hi - lo - 1) * s + 1, s) if hi > lo else slice(0, 0))
        return out_ranges, in_slices

    def _flat_rows(self, in_hw, out_hw):
        """True when stride is 1 and output rows are as wide as input rows ("same" width).

        Then a tap's band of output rows reads one contiguous span of the flattened input
        image, shifted by (i*dh - ph)*W + (j*dw - pw): one long copy per (channel, sample)
        instead of one short copy per row. The elements that wrap around a row edge land in
        the columns outside [w0, w1), which read padding and are zeroed.
        """
        return self.stride == (1, 1) and in_hw[1] == out_hw[1]

    def _flat_span(self, in_hw, i, j, h0, h1):
        """(a, b, shift): the flat output positions [a, b) of tap (i, j) in output rows
        [h0, h1) (absolute) whose flat input position a + shift, ... lies inside x."""
        h, w = in_hw
        shift = (i * self.dilation[0] - self.padding[0]) * w + j * self.dilation[1] - self.padding[1]
        return max(h0 * w, -shift), min(h1 * w, h * w - shift), shift

    @functools.lru_cache(maxsize=4096)
    def _tap_plan(self, in_hw, out_hw, rows):
        """Per tap (i, j), in order: (i, j, local ranges, input slices, flat span or None) for
        output rows [r0, r1). A pure function of the geometry, so computed once per chunk
        shape rather than once per chunk."""
        h, w = in_hw
        kh, kw = self.kernel
        r0 = rows[0]
        flat = self._flat_rows(in_hw, out_hw)
        plan = []
        for i in range(kh):
            for j in range(kw):
                ((h0, h1), (w0, w1)), slices = self._tap_slices(in_hw, out_hw, i, j, rows)
                span = None
                if flat and h1 > h0 and w1 > w0:
                    a, b, shift = self._flat_span(in_hw, i, j, r0 + h0, r0 + h1)
                    span = (a - r0 * w, b - r0 * w, a + shift, b + shift)
                plan.append((i, j, (h0, h1, w0, w1), tuple(slices), span))
        return tuple(plan)

    def _tap_blocks(self, x_shape, out_hw, col, rows):
        """Per tap: (dst, local ranges, input slices, flat span or None); dst (C, nb, rb, Wo)
        is the tap's block of `col` for the chunk of samples x_shape[0] and output rows."""
        n, c, h, w = x_shape
        kh, kw = self.kernel
        taps = col.reshape(c, kh, kw, n, rows[1] - rows[0], out_hw[1])
        for i, j, ranges, slices, span in self._tap_plan((h, w), tuple(out_hw), tuple(rows)):
            yield taps[:, i, j], ranges, slices, span

    def _im2col(self, x, out_hw, col, rows):
        """Fill `col` (C*kh*kw, nb*rb*Wo) from x (nb, C, H, W) for output rows [r0, r1)."""
        n, c, h, w = x.shape
        xt = x.transpose(1, 0, 2, 3)  # (C, nb, H, W) view
        xflat = x.reshape(n, c, h * w).transpose(1, 0, 2)  # (C, nb, H*W) view
        for dst, (h0, h1, w0, w1), (rs, cs), span in self._tap_blocks(x.shape, out_hw, col, rows):
            if span is not None:
                a, b, src_a, src_b = span
                dst.reshape(c, n, -1)[:, :, a:b] = xflat[:, :, src_a:src_b]
            elif h1 > h0 and w1 > w0:
                dst[:, :, h0:h1, w0:w1] = xt[:, :, rs, cs]
            _zero_outside(dst, h0, h1, w0, w1)

    def _col2im(self, col, gx, out_hw, rows):
        """gx (nb, C, H, W) += the adjoint of im2col applied to the column gradient in `col`.

        Each tap adds its (C, nb, rb, Wo) block into the strided window of gx it was read
        from. Consumes `col` (its padding entries are zeroed on the way).
        """
        n, c, h, w = gx.shape
        gxt = gx.transpose(1, 0, 2, 3)
        gxflat = gx.reshape(n, c, h * w).transpose(1, 0, 2)
        for src, (h0, h1, w0, w1), (rs, cs), span in self._tap_blocks(gx.shape, out_hw, col, rows):
            if span is not None:
                a, b, dst_a, dst_b = span
                _zero_outside(src, h0, h1, w0, w1)  # wrapped-around entries must add nothing
                gxflat[:, :, dst_a:dst_b] += src.reshape(c, n, -1)[:, :, a:b]
            elif h1 > h0 and w1 > w0:
                gxt[:, :, rs, cs] += src[:, :, h0:h1, w0:w1]

    # ---- kernels -----------------------------------------------------------------------
    def _chunks(self, ctx, x_shape, x, out_hw, phase, dtype):
        """Carve the workspace; return (staging, partial, chunks), chunks yielding
        (n0, n1, r0, r1, col) with col (C*kh*kw, GEMM columns) filled from x (left unfilled,
        as room for the column gradient, when x is None).

        staging (O, nb*rb*Wo) is None when chunks are single samples; partial (G, Og,
        Cg*kh*kw), or (G, Cg*kh*kw, Og) for a transposed weight gradient, is None in forward
        and when a weight gradient of one chunk goes straight into gW (or none is computed).
        On the direct 1x1 path col is x[n0] itself, (C, H*W), or None without x.
        """
        n, c = x_shape[:2]
        shapes = self._scratch_shapes([x_shape], phase, weight_grad=x is not None)
        buffers = [ctx.scratch(shape, dtype) for shape in shapes]
        col_buffer = None if self._is_direct(*out_hw) else buffers.pop(0)
        staging = buffers.pop(0) if self._chunking(n, c, *out_hw, phase)[0] > 1 else None
        partial = buffers.pop(0) if buffers else None

        def chunks():
            for n0, n1, r0, r1 in self._chunk_ranges(n, c, *out_hw, phase):
                if col_buffer is None:
                    yield n0, n1, r0, r1, None if x is None else x[n0].reshape(c, -1)
                    continue
                col = _prefix(col_buffer, (col_buffer.shape[0], (n1 - n0) * (r1 - r0) * out_hw[1]))
                if x is not None:
                    self._im2col(x[n0:n1], out_hw, col, (r0, r1))
                yield n0, n1, r0, r1, col

        return staging, partial, chunks()

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        """y (N, O, Ho, Wo) = conv(x (N, C, H, W), W (O, C/g, kh, kw)) + b (O,), chunk by chunk."""
        xp = ctx.xp
        x = xs[0]
        _, o, ho, wo = y.shape
        g = self.groups
        weight = params["weight"].reshape(g, o // g, -1)  # (G, Og, Cg*kh*kw)
        bias = params["bias"].reshape(o, 1, 1) if self.bias else None
        staging, _, chunks = self._chunks(ctx, x.shape, x, (ho, wo), FORWARD, x.dtype)
        for n0, n1, r0, r1, col in chunks:
            k, columns = n1 - n0, col.shape[1]
            cols = col.reshape(g, -1, columns)
            if staging is None:  # one sample: the GEMM writes the rows of y[n0] in place
                out = y[n0].reshape(o, ho * wo)[:, r0 * wo : r1 * wo]
                xp.matmul(weight, cols, out=out.reshape(g, o // g, columns))
            else:
                yt = _prefix(staging, (o, columns))
                xp.matmul(weight, cols, out=yt.reshape(g, o // g, columns))
                xp.copyto(y[n0:n1].reshape(k, o, ho * wo), yt.reshape(o, k, ho * wo).transpose(1, 0, 2))
            if bias is not None and r1 == ho:  # the chunk's samples are complete: one contiguous add
                y[n0:n1] += bias
        ctx.release_scratch()

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        """gb = sum_{n,h,w} gy; gW and gx by `adjoint`."""
        if self.bias:
            n, o = gy.shape[:2]
            ctx.xp.sum(gy.reshape(n, o, -1), axis=(0, 2), out=gparams["bias"])
        self.adjoint(ctx, gy, params["weight"], saved.xs[0], gparams["weight"], gxs[0])

    def adjoint(self, ctx, gy, weight, x=None, gweight=None, gx=None):
        """The products of backward, each where asked: gweight = sum over chunks of gy col^T
        (or of (col gy^T)^T, see _weight_grad_transposed; needs x) and gx = col2im(W^T gy), the
        transposed convolution of gy (needs no x). Shapes: gy (N, O, Ho, Wo), weight and gweight
        (O, C/g, kh, kw), x and gx (N, C, H, W). Chunks are whole samples (see `_chunking`).
        """
        xp = ctx.xp
        x_shape = (x if x is not None else gx).shape
        c = x_shape[1]
        _, o, ho, wo = gy.shape
        g, m = self.groups, ho * wo
        weight_t = weight.reshape(g, o // g, -1).transpose(0, 2, 1)  # (G, Cg*kh*kw, Og)
        staging, partial, chunks = self._chunks(ctx, x_shape, x, (ho, wo), BACKWARD, gy.dtype)
        for n0, n1, _, _, col in chunks:
            k = n1 - n0
            if staging is None:
                gyt = gy[n0].reshape(g, o // g, m)
            else:
                gyt = _prefix(staging, (o, k * m))
                xp.copyto(gyt.reshape(o, k, m), gy[n0:n1].reshape(k, o, m).transpose(1, 0, 2))
                gyt = gyt.reshape(g, o // g, k * m)
            if x is not None:
                self._add_weight_gradient(xp, col.reshape(g, -1, k * m), gyt, gweight.reshape(g, o // g, -1),
                                          partial, first=n0 == 0)
            if gx is None:
                continue
            if self._is_direct(ho, wo):  # the column gradient is the input gradient
                xp.matmul(weight_t, gyt, out=gx[n0].reshape(g, c // g, m))
                continue
            xp.matmul(weight_t, gyt, out=col.reshape(g, -1, k * m))  # column gradient, over col
            gx[n0:n1] = 0
            self._col2im(col, gx[n0:n1], (ho, wo), (0, ho))
        ctx.release_scratch()

    def _add_weight_gradient(self, xp, cols, gyt, gweight, partial, first):
        """gweight (G, Og, Cg*kh*kw) = (first chunk) or += gyt (G, Og, M) @ cols (G, Cg*kh*kw, M)^T."""
        if self._weight_grad_transposed():  # partial (G, Cg*kh*kw, Og)
            xp.matmul(cols, gyt.transpose(0, 2, 1), out=partial)
            if first:
                xp.copyto(gweight, partial.transpose(0, 2, 1))
            else:
                gweight += partial.transpose(0, 2, 1)
        else:
            xp.matmul(gyt, cols.transpose(0, 2, 1), out=gweight if first else partial)
            if not first:
                gweight += partial


@register
@dataclass(frozen=True)
class ConvTranspose2d(Layer):
    """The transposed convolution (torch.nn.ConvTranspose2d): the input gradient of a Conv2d,
    used as a layer. x (N, C, H, W), W (C, O/groups, kh, kw), b (O,), y (N, O, Ho, Wo) with
    Ho = (H - 1)*sh - 2*ph + dh*(kh - 1) + oph + 1 (likewise Wo).

    It is computed by `adjoint`, the Conv2d from y's shape to x's with the same kernel,
    stride, padding, dilation and groups: y = adjoint^T(x) (col2im of W^T x), and in backward
    gx = adjoint(gy) (its forward), gW = adjoint's weight gradient with gy as its input and x
    as its output gradient, gb = sum gy. Backward reads the input and the weight.
    `output_padding` (< stride) adds rows and columns at the bottom and right, as torch's
    does, to pick one of the output sizes a strided Conv2d maps to the same input size.
    """

    type_name = "ConvTranspose2d"
    recompute_cost = EXPENSIVE
    saves = Saves(inputs=(0,))
    out_channels: int  # required
    kernel: int | tuple = 3
    stride: int | tuple = 1
    padding: int | tuple = 0
    output_padding: int | tuple = 0
    dilation: int | tuple = 1
    groups: int = 1
    bias: bool = True

    def __post_init__(self):
        _check_options(self)
        _non_negative_pair(self, "padding")
        _non_negative_pair(self, "output_padding")
        if any(op >= s for op, s in zip(self.output_padding, self.stride)):
            raise ValueError(f"option 'output_padding' must be smaller than the stride {list(self.stride)}, "
                             f"got {list(self.output_padding)}")

    def adjoint_conv(self, in_shapes):
        """(the Conv2d from y's shape to x's, y's shape), after validating x's shape."""
        self.require_rank(in_shapes, 4)
        n, c, h, w = in_shapes[0]
        if c % self.groups:
            raise ShapeError(f"input channels {c} are not divisible by groups {self.groups}")
        if self.out_channels % self.groups:
            raise ShapeError(f"out_channels {self.out_channels} is not divisible by groups {self.groups}")
        out = tuple((size - 1) * s - 2 * p + d * (k - 1) + op + 1 for size, k, s, p, op, d in zip(
            (h, w), self.kernel, self.stride, self.padding, self.output_padding, self.dilation))
        if min(out) < 1:
            raise ShapeError(f"output spatial size {out[0]}x{out[1]} < 1: input {h}x{w} with padding "
                             f"{list(self.padding)} and kernel {list(self.kernel)}")
        conv = _adjoint_conv(c, self.kernel, self.stride, self.padding, self.dilation, self.groups)
        return conv, (n, self.out_channels, *out)

    def infer_shape(self, in_shapes):
        return self.adjoint_conv(in_shapes)[1]

    def param_specs(self, in_shapes):
        c = in_shapes[0][1]
        self.adjoint_conv(in_shapes)
        (kh, kw), (sh, sw), g = self.kernel, self.stride, self.groups
        # an output sums C/g channels over about ceil(kh/sh)*ceil(kw/sw) taps
        fan_in = c // g * -(-kh // sh) * -(-kw // sw)
        fan_out = self.out_channels // g * kh * kw
        specs = {"weight": ParamSpec((c, self.out_channels // g, kh, kw), "he_normal", fan_in, fan_out)}
        if self.bias:
            specs["bias"] = ParamSpec((self.out_channels,), "zeros", fan_in, fan_out, decay=False)
        return specs

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        """Forward: the adjoint's backward without a weight gradient; backward: the larger of
        the adjoint's forward (gx) and its weight gradient (they run one after the other)."""
        conv, y_shape = self.adjoint_conv(in_shapes)
        shapes = [y_shape]
        if phase == FORWARD:
            return scratch_bytes(*(numel(s) * itemsize for s in conv._scratch_shapes(shapes, BACKWARD, False)))
        return max(conv.workspace_bytes(shapes, FORWARD, itemsize), conv.workspace_bytes(shapes, BACKWARD, itemsize))

    def cost(self, in_shapes, phase):
        """The adjoint's cost with the roles of x and y exchanged (same GEMMs, same bytes)."""
        conv, y_shape = self.adjoint_conv(in_shapes)
        cost = conv.cost([y_shape], phase)
        bias = numel(y_shape) if self.bias else 0
        return Cost(cost.flops + bias, cost.bytes)

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        x = xs[0]
        conv, _ = self.adjoint_conv([x.shape])
        conv.adjoint(ctx, x, params["weight"], gx=y)
        if self.bias:
            y += params["bias"].reshape(-1, 1, 1)

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        x, gx = saved.xs[0], gxs[0]
        conv, _ = self.adjoint_conv([x.shape])
        if self.bias:
            ctx.xp.sum(gy.reshape(gy.shape[0], gy.shape[1], -1), axis=(0, 2), out=gparams["bias"])
        if gx is not None:
            conv.forward(ctx, [gy], {"weight": params["weight"]}, None, gx, None)
        conv.adjoint(ctx, x, params["weight"], x=gy, gweight=gparams["weight"])


@functools.lru_cache(maxsize=1024)
def _adjoint_conv(channels, kernel, stride, padding, dilation, groups):
    """The bias-free Conv2d with `channels` outputs whose input gradient a ConvTranspose2d is."""
    return Conv2d(out_channels=channels, kernel=kernel, stride=stride, padding=padding, dilation=dilation,
                  groups=groups, bias=False)
