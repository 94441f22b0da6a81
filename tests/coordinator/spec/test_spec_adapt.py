"""Draft-shape planning and drafter routing: the models, the EWMAs, and the choices."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.spec.adapt import (
    AcceptanceStats,
    AdaptConfig,
    AdaptState,
    DraftKind,
    DraftOutcome,
    RingChanged,
    RoundVerified,
    acceptance_rate,
    apply,
    chain_survives,
    best_tree_tokens,
    expected_tokens,
    expected_tokens_chain,
    plan,
    queued_share,
    tokens_per_s,
    traversal_line,
)
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.source import ALL_SOURCES, DraftSource

rates = st.floats(0.0, 0.99)


def state_with(a: float, **kw) -> AdaptState:
    return AdaptState(acceptance={ALL_SOURCES: AcceptanceStats(a, 1.0)}, **kw)


@given(rates, st.integers(0, 12))
def test_chain_expectation_is_the_closed_form_and_the_tree_model_agrees(a, k):
    closed = (1 - a ** (k + 1)) / (1 - a)
    assert expected_tokens_chain(a, k) == pytest.approx(closed)
    assert expected_tokens(DraftTree.chain(list(range(k))), a) == pytest.approx(closed)


def test_chain_expectation_matches_simulation():
    # Sound: the model claims per-node acceptance a, stop at first rejection, plus bonus.
    rng = random.Random(0)
    a, k, n = 0.7, 5, 20000
    total = 0
    for _ in range(n):
        accepted = 0
        while accepted < k and rng.random() < a:
            accepted += 1
        total += accepted + 1
    assert total / n == pytest.approx(expected_tokens_chain(a, k), rel=0.02)


@st.composite
def shaped_trees(draw):
    m = draw(st.integers(1, 16))
    parents = [draw(st.integers(-1, i - 1)) for i in range(m)]
    return DraftTree(torch.arange(m), torch.tensor(parents, dtype=torch.int64))


@settings(max_examples=60, deadline=None)
@given(shaped_trees(), rates)
def test_best_tree_is_at_least_as_good_as_any_tree_of_that_size(tree, a):
    # Bug guarded: a best-first search that is not optimal would make plan() undervalue
    # trees. Sound: any concrete tree of M nodes within the depth is a candidate.
    assert best_tree_tokens(a, tree.num_nodes, tree.max_depth) >= expected_tokens(tree, a) - 1e-9
    assert best_tree_tokens(a, tree.num_nodes, tree.num_nodes) >= expected_tokens_chain(a, tree.num_nodes) - 1e-9


@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8)), min_size=1, max_size=30))
def test_acceptance_ewma_stays_a_probability(rounds):
    state = AdaptState()
    for tried, accepted in rounds:
        accepted = min(accepted, tried)
        state = apply(RoundVerified(DraftSource("ngram", "2"), tried + 1, tried, accepted, 0.1, 0.0), state)
    for key in (DraftSource("ngram", "2"), DraftSource("ngram"), ALL_SOURCES):
        assert 0.0 <= acceptance_rate(state, key) <= AdaptConfig().max_acceptance


def test_acceptance_converges_and_is_kept_per_source():
    state = AdaptState()
    for _ in range(60):
        state = apply(RoundVerified(DraftSource("ngram", "4"), 4, 4, 4, 0.1, 0.0), state)  # always accepted
        state = apply(RoundVerified(DraftSource("eagle"), 4, 2, 1, 0.1, 0.01), state)  # half
    assert acceptance_rate(state, DraftSource("ngram", "4")) == pytest.approx(0.99)  # capped
    assert acceptance_rate(state, DraftSource("eagle")) == pytest.approx(0.5, abs=1e-3)
    assert acceptance_rate(state, DraftSource("ngram", "1")) == acceptance_rate(state, DraftSource("ngram"))  # family fallback
    assert acceptance_rate(AdaptState(), DraftSource("x")) == AdaptConfig().prior_acceptance


def test_traversal_line_is_fitted_and_forgotten_on_ring_change():
    # t = 0.3 s + 0.01 s per row, observed at alternating sizes.
    state = AdaptState()
    for i in range(80):
        nodes = 4 if i % 2 else 20
        state = apply(RoundVerified(ALL_SOURCES, nodes, 1, 1, 0.3 + 0.01 * (nodes + 1), 0.0), state)
    fixed, per_row = traversal_line(state)
    assert fixed == pytest.approx(0.3, abs=1e-6) and per_row == pytest.approx(0.01, abs=1e-6)
    assert traversal_line(apply(RingChanged(), state)) == (AdaptConfig().prior_traversal_s, AdaptConfig().prior_per_node_s)


def test_one_shape_keeps_the_prior_slope():
    state = AdaptState()
    for _ in range(10):
        state = apply(RoundVerified(ALL_SOURCES, 7, 1, 1, 0.5, 0.0), state)
    fixed, per_row = traversal_line(state)
    assert per_row == AdaptConfig().prior_per_node_s and fixed == pytest.approx(0.5 - 8 * per_row)


CHAINS = AdaptConfig(kinds=(DraftKind.CHAIN,), max_pipeline_depth=1, max_chain=16)


@settings(max_examples=40, deadline=None)
@given(rates, rates, st.floats(0.01, 1.0), st.floats(0.0, 0.05))
def test_chain_length_grows_with_acceptance(a, b, fixed_s, per_row_s):
    # E(K+1)/E(K) increases with a, so the best K cannot shrink as acceptance rises.
    lo, hi = sorted((a, b))
    config = AdaptConfig(
        kinds=(DraftKind.CHAIN,), max_pipeline_depth=1, max_chain=16, prior_traversal_s=fixed_s, prior_per_node_s=per_row_s
    )
    assert plan(state_with(lo), config).nodes <= plan(state_with(hi), config).nodes


def test_pipelining_is_deep_when_acceptance_is_high_and_off_when_low():
    high, low = plan(state_with(0.95)), plan(state_with(0.1))
    assert high.pipeline_depth > 1 and high.nodes >= 4
    assert low.pipeline_depth == 1
    chain_low = plan(state_with(0.05), CHAINS)
    assert chain_low.kind is DraftKind.CHAIN and chain_low.nodes <= 1


def test_pipelining_rate_model():
    # P = 1 is plain E / T; with everything accepted P rounds in flight give P times that.
    assert tokens_per_s(3.0, 0.125, 0.2, 0.01, 1) == pytest.approx(15.0)
    assert tokens_per_s(5.0, 1.0, 0.2, 0.01, 4) == pytest.approx(5.0 / 0.05)
    assert tokens_per_s(5.0, 1.0, 0.2, 0.1, 4) == pytest.approx(5.0 / 0.1)  # launch floor
    # The floor (draft + Q) binds only rounds sent ahead: a measured Q above a whole
    # round (a loaded machine) must not slow a round that waits for the last one.
    assert tokens_per_s(5.0, 0.9, 0.2, 0.3, 1, 0.3) == pytest.approx(5.0 / 0.2)
    # A run ends with probability 1 - s = 0.75 a round, and then the P - 1 = 2 rounds in
    # flight behind it are discarded, each delaying the next fresh round by Q = 0.1 s.
    s = 0.5**2
    expected_denominator = 0.2 * (1 - s) + s * max(0.2 / 3, 0.01) + (1 - s) * 2 * 0.1
    assert tokens_per_s(5.0, s, 0.2, 0.01, 3, 0.1) == pytest.approx(5.0 / expected_denominator)


def test_queue_is_measured_by_rounds_sent_behind_others_and_leaves_the_line_alone():
    state = _timed_state(0.2, 0.001)
    line = traversal_line(state)
    assert state.queue_s is None
    # 9 rows: the line predicts 0.209 s; sent behind 2 rounds it took 0.109 s longer.
    behind = apply(RoundVerified(DraftSource("ngram", "4"), 8, 8, 8, 0.209 + 0.109, 0.0, queued_behind=2), state)
    assert behind.queue_s == pytest.approx(0.0545)
    assert traversal_line(behind) == pytest.approx(line)
    faster = apply(RoundVerified(DraftSource("ngram", "4"), 8, 8, 8, 0.1, 0.0, queued_behind=1), behind)
    assert faster.queue_s == pytest.approx(0.8 * 0.0545)  # never negative
    assert apply(RingChanged(), faster).queue_s is None  # a new ring queues differently


def test_a_round_ahead_counts_by_the_share_of_it_still_to_run():
    # Bug guarded: a round sent ahead when its base was nearly back counted as a whole
    # round queued ahead, so its small delay read as a small Q (loopback measured Q at
    # 4-38 ms against ~70 ms rounds). Sound: the line predicts 0.2 + 0.001 * rows.
    state = _timed_state(0.2, 0.001)
    assert queued_share([(10.0, 9)], 10.0, state) == pytest.approx(1.0)  # just sent
    assert queued_share([(10.0, 9)], 10.1045, state) == pytest.approx(0.5)  # half of 0.209 s gone
    assert queued_share([(10.0, 9), (9.0, 9)], 10.1045, state) == pytest.approx(0.5)  # one long back
    # Half a round queued ahead and 0.05 s of excess: Q = 0.1 s. Below half a round the
    # excess is too small a part to divide, and the round still leaves the line alone.
    half = apply(RoundVerified(DraftSource("ngram", "4"), 8, 8, 8, 0.209 + 0.05, 0.0, queued_behind=0.5), state)
    assert half.queue_s == pytest.approx(0.1)
    little = apply(RoundVerified(DraftSource("ngram", "4"), 8, 8, 8, 0.209 + 0.05, 0.0, queued_behind=0.2), state)
    assert little.queue_s is None and little.traversal == state.traversal


def test_pipeline_depth_follows_the_measured_queue():
    # Sound: acceptance 0.95 on a 200 ms latency-bound ring whose rounds delay each other
    # by 5 ms pays for deep pipelines; where a round ahead delays the next by nearly the
    # whole round (stages sharing one CPU), the discarded rounds cost more than the
    # overlap buys, so nothing is sent ahead.
    timed = _timed_state(0.2, 0.001)
    fast = replace(timed, acceptance={ALL_SOURCES: AcceptanceStats(0.95, 1.0)}, queue_s=0.005)
    busy = replace(fast, queue_s=0.19)
    assert plan(fast).pipeline_depth >= 3
    assert plan(busy).pipeline_depth == 1
    assert plan(busy).nodes >= 1  # it still drafts: only sending ahead stopped paying


def test_whole_chain_acceptance_is_measured_and_moves_pipelining():
    # Bug guarded: a round sent ahead is kept only if the chain before it is accepted
    # whole, and s = a^(K+1) assumes its nodes fail independently. An n-gram copy is
    # bimodal (the quote runs on, or it ends at once) and a drifting paraphrase keeps most
    # nodes but rarely all: the planner sent 9 rounds ahead on loopback and kept none.
    # Sound: both rings below have the same line, queue and about the same a; only the
    # measured whole acceptances differ, and with none measured the model stands.
    timed = replace(_timed_state(0.2, 0.001), queue_s=0.02)

    def run(accepted_per_round):  # n-gram chains of 8, one traversal each on the line
        state = timed
        for accepted in accepted_per_round:
            state = apply(RoundVerified(DraftSource("ngram", "4"), 8, min(accepted + 1, 8), accepted, 0.209, 0.0, chain=True), state)
        return state

    copying, drifting = run([8, 0, 0, 0] * 10), run([7] * 40)  # a about 0.73 and 0.875
    for state in (copying, drifting):
        a = acceptance_rate(state, DraftSource("ngram", "4"))
        assert chain_survives(replace(state, whole={}), DraftSource("ngram", "4"), a, 8) == pytest.approx(a**9)
    a = acceptance_rate(copying, DraftSource("ngram", "4"))
    assert chain_survives(copying, DraftSource("ngram", "4"), a, 8) > 2 * a**9  # a quarter whole, not a^8 = 8%
    assert chain_survives(drifting, DraftSource("ngram", "4"), 0.875, 8) == 0.0
    eights = AdaptConfig(max_chain=8, kinds=(DraftKind.CHAIN,))  # the chains these rounds sent
    assert plan(replace(drifting, whole={}), eights, source=DraftSource("ngram", "4")).pipeline_depth > 1
    assert plan(drifting, eights, source=DraftSource("ngram", "4")).pipeline_depth == 1
    # Trees are never sent ahead of: their rounds teach nothing about whole chains.
    tree_round = RoundVerified(DraftSource("ngram", "4"), 8, 3, 2, 0.209, 0.0, chain=False)
    assert apply(tree_round, copying).whole == copying.whole


def test_planned_like_the_emulated_ring_eagle_keeps_drafting():
    # Bug guarded: plan() credited pipelining to a round with no draft (nothing to send
    # ahead) and to trees (the engine pipelines chains only), and the engine planned EAGLE
    # rounds as if they could be pipelined (they need the target's features first). With
    # what the emulated ring measured (fixed 275 ms, 14 ms per row, EAGLE 8.9 ms per node,
    # a = 0.43) it chose "no draft, 4 rounds in flight", so EAGLE stopped drafting.
    # Sound: one node commits 1 + a = 1.43 tokens per round for 23 ms (8%) more.
    state = AdaptState(acceptance={DraftSource("eagle"): AcceptanceStats(0.43, 1.0)}, draft_s_per_node=0.0089)
    for max_pipeline_depth in (4, 1):
        config = AdaptConfig(prior_traversal_s=0.275, prior_per_node_s=0.014, max_pipeline_depth=max_pipeline_depth)
        assert plan(state, config, source=DraftSource("eagle")).nodes >= 1
    assert plan(state_with(0.9), AdaptConfig(kinds=(DraftKind.TREE,))).pipeline_depth == 1
    assert plan(state_with(0.01)) == plan(state_with(0.01), AdaptConfig(max_pipeline_depth=1))


def _timed_state(fixed_s: float, per_row_s: float, **kw) -> AdaptState:
    state = AdaptState(**kw)
    for i in range(40):
        nodes = 2 if i % 2 else 12
        state = apply(RoundVerified(DraftSource("x"), nodes, 1, 1, fixed_s + per_row_s * (nodes + 1), 0.0), state)
    return AdaptState(state.acceptance, state.traversal, 0.0, state.rounds, kw.get("confidence", {}))


@pytest.mark.parametrize("flag, fragment", [
    ("5", "takes NODES,DEPTH (two integers), got '5'"),
    ("4,9", "needs 1 <= depth <= nodes <= 256, got (4, 9)"),
    ("0,0", "needs 1 <= depth <= nodes <= 256, got (0, 0)"),
])
def test_a_bad_eagle_tree_flag_is_refused_before_anything_loads(flag, fragment, capsys):
    from coordinator.cli import main

    assert main(["serve", "--eagle-tree", flag]) == 2
    assert fragment in capsys.readouterr().err


def test_a_merged_round_teaches_each_part_not_the_merge():
    # Guards hybrid's statistics: a merged round's acceptance belongs to the drafters
    # whose nodes were accepted, per source, and the calibration to the confident one;
    # learning it under the merge's own source would leave the router comparing the
    # n-gram and EAGLE drafts on stale rates. Sound: the parts are separate EWMA keys.
    state = AdaptState()
    parts = (DraftOutcome(DraftSource("ngram", "3"), tried=4, accepted=3), DraftOutcome(DraftSource("eagle", "tree"), tried=2, accepted=0, predicted=1.5))
    state = apply(RoundVerified(DraftSource("merged"), 12, 5, 3, 0.3, 0.01, parts=parts), state)
    assert DraftSource("merged") not in state.acceptance
    assert state.acceptance[DraftSource("ngram", "3")].accepted > AdaptConfig().prior_acceptance * (1 - AdaptConfig().ewma_alpha)
    assert acceptance_rate(state, DraftSource("ngram", "3")) > acceptance_rate(state, DraftSource("eagle", "tree"))
    assert state.confidence[DraftSource("eagle")] == AcceptanceStats(0, 1.5) and DraftSource("ngram") not in state.confidence
    assert state.traversal is not None and state.traversal.n == 13  # the round's rows, once


@pytest.mark.parametrize("depth", ["0", "9"])
def test_a_bad_pipeline_depth_is_refused_before_anything_loads(depth, capsys):
    from coordinator.cli import main

    assert main(["serve", "--pipeline-depth", depth]) == 2
    assert f"pipeline depth (rounds in flight) must be 1..8, got {depth}" in capsys.readouterr().err
