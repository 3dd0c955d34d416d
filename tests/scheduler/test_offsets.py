"""The offsets greedy against its definition: largest first, each buffer at the lowest offset
where it overlaps no buffer placed before it that is alive at one of its steps."""

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from snrt.scheduler.offsets import BUCKET_STEPS, GREEDY_TIES, _largest_first, aligned


def lowest_free(size, start, end, placed):
    """The definition, checked against every offset where a placed block ends."""
    clashes = [(o, o + n) for s, e, o, n in placed if s <= end and start <= e]
    for offset in sorted({0, *(high for _, high in clashes)}):
        if all(offset + size <= low or offset >= high for low, high in clashes):
            return offset


intervals_of_buffers = st.lists(
    st.tuples(st.integers(1, 4000), st.integers(0, 6 * BUCKET_STEPS), st.integers(0, 3 * BUCKET_STEPS)),
    min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(intervals_of_buffers, st.sampled_from(range(len(GREEDY_TIES))))
def test_each_buffer_is_at_the_lowest_offset_free_over_its_steps(drawn, tie):
    buffers = [SimpleNamespace(nbytes=nbytes) for nbytes, _, _ in drawn]
    intervals = {b: (first, first + length) for b, (_, first, length) in enumerate(drawn)}
    offsets, top = _largest_first(buffers, intervals, GREEDY_TIES[tie])
    order = sorted(intervals, key=lambda b: (-aligned(buffers[b].nbytes), *GREEDY_TIES[tie](*intervals[b]), b))
    placed = []
    for b in order:
        start, end = intervals[b]
        size = aligned(buffers[b].nbytes)
        assert offsets[b] == lowest_free(size, start, end, placed)
        placed.append((start, end, offsets[b], size))
    assert top == max(o + n for _, _, o, n in placed)
