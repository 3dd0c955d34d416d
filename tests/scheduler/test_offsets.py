"""Offset assignment: the greedy's placement rule against its definition, and packings that
never let two buffers alive at one step share a byte."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from snrt.scheduler.offsets import lowest_offsets

BLOCKS = st.lists(st.tuples(st.integers(1, 9), st.integers(0, 12), st.integers(0, 12)), max_size=40)


def lowest_by_definition(sizes, firsts, lasts):
    """Each block at the smallest offset >= 0, among 0 and the tops of the blocks before it,
    that overlaps no earlier block alive at one of its steps."""
    offsets = []
    for i, (size, first, last) in enumerate(zip(sizes, firsts, lasts)):
        alive = [(offsets[j], offsets[j] + sizes[j]) for j in range(i) if firsts[j] <= last and lasts[j] >= first]
        candidates = sorted({0, *(high for _, high in alive)})
        offsets.append(next(c for c in candidates if all(c + size <= low or c >= high for low, high in alive)))
    return offsets


@settings(max_examples=300, deadline=None)
@given(BLOCKS)
def test_each_block_goes_to_the_lowest_offset_free_over_its_steps(blocks):
    sizes = np.array([size for size, _, _ in blocks], np.int64)
    firsts = np.array([min(a, b) for _, a, b in blocks], np.int64)
    lasts = np.array([max(a, b) for _, a, b in blocks], np.int64)
    offsets = lowest_offsets(sizes, firsts, lasts)
    assert offsets.tolist() == lowest_by_definition(sizes.tolist(), firsts.tolist(), lasts.tolist())
    for i in range(len(blocks)):  # no two blocks alive at one step share a byte
        for j in range(i):
            if firsts[j] <= lasts[i] and lasts[j] >= firsts[i]:
                assert offsets[i] + sizes[i] <= offsets[j] or offsets[i] >= offsets[j] + sizes[j]


def test_a_block_takes_a_gap_that_blocks_alive_at_other_steps_leave():
    # A (2 bytes, steps 0-3) at 0; B (4, steps 0-1) above it at 2; C (3, steps 0-3) above B at 6;
    # D (4, steps 2-3) meets A and C only: the gap [2, 6) that B leaves at steps 2-3 holds it
    sizes, firsts, lasts = (np.array(values, np.int64) for values in ([2, 4, 3, 4], [0, 0, 0, 2], [3, 1, 3, 3]))
    assert lowest_offsets(sizes, firsts, lasts).tolist() == [0, 2, 6, 2]
