"""Inverted dropout with a mask regenerated from (seed, iteration, node), never stored:
per element (Dropout) or per channel (Dropout2d)."""

from dataclasses import dataclass

from snrt.layers.base import FLOAT32_BYTES, Cost, Layer, numel, scratch_bytes
from snrt.layers.random import fill_random_bits, random_bits_scratch_bytes
from snrt.layers.registry import register


@register
@dataclass(frozen=True)
class Dropout(Layer):
    """Training: y = x * m / (1 - p), m ~ Bernoulli(1 - p) per element; eval: y = x.

    The mask comes from a counter-based hash, so backward (and a recomputed forward) rebuild
    it instead of reading a saved one: backward reads nothing but gy.
    """

    type_name = "Dropout"
    p: float = 0.5

    def __post_init__(self):
        if isinstance(self.p, bool) or not isinstance(self.p, (int, float)) or not 0 <= self.p < 1:
            raise ValueError(f"option 'p' must be a number in [0, 1), got {self.p!r}")

    @staticmethod
    def mask_group(shape):
        """Consecutive elements of an x of `shape` that share one mask entry (one per element)."""
        return 1

    @property
    def threshold(self):
        """An element is kept when its 32 random bits are >= this (probability 1 - p)."""
        return min(int(round(self.p * 2**32)), 2**32 - 1)

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        return random_bits_scratch_bytes(numel(in_shapes[0]))

    def _write_scaled_mask(self, ctx, out):
        """out <- mask / (1 - p) with the mask of this (seed, iteration, node)."""
        bits = fill_random_bits(ctx, out.size)
        ctx.xp.greater_equal(bits, ctx.xp.uint32(self.threshold), out=out.reshape(-1))
        out *= 1.0 / (1.0 - self.p)
        ctx.release_scratch()

    def forward(self, ctx, xs, params, state, y, aux, recompute=False):
        if not ctx.training or self.p == 0:
            y[...] = xs[0]
            return
        self._write_scaled_mask(ctx, y)
        y *= xs[0]

    def backward(self, ctx, gy, saved, params, aux, gxs, gparams):
        gx = gxs[0]
        if gx is None:
            return
        if not ctx.training or self.p == 0:
            gx[...] = gy
            return
        self._write_scaled_mask(ctx, gx)
        gx *= gy

    def cost(self, in_shapes, phase):
        base = super().cost(in_shapes, phase)
        return Cost(base.flops * 8, base.bytes)  # about 8 integer ops per element for the hash



@register
@dataclass(frozen=True)
class Dropout2d(Dropout):
    """Channel dropout (PyTorch's Dropout2d): training y = x * m / (1 - p) with one
    m ~ Bernoulli(1 - p) per (sample, channel) of (N, C, H, W), shared by the whole feature
    map; eval y = x. The (N, C) mask is rebuilt, never stored: backward reads nothing but gy."""

    type_name = "Dropout2d"

    def infer_shape(self, in_shapes):
        self.require_rank(in_shapes, 4)
        return tuple(in_shapes[0])

    @staticmethod
    def mask_group(shape):
        """A whole feature map, H*W elements, shares its channel's mask entry."""
        return numel(shape[2:])

    def workspace_bytes(self, in_shapes, phase, itemsize=FLOAT32_BYTES):
        channels = numel(in_shapes[0][:2])
        return scratch_bytes(channels * itemsize, random_bits_scratch_bytes(channels))

    def _write_scaled_mask(self, ctx, out):
        """out (N, C, H, W) <- this (seed, iteration, node)'s (N, C) mask / (1 - p), broadcast
        over H, W (Dropout's forward and backward then multiply it in)."""
        n, c = out.shape[:2]
        mask = ctx.scratch((n, c), out.dtype)
        bits = fill_random_bits(ctx, n * c)
        ctx.xp.greater_equal(bits, ctx.xp.uint32(self.threshold), out=mask.reshape(-1))
        mask *= 1.0 / (1.0 - self.p)
        out[...] = mask[:, :, None, None]
        ctx.release_scratch()
