"""Probation's bookkeeping (coordinator.trust.probation), pure.

Bug guarded: a lying newcomer's rounds released unverified (the red team had 2 and 14
wrong answers delivered before audits caught it), or an honest node excluded for a
newcomer's lie. Sound: exact examples of each rule, and a simulation over every seating
order in which one newcomer lies on every round it serves.
"""

from __future__ import annotations

import itertools

from coordinator.trust import probation
from coordinator.trust.probation import ProbationPolicy, Verdict
from ring import PeerId

A, B, C, D = (PeerId(x) for x in "abcd")
POLICY = ProbationPolicy(clean_rounds=3)


def test_a_node_leaves_probation_after_its_clean_rounds_and_a_fresh_key_starts_on_it():
    book = probation.credit({}, [A, B], rounds=2)
    assert probation.probation_stages(book, [A, B, C], POLICY) == (A, B, C)
    book = probation.credit(book, [A])
    assert probation.probation_stages(book, [A, B, C], POLICY) == (B, C)
    assert probation.on_probation(book, D, POLICY)  # a new identity: no history
    assert not probation.on_probation(book, D, ProbationPolicy(clean_rounds=0))  # probation off


def test_blame_falls_on_the_newest_stage_on_probation():
    assert probation.blame({}, [A]) == Verdict(A, ())  # alone on probation: faulty
    assert probation.blame({A: 2, B: 0}, [A, B]) == Verdict(B, ())  # fewer clean rounds than the rest: faulty
    assert probation.blame({}, [A, B, C]) == Verdict(None, (C,))  # tied: the latest sits out, no one is faulty
    assert probation.blame({}, []) == Verdict(None, ())


def test_one_liar_among_newcomers_is_found_and_no_honest_node_is_ever_faulty():
    # Each round: the ring is every node not excluded, in the seating order; a ring with
    # the liar mismatches (blame), one without it matches (its stages are credited).
    peers = [PeerId(f"p{i}") for i in range(4)]
    for order in itertools.permutations(peers):
        for liar in peers:
            book: dict[PeerId, int] = {}
            faulty, sitting = None, set()
            for _ in range(20):
                ring = [p for p in order if p != faulty and p not in sitting]
                if liar not in ring:
                    book = probation.credit(book, ring)
                    sitting.clear()  # sit-outs end: they rejoin the next ring
                    continue
                verdict = probation.blame(book, probation.probation_stages(book, ring, POLICY))
                assert verdict.faulty in (None, liar)
                if verdict.faulty is not None:
                    faulty = verdict.faulty
                    break
                sitting.update(verdict.sit_out)
            assert faulty == liar, (order, liar)


def test_an_operator_listed_key_is_never_on_probation():
    # Bug guarded: the bootstrap of a layerless gateway (its trusted keys) seated on
    # probation like any stranger, so nobody could ever vouch for a newcomer.
    policy = ProbationPolicy(clean_rounds=4, trusted=frozenset({"own"}))
    assert not probation.on_probation({}, "own", policy) and probation.on_probation({}, "fresh", policy)
    assert probation.probation_stages({"old": 4}, ["own", "fresh", "old"], policy) == ("fresh",)
