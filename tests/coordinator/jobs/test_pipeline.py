"""Pipelined speculation's decisions (coordinator.jobs.pipeline), without a job or a ring.

Each test names the bug its decision guards. The decisions are pure: a round to send
ahead is a function of the committed context, the awaited chain, the rounds already in
flight, the planner's state and the caps; whether a round in flight is void is a
function of what was committed since. No engine, port or clock is involved.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given, strategies as st

from coordinator.jobs.pipeline import (
    Ahead, ahead_drafter, assumed_context, next_ahead, pipeline_depth, queued_rows, still_valid)
from coordinator.spec import adapt
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget, NgramDrafter
from tests.coordinator.jobs.test_pipelined_rounds import PROMPT, QUOTE, latency_bound_state

# Pooled acceptance (every source falls back to it): 0.95 pipelines deep on a WAN-like ring.
STATE = latency_bound_state({adapt.ALL_SOURCES: 0.95})


def sent(root: int, root_token: int, tokens: Sequence[int], *, epoch: int = 1, sent_s: float = 0.0) -> Ahead:
    return Ahead(round=1, epoch=epoch, tree=DraftTree.chain(tokens), root=root, root_token=root_token,
                 sent_s=sent_s, draft_s=0.0, queued_behind=0.0)


class EchoDrafter:
    """Guesses `guess` after any context, and keeps every context it was asked about."""

    name = "echo"

    def __init__(self, guess: Sequence[int]) -> None:
        self.guess, self.asked = list(guess), []

    def propose(self, context: Sequence[int], budget: DraftBudget) -> DraftTree:
        self.asked.append(list(context))
        return DraftTree.chain(self.guess[: budget.max_nodes])


class FeatureDrafter(EchoDrafter):
    aux_layers = (3,)  # reads the target's features, like EAGLE


def test_only_a_drafter_that_needs_no_target_features_drafts_ahead():
    # Bug guarded: asking EAGLE for a round past one whose features have not come back.
    eagle, ngram = FeatureDrafter([1, 2]), NgramDrafter()
    assert ahead_drafter([eagle, ngram]) is ngram
    assert ahead_drafter([eagle]) is None


def test_only_a_drafted_chain_is_extended_and_never_past_the_cap():
    # Bug guarded: a round sent after a tree (whose accepted path, hence bonus token, is
    # unknown) or after an undrafted round would be built on nothing.
    chain = DraftTree.chain([5, 6, 7])
    tree = DraftTree.from_branches([[5, 6], [5, 8], [9]], max_nodes=8)
    assert not tree.is_chain
    assert pipeline_depth(DraftTree.empty(), STATE, 4) == 1
    assert pipeline_depth(tree, STATE, 4) == 1
    assert pipeline_depth(chain, STATE, 1) == 1
    # Sound only while the planner itself wants a pipeline here, hence the first check.
    assert adapt.plan(STATE, adapt.AdaptConfig(max_pipeline_depth=4)).pipeline_depth >= 2
    assert 2 <= pipeline_depth(chain, STATE, 4) <= 4
    assert pipeline_depth(chain, STATE, 2) == 2


def test_the_next_round_assumes_every_round_before_it_accepted_whole():
    # Bug guarded: a round sent ahead drafted on the committed context alone (or placed its
    # root over a round still in flight) would verify tokens at the wrong slots.
    committed, base_root = [1, 2, 3], 2
    base = DraftTree.chain([4, 5])
    first = sent(root=5, root_token=6, tokens=[7, 8, 9])
    drafter = EchoDrafter([10, 11, 12])
    planned = next_ahead(drafter, committed, base, base_root, [first], STATE, depth=4, limit=4096)
    assert drafter.asked == [[1, 2, 3, 4, 5, 6, 7, 8, 9]]
    assert planned is not None
    # The guess's first token is the bonus it assumes; the rest is its chain.
    assert (planned.root, planned.root_token, planned.tree.tokens.tolist()[:1]) == (9, 10, [11])
    assert assumed_context(committed, base, base_root, []) == ([1, 2, 3, 4, 5], 5)


def test_nothing_is_sent_past_the_depth_or_the_context():
    drafter = EchoDrafter(list(range(50, 70)))
    base = DraftTree.chain([4, 5])
    full = [sent(root=5, root_token=6, tokens=[7])]
    assert next_ahead(drafter, [1, 2, 3], base, 2, full, STATE, depth=2, limit=4096) is None
    assert not drafter.asked  # a full pipeline does not even draft
    # The assumed context fills the limit: no room for a root, its chain and a bonus.
    assert next_ahead(drafter, [1, 2, 3], base, 2, [], STATE, depth=4, limit=7) is None
    planned = next_ahead(drafter, [1, 2, 3], base, 2, [], STATE, depth=4, limit=10)
    assert planned is not None and planned.root + 1 + planned.tree.num_nodes < 10


def test_a_quote_continues_from_the_awaited_chain():
    # The real drafter on the quoting prompt: the next round guesses the quote's next token.
    base = DraftTree.chain(QUOTE[4:6])
    planned = next_ahead(NgramDrafter(), PROMPT, base, len(PROMPT) - 1, [], STATE, depth=4, limit=4096)
    assert planned is not None and planned.root_token == QUOTE[6]
    assert planned.tree.tokens.tolist() == QUOTE[7:7 + planned.tree.num_nodes]


def test_a_round_in_flight_is_void_unless_its_assumption_happened():
    # Bug guarded: verifying a round whose assumed root token, slot, ring or K/V did not
    # happen would commit tokens the target never chose (lossless only if discarded).
    committed = [1, 2, 3, 4, 5, 6]  # the awaited round committed ..., 5 and bonus 6
    ok = sent(root=5, root_token=6, tokens=[7, 8])
    assert still_valid(ok, epoch=1, committed=committed, ring_ctx=5, pending_src=())
    assert not still_valid(ok, epoch=2, committed=committed, ring_ctx=5, pending_src=())  # another ring
    assert not still_valid(ok, epoch=1, committed=[*committed, 7], ring_ctx=5, pending_src=())  # root moved
    assert not still_valid(ok, epoch=1, committed=committed, ring_ctx=4, pending_src=())  # chain cut short
    assert not still_valid(ok, epoch=1, committed=[1, 2, 3, 4, 5, 9], ring_ctx=5, pending_src=())  # other bonus
    assert not still_valid(ok, epoch=1, committed=committed, ring_ctx=5, pending_src=(7,))  # a move it lacks


@given(st.lists(st.tuples(st.integers(0, 3), st.floats(0, 10), st.integers(0, 8)), max_size=6),
       st.integers(0, 3))
def test_a_round_queues_only_behind_rounds_on_its_own_ring(rounds, epoch):
    # Bug guarded: a fresh round on a new ring counted as queued behind rounds discarded on
    # the old one (they hold no slot of the new ring), which skews the measured queue.
    flight = [sent(0, 0, list(range(n)), epoch=e, sent_s=s) for e, s, n in rounds]
    assert queued_rows(flight, epoch) == [(s, n + 1) for e, s, n in rounds if e == epoch]
    assert queued_rows(flight) == [(s, n + 1) for _, s, n in rounds]
