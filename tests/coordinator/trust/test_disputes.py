"""Disputes among newcomers (coordinator.trust.disputes, pure; issue 20).

Guards: a lone newcomer verifier's word marking a newcomer stage faulty (1 against 1),
or a three-way split among newcomers judging anyone; a 2-against-1 majority or a trusted
verifier's presence changing what `settle_trusted` decides; the liar (in dispute with two
partners who disputed with nobody else) escaping; an honest node with one dispute, or
nodes of a three-way split, named the liar; old disputes counting forever.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from coordinator.trust import disputes
from coordinator.trust.disputes import disputing, liars, lone_word, record
from coordinator.trust.opinions import Verdict, settle_trusted

H1, H2, H3, L, L2 = "honest-1", "honest-2", "honest-3", "liar-1", "liar-2"


def _book(*pairs, at_s=0.0):
    book: disputes.Book = ()
    for a, b in pairs:
        book = record(book, a, b, at_s, "layers [0, 4) of round 1 of job j")
    return book


def test_one_newcomer_against_one_is_a_dispute_not_a_verdict():
    # settle_trusted alone would mark the stage faulty on the verifier's word.
    assert settle_trusted([0, 1], [False, False]) == Verdict(True, (), True)
    assert lone_word([0, 1], [False, False])
    assert disputing([0, 1]) == ((0, 1),)


def test_every_newcomer_on_its_own_is_a_dispute_among_all():
    assert lone_word([0, 1, 2], [False, False, False])
    assert disputing([0, 1, 2]) == ((0, 1), (0, 2), (1, 2))
    assert lone_word([0, 1, 0, 1], [False] * 4)  # two against two: no strict majority


def test_two_newcomers_against_one_settle_by_majority_as_before():
    for ids in ([0, 1, 0], [0, 1, 1], [0, 1, 0, 2]):
        assert not lone_word(ids, [False] * len(ids))
    assert settle_trusted([0, 1, 0], [False] * 3) == Verdict(False, (1,), True)  # the lone verifier lied


def test_agreement_is_no_dispute():
    assert not lone_word([0, 0], [False, False]) and disputing([0, 0]) == ()


def test_a_trusted_verifier_settles_as_before():
    assert not lone_word([0, 1], [False, True])
    assert settle_trusted([0, 1], [False, True]) == Verdict(True, (), True)
    assert not lone_word([0, 1, 2], [False, False, True])


@given(st.lists(st.integers(0, 3), min_size=2, max_size=4), st.data())
def test_lone_word_only_without_trust_and_without_a_strict_majority_of_two(ids, data):
    trusted = [False] + data.draw(st.lists(st.booleans(), min_size=len(ids) - 1, max_size=len(ids) - 1))
    counts = sorted((ids.count(o) for o in set(ids)), reverse=True)
    majority = counts[0] >= 2 and (len(counts) == 1 or counts[0] > counts[1])
    assert lone_word(ids, trusted) == (not any(trusted) and len(counts) > 1 and not majority)


def test_a_node_in_dispute_with_two_partners_who_disputed_with_nobody_else_is_the_liar():
    assert liars(_book((H1, L))) == ()  # one dispute names nobody: either may have lied
    book = _book((H1, L), (L, H2))
    assert liars(book) == (L,)
    assert disputes.partners(book, L) == {H1, H2}
    assert disputes.settled(book, L) == ()  # its partners are cleared


def test_the_same_partner_twice_is_not_two_partners():
    assert liars(_book((H1, L), (L, H1))) == ()


def test_a_three_way_split_names_nobody():
    # Each has two partners, but each partner disputed with someone else too.
    assert liars(_book((H1, L), (H1, L2), (L, L2))) == ()


def test_an_honest_node_that_met_a_liar_is_not_named_when_the_liar_met_another():
    book = _book((H1, L), (L, H2), (L, H3), (H3, L2))
    assert liars(book) == ()  # H3 also disputed with L2: L's partners are not all clean ...
    assert liars(_book((H1, L), (L, H2), (L2, H3))) == (L,)  # ... here they are


def test_disputes_past_the_window_are_forgotten():
    book = record(_book((H1, L), at_s=0.0), L, H2, disputes.WINDOW_S + 1, "later")
    assert liars(book) == () and [d.b for d in book] == [H2]
    assert disputes.open_disputes(book, disputes.WINDOW_S + 3) == [
        {"nodes": [L, H2], "check": "later", "age_s": 2.0}]
