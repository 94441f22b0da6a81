"""coordinator.spec.draft_round: one round's draft from several drafters (hybrid).

Guards the router's third option: when an n-gram match and EAGLE disagree, verifying both
trees merged costs a few ring rows and commits whichever is right, so with cheap rows the
merge must be offered and win; with dear rows the cheaper single draft must win. Sound:
the drafters are stubs with fixed drafts, the planner state is set by hand.
"""

from __future__ import annotations

import math

import torch

from coordinator.spec.adapt import AcceptanceStats, AdaptState, TraversalFit
from coordinator.spec.draft_round import MERGED_SOURCE, draft_round
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.source import DraftSource


class FixedDrafter:
    def __init__(self, name: str, tree: DraftTree, confidence: bool = False) -> None:
        self.name, self.tree, self.confidence = name, tree, confidence

    def propose(self, context_ids, budget) -> DraftTree:
        return self.tree


NGRAM = DraftTree.chain([1, 2, 3], source=DraftSource("ngram", "3"))
EAGLE = DraftTree(torch.tensor([5, 6, 7]), torch.tensor([-1, -1, 0]),
                  logprobs=torch.log(torch.tensor([0.6, 0.3, 0.8])), source=DraftSource("eagle", "tree"))


def state(per_row_s: float, ngram_rate: float = 0.7) -> AdaptState:
    # A traversal line t = 0.2 s + per_row_s * rows, as if fitted from rounds of 1 and 9 rows.
    n, t = [1.0, 9.0], [0.2 + per_row_s, 0.2 + 9 * per_row_s]
    fit = TraversalFit(sum(n) / 2, sum(t) / 2, sum(x * x for x in n) / 2, sum(x * y for x, y in zip(n, t)) / 2)
    rate = AcceptanceStats(ngram_rate, 1.0)
    return AdaptState(acceptance={DraftSource("ngram", "3"): rate, DraftSource("ngram"): rate}, traversal=fit, rounds=10)


def drafters(eagle: DraftTree = EAGLE):
    return [FixedDrafter("ngram", NGRAM), FixedDrafter("eagle", eagle, confidence=True)]


def test_cheap_rows_verify_both_drafts_merged():
    tree, _, _ = draft_round(drafters(), [9, 9, 9], state(per_row_s=0.001), room=64, max_pipeline_depth=1, undrafted_rounds=0)
    assert tree.source == MERGED_SOURCE
    assert [p.source for p in tree.merged_from] == [DraftSource("ngram", "3"), DraftSource("eagle", "tree")]
    paths = {tuple(tree.path_tokens(i)) for i in range(tree.num_nodes)}
    assert {(1,), (1, 2), (1, 2, 3)} <= paths and (5,) in paths


def test_dear_rows_keep_a_single_draft():
    # 0.1 s a row over 0.2 s: a trusted n-gram chain makes 3.71 tokens in 0.6 s (6.2/s);
    # EAGLE's one node (0.4 tokens after calibration) pays alone (1.4 in 0.4 s beats 1 in
    # 0.3 s) but not on top of the chain (4.11 in 0.7 s: 5.9/s).
    weak = DraftTree.chain([5], logprobs=torch.log(torch.tensor([0.5])), source=DraftSource("eagle", "chain"))
    tree, draft_s, skipped = draft_round(drafters(weak), [9, 9, 9], state(per_row_s=0.1, ngram_rate=0.95), room=64,
                                max_pipeline_depth=1, undrafted_rounds=0)
    assert tree.source == DraftSource("ngram", "3") and not tree.merged_from
    assert math.isfinite(draft_s) and draft_s >= 0


class EvidenceDrafter:
    """Drafts a chain as long as it is allowed, naming its evidence as n-gram drafts do."""

    name = "ngram"

    def __init__(self, source: DraftSource) -> None:
        self.source, self.budgets = source, []

    def propose(self, context_ids, budget) -> DraftTree:
        self.budgets.append(budget)
        return DraftTree.chain(list(range(10, 10 + budget.max_nodes)), source=self.source)


def test_a_draft_is_shaped_by_its_own_evidence_not_its_drafters_average():
    # n-gram drafts from 1-token matches are mostly wrong and 4-token ones mostly right;
    # sized by the family's average, the first waste ring rows and the second stop short.
    rates = {DraftSource("ngram"): AcceptanceStats(0.6, 1.0), DraftSource("ngram", "1"): AcceptanceStats(0.05, 1.0),
             DraftSource("ngram", "4"): AcceptanceStats(0.95, 1.0)}
    planned = AdaptState(acceptance=rates, traversal=state(per_row_s=0.05).traversal, rounds=10)
    lengths = {}
    for source in (DraftSource("ngram", "1"), DraftSource("ngram", "4")):
        drafter = EvidenceDrafter(source)
        tree, _, _ = draft_round([drafter], [9, 9], planned, room=64, max_pipeline_depth=1, undrafted_rounds=0)
        lengths[source] = tree.num_nodes
        family_nodes = drafter.budgets[0].max_nodes
    assert lengths[DraftSource("ngram", "1")] < family_nodes < lengths[DraftSource("ngram", "4")], (lengths, family_nodes)
    # ...but poor evidence still sends one node, so its estimate can recover
    assert lengths[DraftSource("ngram", "1")] == 1


def test_strong_evidence_drafts_where_the_drafters_average_says_no_draft_pays():
    # Bug guarded: hybrid asked the n-gram drafter nothing once its family's average (pulled
    # down by 1-token matches on open-ended text) said no draft pays, and since EAGLE
    # drafted every round the probe never came: on a quoting prompt the 4-token matches
    # went unused. Sound: the family average alone gives no draft; each evidence's own
    # record decides, and evidence never sent gets one try.
    rates = {DraftSource("ngram"): AcceptanceStats(0.02, 1.0), DraftSource("ngram", "1"): AcceptanceStats(0.02, 1.0),
             DraftSource("ngram", "4"): AcceptanceStats(0.95, 1.0)}
    planned = AdaptState(acceptance=rates, traversal=state(per_row_s=0.05).traversal, rounds=10)
    sizes = {}
    for source in (DraftSource("ngram", "1"), DraftSource("ngram", "4"), DraftSource("ngram", "3")):
        tree, _, _ = draft_round([EvidenceDrafter(source)], [9, 9], planned, room=64, max_pipeline_depth=1,
                                 undrafted_rounds=0)
        sizes[source] = tree.num_nodes
    assert sizes[DraftSource("ngram", "1")] == 0 and sizes[DraftSource("ngram", "4")] > 2 and sizes[DraftSource("ngram", "3")] >= 1, sizes


class CountingConfident(FixedDrafter):
    """A confident drafter with a record: its family's acceptance and its drafting time."""

    def __init__(self, tree: DraftTree, propose_s: float | None) -> None:
        super().__init__("eagle", tree, confidence=True)
        self.propose_s, self.calls = propose_s, 0

    def propose(self, context_ids, budget) -> DraftTree:
        self.calls += 1
        return self.tree


def test_a_confident_side_drafter_is_skipped_only_when_it_cannot_pay():
    # Sound: a trusted 8-token n-gram chain (0.97 a node) commits 7.1 tokens a round; EAGLE,
    # which lately committed 1.8 tokens a round and drafts in 30 ms, could add at most
    # (1 - 0.97^8) * 0.8 = 0.17 tokens merged: not worth 30 ms of a 0.23 s round. With a
    # weak 1-node match (0.3) EAGLE can pay, so it still drafts; without a record (no
    # acceptance or drafting time yet) it always drafts.
    long_match = DraftTree.chain(list(range(1, 9)), source=DraftSource("ngram", "4"))
    short_match = DraftTree.chain([1], source=DraftSource("ngram", "1"))
    base = state(per_row_s=0.003)
    eagle_stats = {DraftSource("eagle"): AcceptanceStats(0.8, 3.0)}
    for match, rate, record, drafts in ((long_match, 0.97, True, False), (short_match, 0.3, True, True),
                                        (long_match, 0.97, False, True)):
        acceptance = {match.source: AcceptanceStats(rate, 1.0), DraftSource("ngram"): AcceptanceStats(rate, 1.0)}
        planned = AdaptState(acceptance=acceptance | (eagle_stats if record else {}), traversal=base.traversal,
                             rounds=10)
        eagle = CountingConfident(EAGLE, 0.03 if record else None)
        tree, _, skipped = draft_round([FixedDrafter("ngram", match), eagle], [9, 9, 9], planned, room=64,
                              max_pipeline_depth=1, undrafted_rounds=0)
        assert eagle.calls == int(drafts), (match.source, record)
        assert skipped == (() if drafts else ("eagle",))
        if not drafts:
            assert tree.source == DraftSource("ngram", "4")
