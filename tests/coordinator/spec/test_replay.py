"""coordinator.spec.replay: drafts walked against known text. The wire-tau walk
(teacher-forced greedy verification), the training run's accepted length, and the
n-gram planner replayed on a fixed answer."""

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget
from coordinator.spec.replay import acceptance_by_depth, accepted_length, replay, walk
from coordinator.spec.source import DraftSource

# Text positions 0..5; the reference answer and, per position, the target's greedy next token.
REF = [10, 11, 12, 13, 14, 15]


def test_walk_accepts_the_branch_that_follows_the_target():
    # Bug guarded: taking the first branch instead of the one the target agrees with.
    tree = DraftTree.from_branches([[12, 99, 7], [12, 13, 14]], 16, source=DraftSource("test"))
    greedy = [11, 12, 13, 14, 15, 0]
    assert walk(tree, 1, REF, greedy) == 3


def test_walk_stops_at_the_first_miss():
    tree = DraftTree.from_branches([[12, 13, 77, 15]], 16, source=DraftSource("test"))
    assert walk(tree, 1, REF, [11, 12, 13, 14, 15, 0]) == 2


def test_walk_stops_after_accepting_a_token_off_the_reference():
    # The target (on this wire) prefers 55 at position 2 where the reference has 13: a
    # draft of 55 is accepted, but what the target says after it is unknown, so the walk
    # stops there even though the draft goes on to match the reference.
    tree = DraftTree.from_branches([[12, 55, 14, 15]], 16, source=DraftSource("test"))
    assert walk(tree, 1, REF, [11, 12, 55, 14, 15, 0]) == 2
    # and a draft that keeps to the reference is rejected where the target disagrees
    tree = DraftTree.from_branches([[12, 13, 14]], 16, source=DraftSource("test"))
    assert walk(tree, 1, REF, [11, 12, 55, 14, 15, 0]) == 1


def test_walk_of_an_empty_draft_is_zero():
    assert walk(DraftTree.empty(source=DraftSource("test")), 0, REF, [11, 12, 13, 14, 15, 0]) == 0


def test_training_evaluation_counts_the_branch_the_target_follows_until_the_text_ends():
    # accepted_length (the training run's offline tau, and copy_ceiling's n-gram count)
    # is greedy acceptance against a known continuation.
    tree = DraftTree.from_branches([[12, 99, 7], [12, 13, 14]], 16, source=DraftSource("test"))
    assert accepted_length(tree, [12, 13, 14, 15]) == 3
    assert accepted_length(tree, [12, 13]) == 2  # the text ends: nothing past it is accepted
    assert accepted_length(tree, [50]) == 0
    assert accepted_length(DraftTree.empty(source=DraftSource("test")), [12]) == 0


# The planner replay (scripts/bench_planner.py).
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
    # the benchmark's JSON keys: each source as its text (a DraftSource is no JSON key)
    assert "ngram:4" in counts and all(isinstance(key, str) for key in counts)
