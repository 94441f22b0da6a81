"""choose_ring: a request goes to the ring that predicts its earliest completion (issue 21).

Bugs guarded: a request routed to a broken or re-forming ring, to a slower ring while a
faster one idles, or piled onto one ring while another has room; a choice that depends on
the order rings are listed. Sound: examples pin each rule; the properties check, over
random pools, that the chosen ring's prediction is the minimum among ready rings, that
adding load to a ring never makes it win, and that listing order does not matter.
"""

from __future__ import annotations

from dataclasses import replace

from hypothesis import given, strategies as st

from coordinator.jobs.ring_choice import RingLoad, choose_ring, predicted_completion_s

FAST = RingLoad("a", True, round_s=0.1, prefill_s_per_token=0.001, running=0, max_batch=16)
SLOW = RingLoad("b", True, round_s=0.3, prefill_s_per_token=0.003, running=0, max_batch=16)


def test_no_ready_ring_is_no_choice_and_a_broken_ring_is_never_chosen():
    assert choose_ring([], 10, 10) is None
    assert choose_ring([replace(FAST, ready=False)], 10, 10) is None
    assert choose_ring([replace(FAST, ready=False), SLOW], 10, 10) == "b"


def test_the_faster_ring_wins_until_its_batch_is_full_and_its_queue_long():
    assert choose_ring([FAST, SLOW], 100, 64) == "a"
    # A batch with room costs nothing to join.
    assert choose_ring([replace(FAST, running=15), SLOW], 100, 64) == "a"
    # Full, and 16 x 64 tokens owed ahead: 64 rounds' wait, so the idle slow ring finishes first.
    busy = replace(FAST, running=16, owed_tokens=16 * 64 * 3)
    assert predicted_completion_s(busy, 100, 64) > predicted_completion_s(SLOW, 100, 64)
    assert choose_ring([busy, SLOW], 100, 64) == "b"


def test_prompts_still_to_prefill_ahead_count_as_wait():
    # A ring whose one job still has 1900 prompt tokens to prefill (at 10 ms a token) is
    # busier than one whose job owes 64 tokens at 0.1 s: 19 + 1.6 s against 6.4 s.
    long_ahead = replace(FAST, prefill_s_per_token=0.01, running=1, max_batch=1, owed_tokens=16,
                         owed_prefill_tokens=1900)
    decoding = replace(FAST, ring_id="b", prefill_s_per_token=0.01, running=1, max_batch=1, owed_tokens=64)
    assert choose_ring([long_ahead, decoding], 10, 64) == "b"
    assert choose_ring([replace(long_ahead, owed_prefill_tokens=0), decoding], 10, 64) == "a"


rings = st.builds(RingLoad, ring_id=st.sampled_from("abcdef"), ready=st.booleans(),
                  round_s=st.floats(0.01, 2.0), prefill_s_per_token=st.floats(0.0, 0.01),
                  running=st.integers(0, 40), max_batch=st.integers(1, 32), waiting=st.integers(0, 40),
                  owed_tokens=st.integers(0, 10_000), owed_prefill_tokens=st.integers(0, 10_000))


@given(st.lists(rings, max_size=6, unique_by=lambda r: r.ring_id), st.integers(1, 4000), st.integers(1, 512),
       st.randoms())
def test_properties(pool, prompt_tokens, max_tokens, rnd):
    chosen = choose_ring(pool, prompt_tokens, max_tokens)
    ready = [r for r in pool if r.ready]
    if not ready:
        assert chosen is None
        return
    by_id = {r.ring_id: r for r in pool}
    best = min(predicted_completion_s(r, prompt_tokens, max_tokens) for r in ready)
    assert by_id[chosen].ready and predicted_completion_s(by_id[chosen], prompt_tokens, max_tokens) == best
    shuffled = list(pool)
    rnd.shuffle(shuffled)
    assert choose_ring(shuffled, prompt_tokens, max_tokens) == chosen  # listing order does not matter
    for other in ready:  # more load on a ring that lost never makes it win
        if other.ring_id != chosen:
            loaded = replace(other, running=other.running + 1, waiting=other.waiting + 1,
                             owed_tokens=other.owed_tokens + max_tokens,
                             owed_prefill_tokens=other.owed_prefill_tokens + prompt_tokens)
            assert choose_ring([loaded if r is other else r for r in pool], prompt_tokens, max_tokens) == chosen
