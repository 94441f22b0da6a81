"""The prefill chunk plan (coordinator.jobs.prefill): what the engine sends for a prompt.

Guards the bugs a chunk plan can have and no output test would show cheaply: a gap or an
overlap between chunks (a token fed twice or never: the tail's logits then come from the
wrong context), a runt or an oversized frame, and a ramp that makes short prompts pay
for extra frames."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.jobs.prefill import prefill_chunks


@given(start=st.integers(0, 5000), n=st.integers(0, 9000), max_tokens=st.integers(1, 1024), edge=st.integers(1, 1024))
def test_chunks_tile_the_range_in_order_and_respect_the_largest_size(start, n, max_tokens, edge):
    bounds = prefill_chunks(start, start + n, max_tokens, edge)
    # Contiguous and covering: each chunk starts where the previous ended, first at start, last at end.
    edges = [start] + [b for _, b in bounds]
    assert [a for a, _ in bounds] == edges[:-1] and edges[-1] == start + n
    assert all(1 <= b - a <= max_tokens for a, b in bounds)
    # No more frames than a fixed-size split plus the two ramps (one per doubling from edge to max).
    doublings = max(0, (max_tokens - 1) // min(edge, max_tokens)).bit_length()
    assert len(bounds) <= -(-n // max_tokens) + 2 * doublings


@given(n=st.integers(1, 9000), max_tokens=st.integers(1, 1024), edge=st.integers(1, 1024))
def test_sizes_ramp_up_then_down_symmetrically_with_an_even_middle(n, max_tokens, edge):
    sizes = [b - a for a, b in prefill_chunks(0, n, max_tokens, edge)]
    ramp = 0
    while ramp < len(sizes) // 2 and sizes[ramp] < max_tokens and sizes[ramp] == sizes[-1 - ramp] == min(edge, max_tokens) << ramp:
        ramp += 1
    middle = sizes[ramp:len(sizes) - ramp]
    assert middle and max(middle) - min(middle) <= 1  # no runt chunk at the end
    assert sizes[:ramp] == sizes[::-1][:ramp]


def test_a_prompt_up_to_the_largest_chunk_is_one_frame():
    assert prefill_chunks(0, 256, 256, 64) == [(0, 256)]
    assert prefill_chunks(10, 11, 256, 64) == [(10, 11)]  # a decode round's single root token
    assert prefill_chunks(0, 2048, 2048, 64) == [(0, 2048)]  # "one blob" stays one blob
    assert prefill_chunks(5, 5, 256, 64) == []


def test_long_prompt_plan_and_plain_fixed_chunks():
    sizes = [b - a for a, b in prefill_chunks(0, 2048, 256, 64)]
    assert sizes == [64, 128, 238, 238, 238, 238, 238, 237, 237, 128, 64]
    assert [b - a for a, b in prefill_chunks(0, 2048, 256, 256)] == [256] * 8  # edge >= max: fixed size
    assert [b - a for a, b in prefill_chunks(0, 600, 256, 256)] == [200, 200, 200]


def test_sizes_below_one_are_refused():
    with pytest.raises(ValueError, match="chunk sizes must be >= 1"):
        prefill_chunks(0, 10, 0, 4)
