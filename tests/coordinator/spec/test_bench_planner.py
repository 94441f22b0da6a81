"""scripts/bench_planner.py: the replay it measures the n-gram planner with."""

from __future__ import annotations

from coordinator.spec.drafting import DraftBudget
from scripts.bench_planner import acceptance_by_depth, replay

PROMPT = list(range(100, 140))  # a passage of 40 distinct tokens
QUOTE = [7] + PROMPT[5:35]  # an answer that quotes 30 of them after one token of its own


def test_a_fixed_chain_commits_a_quote_in_few_traversals_and_charges_its_rows():
    traversals, seconds, _ = replay(PROMPT, QUOTE, (0.1, 0.01), DraftBudget.chain(8))
    # first round: the lone token 7 matches nothing, so no draft; the quote then starts
    # at the token after it, and every later round accepts its whole chain plus the bonus
    assert traversals == 1 + -(-(len(QUOTE) - 2) // 9)  # 29 quoted tokens, 9 a round
    assert seconds >= traversals * 0.11


def test_the_planner_replay_commits_the_whole_answer():
    traversals, seconds, state = replay(PROMPT, QUOTE, (0.1, 0.001), None)
    assert 1 <= traversals < len(QUOTE) - 1
    assert state.rounds >= 1  # the planner learnt from its drafted rounds


def test_acceptance_by_depth_counts_tried_nodes_until_the_first_miss():
    counts: dict = {}
    acceptance_by_depth(PROMPT, QUOTE, counts)
    depth1_accepted, depth1_tried = counts["all"][0]
    assert depth1_tried >= 1 and 0 <= depth1_accepted <= depth1_tried
    deep = counts["all"][3]  # depths 5-8: a quote, once started, goes on
    assert deep[1] > 0 and deep[0] / deep[1] > 0.5
