"""What one round's verifier checks decide (coordinator.jobs.release_gate.judge), pure."""

from __future__ import annotations

from coordinator.jobs.release_gate import judge
from coordinator.trust.round_verifier import Outcome


def test_a_caught_stage_releases_nothing_and_nobody_earns_the_round():
    # Bug guarded: crediting the honest stages of a round a liar spoiled (their outputs
    # were never the ones the tokens would have come from), or releasing it.
    book = {"a": 3, "b": 0}
    got = judge({"a": Outcome(True, 2, ""), "b": Outcome(False, 0, "stage b lied")}, book)
    assert got.caught == "stage b lied; its tokens were not released" and got.book == book and got.unverified is None


def test_stages_that_passed_earn_the_rounds_compared_and_an_unchecked_one_is_reported():
    # Bug guarded: a round no verifier could check counted as clean (a liar would leave
    # probation unverified), or going out silently. Sound: each stage's count is exact.
    got = judge({"a": Outcome(True, 2, ""), "b": Outcome(None, 0, "no verifier node for b")}, {"a": 3})
    assert got.caught is None and got.book == {"a": 5}
    assert got.unverified == "no verifier node for b: its rounds go out unverified (audits alone vouch for it)"
    clean = judge({"a": Outcome(True, 1, ""), "b": Outcome(True, 3, "")}, {})
    assert (clean.book, clean.caught, clean.unverified) == ({"a": 1, "b": 3}, None, None)


def test_a_check_by_newcomers_alone_earns_nothing_and_names_the_stage():
    # Bug guarded (issue 20): two colluding fresh keys vouching for each other; each passed
    # check by a node on probation crediting the stage, so both leave probation unchecked by
    # anyone trusted. Sound: the vouched stage earns its rounds, the other earns none and
    # is the one named for the unverified release (or the refusal).
    got = judge({"a": Outcome(True, 2, ""), "b": Outcome(True, 0, "b checked only by newcomers", vouched=False)},
                {"b": 5})
    assert got.caught is None and got.book == {"a": 2, "b": 5}
    assert got.newcomers == ("b",) and got.reasons == "b checked only by newcomers"
    assert got.unverified == "b checked only by newcomers: its rounds go out unverified (audits alone vouch for it)"
