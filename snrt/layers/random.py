"""Counter-based random bits: the same (seed, iteration, node, element) always gives the same
value, on numpy and on cupy, so that a recomputed Dropout regenerates its mask exactly."""

from snrt.layers.base import scratch_bytes

MASK32 = 0xFFFFFFFF


def mix32(h):
    """murmur3's 32-bit finaliser of h's low 32 bits (a Python int; compiled, an int64 whose
    products may wrap, which leaves the low 32 bits kept the same)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & MASK32
    return h ^ (h >> 16)


def seed_hash(seed):
    """A 32-bit hash of every bit of the non-negative int `seed`, 32 at a time from the lowest
    (a seed below 2^32: mix32(seed))."""
    h = mix32(seed)
    while seed > MASK32:
        seed >>= 32
        h = mix32(h ^ seed)
    return h


def stream_key(seed, iteration, node_index):
    """A 32-bit key for one kernel call."""
    return mix32(mix32(seed_hash(seed) ^ iteration) + 0x9E3779B9 * (node_index + 1))


def random_bits_scratch_bytes(numel):
    """Workspace `fill_random_bits` needs for `numel` values (two uint32 arrays)."""
    return scratch_bytes(4 * numel, 4 * numel)


def fill_random_bits(ctx, numel):
    """A flat uint32 array (from ctx.scratch) of hashed counters for this call's key."""
    xp = ctx.xp
    h = ctx.scratch((numel,), "uint32")
    tmp = ctx.scratch((numel,), "uint32")
    h[...] = xp.arange(numel, dtype=xp.uint32)
    h *= xp.uint32(0x9E3779B1)
    h += xp.uint32(stream_key(ctx.seed, ctx.iteration, ctx.node_index))
    for shift, mult in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        xp.right_shift(h, shift, out=tmp)
        xp.bitwise_xor(h, tmp, out=h)
        if mult is not None:
            h *= xp.uint32(mult)
    return h
