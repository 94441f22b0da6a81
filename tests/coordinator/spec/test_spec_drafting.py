"""The n-gram / prompt-lookup drafter: longest earlier match, branches, incremental index."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.spec.drafting import DraftBudget, NgramConfig, NgramDrafter
from coordinator.spec.source import DraftSource


def test_longest_suffix_match_wins_and_names_its_length():
    ctx = [9, 1, 2, 3, 7, 7, 2, 3, 8, 8, 1, 2, 3]
    tree = NgramDrafter(NgramConfig(max_n=3, max_branches=1)).propose(ctx, DraftBudget.chain(3))
    # "1 2 3" occurred at the start (followed by 7 7 2); "2 3" alone is more recent (8 8 1).
    assert tree.tokens.tolist() == [7, 7, 2] and tree.source == DraftSource("ngram", "3")


def test_several_occurrences_become_branches_most_recent_first():
    ctx = [1, 2, 5, 6, 1, 2, 7, 8, 1, 2]
    tree = NgramDrafter(NgramConfig(max_n=2)).propose(ctx, DraftBudget(max_nodes=10, max_depth=2))
    assert [tree.path_tokens(p[-1]) for p in tree.paths()] == [[7, 8], [5, 6]]
    assert tree.parents.tolist() == [-1, 0, -1, 2]


def test_drafts_carry_the_drafters_name_as_their_source_family():
    # Bug guarded: the engine plans each drafter by the acceptance of `drafter.name`; a
    # drafter without a name was planned by every drafter's pooled acceptance.
    drafter = NgramDrafter()
    for ctx in ([1, 2, 3, 1, 2], [1, 2, 3]):
        assert drafter.propose(ctx, DraftBudget.chain(3)).source.family == drafter.name == "ngram"


def test_repeating_run_continues_periodically():
    # The only earlier match ends one token before the end; the continuation must not be
    # cut short at the end of the context.
    tree = NgramDrafter().propose([4, 5, 4, 5, 4, 5], DraftBudget.chain(5))
    assert tree.tokens.tolist() == [4, 5, 4, 5, 4]


def test_no_match_and_zero_budget_give_an_empty_draft():
    drafter = NgramDrafter()
    assert drafter.propose([1, 2, 3], DraftBudget.chain(4)).num_nodes == 0
    assert drafter.propose([1, 2, 1, 2], DraftBudget.chain(0)).num_nodes == 0


def test_index_is_incremental_and_resets_for_a_new_context():
    # Bug guarded: re-indexing the whole context every round (O(context) per call), or
    # keeping a stale index when a different request reuses the drafter.
    drafter = NgramDrafter()
    ctx = [1, 2, 3, 1, 2]
    drafter.propose(ctx, DraftBudget.chain(2))
    size = len(drafter._index)
    drafter.propose(ctx, DraftBudget.chain(2))
    assert len(drafter._index) == size  # nothing new to index
    ctx = ctx + [3, 9]
    assert drafter.propose(ctx, DraftBudget.chain(2)).num_nodes == 0  # "9" unseen
    assert drafter.propose([5, 6, 5], DraftBudget.chain(1)).tokens.tolist() == [6]
    assert drafter._context == [5, 6, 5]


def naive(ctx: list[int], config: NgramConfig, depth: int) -> list[int] | None:
    """Brute-force prompt lookup: longest n, most recent earlier occurrence."""
    for n in range(min(config.max_n, len(ctx)), config.min_n - 1, -1):
        suffix = ctx[len(ctx) - n :]
        for end in range(len(ctx) - 1, n - 1, -1):
            if ctx[end - n : end] == suffix:
                out = []
                for j in range(depth):
                    out.append(ctx[end + j] if end + j < len(ctx) else out[j - (len(ctx) - end)])
                return out
    return None


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=1, max_size=40), st.integers(1, 6))
def test_first_branch_matches_brute_force_as_the_context_grows(tokens, depth):
    # Sound: an independent quadratic search over the whole context; fed token by token
    # so the incremental index is exercised at every length.
    config = NgramConfig(max_n=3, positions_per_ngram=64)
    drafter = NgramDrafter(config)
    for t in range(1, len(tokens) + 1):
        tree = drafter.propose(tokens[:t], DraftBudget(max_nodes=4 * depth, max_depth=depth))
        expected = naive(tokens[:t], config, depth)
        got = tree.path_tokens(tree.paths()[0][-1]) if tree.num_nodes else None
        assert got == expected


def test_config_is_validated():
    with pytest.raises(ValueError, match="min_n <= max_n"):
        NgramConfig(max_n=1, min_n=2)
