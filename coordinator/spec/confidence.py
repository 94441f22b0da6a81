"""Sizing a confident drafter's draft (EAGLE-2 style) by its own log-probs.

A drafter whose log-probs estimate the target's choices drafts a generous tree and the
planner keeps its likeliest m nodes, m chosen per round from the head's own path
probabilities P_i: a node is accepted with probability about c * P_i, so m maximises
(1 + c * (P_1 + ... + P_m)) / (draft + fixed + per_row * (m + 1)). The calibration c is
an EWMA ratio of accepted nodes to the sum of P_i over the nodes sent, per drafter
family (`adapt.apply` keeps it in `AdaptState.confidence`), so an over- or
under-confident head is corrected within a few rounds and a confident round is not
judged by an unconfident one's rate.

Pure functions of a draft and the planner's state; this module does not know which
drafters are confident (`draft_round.is_confident`) nor the ring.
"""

from __future__ import annotations

import math

from coordinator.spec.adapt import AdaptConfig, AdaptState, path_probabilities, traversal_line
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.source import DraftSource


def calibration(state: AdaptState, source: DraftSource, config: AdaptConfig = AdaptConfig()) -> float:
    """Accepted nodes per unit of predicted acceptance for `source`'s family."""
    stats = state.confidence.get(source.family_key)
    c = stats.accepted / stats.tried if stats is not None and stats.tried > 0 else config.prior_calibration
    low, high = config.calibration_range
    return min(max(c, low), high)


def confidence_floor(state: AdaptState, source: DraftSource, config: AdaptConfig = AdaptConfig()) -> float:
    """The least cumulative draft log-prob worth drafting below: a node adds about c * P
    tokens for per_row_s of ring time, which cannot pay while c * P < per_row_s * r,
    where r >= 1 / (fixed_s + per_row_s) (plain decoding's rate) is the best round's rate."""
    fixed_s, per_row_s = traversal_line(state, config)
    floor = per_row_s / ((fixed_s + per_row_s) * calibration(state, source, config))
    return math.log(floor) if floor > 0 else float("-inf")


def size_by_confidence(tree: DraftTree, state: AdaptState, draft_s: float,
                       config: AdaptConfig = AdaptConfig()) -> tuple[int, float]:
    """(m, expected tokens) for the likeliest m nodes of `tree` that maximise expected
    tokens per second of round time (module docstring); m = 0 means no draft."""
    c = calibration(state, tree.source, config)
    fixed_s, per_row_s = traversal_line(state, config)
    probs = sorted(path_probabilities(tree), reverse=True)
    best_m, best_e, best_rate, expected = 0, 1.0, 1.0 / (draft_s + fixed_s + per_row_s), 1.0
    for m, p in enumerate(probs, start=1):
        expected += min(1.0, c * p)
        rate = expected / (draft_s + fixed_s + per_row_s * (m + 1))
        if rate > best_rate:
            best_m, best_e, best_rate = m, expected, rate
    return best_m, best_e


def confident_reach(tree: DraftTree, state: AdaptState, config: AdaptConfig = AdaptConfig()) -> list[float]:
    """Each node's probability of being accepted by a confident drafter's own estimate:
    its path probability times the drafter's calibration, at most 1."""
    c = calibration(state, tree.source, config)
    return [min(1.0, c * p) for p in path_probabilities(tree)]
