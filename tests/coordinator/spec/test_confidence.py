"""coordinator.spec.confidence: a confident drafter's draft sized by its own log-probs,
corrected by its family's measured calibration."""

from __future__ import annotations

import math

import pytest
import torch

from coordinator.spec.adapt import AdaptConfig, AdaptState, RoundVerified, apply, traversal_line
from coordinator.spec.confidence import calibration, confidence_floor, size_by_confidence
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.source import DraftSource
from tests.coordinator.spec.test_spec_adapt import _timed_state


def test_confident_drafts_are_cut_where_another_node_stops_paying():
    # Path probabilities 0.9, 0.81, ... of a chain: the marginal node's expected tokens
    # fall geometrically while each costs per_row_s, so m must stop where the rate peaks.
    tree = DraftTree.chain(list(range(10)), logprobs=torch.full((10,), math.log(0.9)), source=DraftSource("eagle", "chain"))
    cheap = _timed_state(0.2, 0.001)
    dear = _timed_state(0.2, 0.05)
    m_cheap, e_cheap = size_by_confidence(tree, cheap, 0.0)
    m_dear, _ = size_by_confidence(tree, dear, 0.0)
    c = AdaptConfig().prior_calibration
    assert m_cheap == 10 and e_cheap == pytest.approx(1 + c * sum(0.9**d for d in range(1, 11)))
    assert 0 < m_dear < m_cheap
    # Brute force: no other prefix has a better rate under the same model.
    fixed, per_row = traversal_line(dear)
    rates = [(1 + c * sum(0.9**d for d in range(1, m + 1))) / (fixed + per_row * (m + 1)) for m in range(11)]
    assert m_dear == max(range(11), key=lambda m: rates[m])


def test_calibration_learns_an_overconfident_head_per_family():
    state = AdaptState()
    for _ in range(30):  # predicted 4 accepted nodes a round, 1 came
        state = apply(RoundVerified(DraftSource("eagle", "tree"), 16, 3, 1, 0.3, 0.0, predicted=4.0), state)
    assert calibration(state, DraftSource("eagle", "chain")) == pytest.approx(0.25, abs=0.01)
    assert calibration(state, DraftSource("ngram", "3")) == AdaptConfig().prior_calibration
    tree = DraftTree.chain([5, 6, 7], logprobs=torch.log(torch.tensor([0.9, 0.9, 0.9])), source=DraftSource("eagle", "chain"))
    _, expected = size_by_confidence(tree, state, 0.0, AdaptConfig(prior_per_node_s=0.0))
    assert expected == pytest.approx(1 + 0.25 * (0.9 + 0.81 + 0.729), rel=0.05)


def test_confidence_floor_is_where_a_node_cannot_pay_for_its_row():
    state = _timed_state(0.2, 0.01)
    c = calibration(state, DraftSource("eagle"))
    assert math.exp(confidence_floor(state, DraftSource("eagle"))) == pytest.approx(0.01 / (0.21 * c), rel=1e-3)
    assert confidence_floor(_timed_state(0.2, 0.0), DraftSource("eagle")) < math.log(1e-9)  # free rows: draft everything
