"""The acceptance walk of scripts/bench_wire_tau.py (teacher-forced greedy verification)."""

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.source import DraftSource
from scripts.bench_wire_tau import walk

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
    # scripts/eagle_fit.accepted_length (the training run's offline tau, and copy_ceiling's
    # n-gram count) is greedy acceptance against a known continuation.
    from scripts.eagle_fit import accepted_length

    tree = DraftTree.from_branches([[12, 99, 7], [12, 13, 14]], 16, source=DraftSource("test"))
    assert accepted_length(tree, [12, 13, 14, 15]) == 3
    assert accepted_length(tree, [12, 13]) == 2  # the text ends: nothing past it is accepted
    assert accepted_length(tree, [50]) == 0
    assert accepted_length(DraftTree.empty(source=DraftSource("test")), [12]) == 0
