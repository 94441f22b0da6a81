"""Choosing among competing drafts for the next round: which one, and whether another
drafter is worth asking at all.

`route` scores each candidate (an n-gram chain, an EAGLE chain or tree, their merge) by
expected committed tokens per second of round time, with `coordinator.spec.adapt`'s models:
the rank model at the candidate source's recent acceptance, or a confident drafter's own
estimate, and the measured traversal line. Merged drafts (hybrid): parts that branch
apart are exclusive (the target takes one child), so the merge's expected tokens are
1 + the sum over its nodes of the best per-node chance any part gives; after the round
each part is judged on its own nodes (`adapt.RoundVerified.parts`), so every drafter's
statistics stay its own.

Pure functions; this module does not draft, send or verify.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from coordinator.spec.adapt import AdaptConfig, AdaptState, acceptance_rate, expected_tokens, rank_reach, traversal_line
from coordinator.spec.draft_tree import DraftTree


def merged_expected_tokens(reach: Sequence[Sequence[float]], where: Sequence[Sequence[int]], nodes: int) -> float:
    """Expected tokens of a merged draft (`DraftTree.merge`): 1 + the sum over its nodes of
    the likeliest acceptance any part gives that node. Parts that branch apart at a node
    are exclusive (the target takes one child), so their nodes' chances add; a node two
    parts share counts once, at the higher estimate."""
    best = [0.0] * nodes
    for part_reach, part_where in zip(reach, where):
        for r, node in zip(part_reach, part_where):
            best[node] = max(best[node], r)
    return 1.0 + sum(best)


@dataclass(frozen=True)
class DraftCandidate:
    """A draft one drafter offers for the next round and what drafting it cost."""

    tree: DraftTree
    draft_s: float = 0.0
    expected: float | None = None  # expected tokens, when the drafter's confidence gave it


def side_draft_can_pay(best: DraftCandidate, side_tokens: float, side_draft_s: float, state: AdaptState,
                       config: AdaptConfig = AdaptConfig()) -> bool:
    """Whether another drafter, whose rounds lately committed `side_tokens` tokens each
    (its accepted nodes plus the bonus) and whose draft takes `side_draft_s`, could beat
    the chain `best` alone, either by itself or merged with it. Merged, it adds tokens
    only where `best` is rejected, so at most (1 - P(best accepted whole)) * (side_tokens - 1);
    both bounds leave out the side draft's ring rows, so False means it cannot pay under
    this model and need not be drafted (a long trusted n-gram match: EAGLE's tree would
    cost its drafting time for a few hundredths of a token)."""
    if not best.tree.is_chain or not best.tree.num_nodes:
        return True
    fixed_s, per_row_s = traversal_line(state, config)
    expected, round_s = candidate_round(best, state, config)
    whole = rank_reach(best.tree, acceptance_rate(state, best.tree.source, config))[-1]
    merged = (expected + (1 - whole) * max(0.0, side_tokens - 1)) / (round_s + side_draft_s)
    alone = side_tokens / (side_draft_s + fixed_s + per_row_s * 2)
    return max(merged, alone) > expected / round_s


def candidate_round(c: DraftCandidate, state: AdaptState, config: AdaptConfig = AdaptConfig()) -> tuple[float, float]:
    """(expected tokens, seconds of round time) of verifying `c`: its drafter's own
    estimate when it gave one, else the rank model at its source's recent acceptance."""
    fixed_s, per_row_s = traversal_line(state, config)
    expected = c.expected if c.expected is not None else expected_tokens(
        c.tree, acceptance_rate(state, c.tree.source, config))
    return expected, c.draft_s + fixed_s + per_row_s * (c.tree.num_nodes + 1)


def route(candidates: Sequence[DraftCandidate], state: AdaptState, config: AdaptConfig = AdaptConfig()) -> int:
    """Index of the candidate with the most expected tokens per second of round time,
    using each drafter's own recent acceptance (keyed by `tree.source`, so an n-gram
    draft from a 4-token match is judged by how 4-token matches have fared)."""
    if not candidates:
        raise ValueError("route needs at least one candidate")
    scores = [expected / round_s for expected, round_s in (candidate_round(c, state, config) for c in candidates)]
    return max(range(len(scores)), key=lambda i: (scores[i], -i))
