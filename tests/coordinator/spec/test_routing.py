"""The router: which competing draft (n-gram, EAGLE, their merge) a round verifies, and
when another drafter is not worth asking (coordinator/spec/routing.py)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.spec.adapt import AcceptanceStats, AdaptState, expected_tokens_chain, traversal_line
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.routing import DraftCandidate, merged_expected_tokens, route, side_draft_can_pay
from coordinator.spec.source import DraftSource
from tests.coordinator.spec.test_spec_adapt import _timed_state


def test_router_prefers_a_trusted_free_ngram_match_and_falls_back_to_eagle():
    ngram = DraftCandidate(DraftTree.chain([1, 2, 3, 4, 5, 6], source=DraftSource("ngram", "4")), draft_s=0.0)
    eagle = DraftCandidate(DraftTree.chain([7, 8, 9, 10], source=DraftSource("eagle")), draft_s=0.02)
    state = AdaptState(acceptance={DraftSource("ngram", "4"): AcceptanceStats(0.9, 1.0), DraftSource("eagle"): AcceptanceStats(0.7, 1.0)})
    assert route([eagle, ngram], state) == 1
    state = AdaptState(acceptance={DraftSource("ngram", "4"): AcceptanceStats(0.1, 1.0), DraftSource("eagle"): AcceptanceStats(0.7, 1.0)})
    assert route([eagle, ngram], state) == 0
    with pytest.raises(ValueError, match="at least one candidate"):
        route([], state)


def test_merged_expectation_adds_exclusive_branches_and_counts_shared_nodes_once():
    # Two parts whose first nodes differ are exclusive (the target takes one child): their
    # chances add. A node both parts hold counts once, at the higher estimate.
    merged, where = DraftTree.merge([DraftTree.chain([1, 2]), DraftTree.chain([3])], source=DraftSource("merged"))
    assert merged_expected_tokens([[0.5, 0.25], [0.3]], where, merged.num_nodes) == pytest.approx(1 + 0.5 + 0.25 + 0.3)
    merged, where = DraftTree.merge([DraftTree.chain([1, 2]), DraftTree.chain([1, 4])], source=DraftSource("merged"))
    assert merged.num_nodes == 3
    assert merged_expected_tokens([[0.5, 0.25], [0.6, 0.1]], where, 3) == pytest.approx(1 + 0.6 + 0.25 + 0.1)


@given(st.floats(0.05, 0.99), st.integers(1, 12), st.floats(1.0, 6.0), st.floats(0.0, 0.1))
@settings(max_examples=200, deadline=None)
def test_side_draft_bound_is_never_below_the_merge_it_bounds(a, k, side_tokens, side_s):
    # Sound: whatever the side drafter's nodes, merged with a chain they only add where the
    # chain's path is rejected. Take the best such side draft: at each rejection point
    # along the chain, a subtree worth side_tokens - 1 given that point is reached. Its
    # merged rate may not exceed what side_draft_can_pay compares against.
    state = _timed_state(0.2, 0.003, acceptance={DraftSource("ngram", "4"): AcceptanceStats(a, 1.0)})
    chain = DraftTree.chain(list(range(1, k + 1)), source=DraftSource("ngram", "4"))
    reach = [1.0] + [a**d for d in range(1, k + 1)]  # the chain's prefix of length d is accepted
    # At depth d the chain's next node is rejected with probability reach[d] * (1 - a).
    side_extra = sum(reach[d] * (1 - a) for d in range(k)) * (side_tokens - 1)
    assert side_extra == pytest.approx((1 - a**k) * (side_tokens - 1))
    best = DraftCandidate(chain)
    fixed, per_row = traversal_line(state)
    round_s = fixed + per_row * (k + 1)
    merged_rate = (expected_tokens_chain(a, k) + side_extra) / (round_s + side_s + per_row)
    if merged_rate > expected_tokens_chain(a, k) / round_s:
        assert side_draft_can_pay(best, side_tokens, side_s, state)
