"""A job's counters (coordinator.jobs.job_stats) folded from its round events.

The figures a response's `shard` object and the benchmarks report (traversals, drafter
mix, rounds pipelined and discarded, TTFT) all come from `apply`; these tests pin what
each event counts, so a refactor of the job cannot quietly change a reported figure.
"""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, strategies as st

from coordinator.jobs import job_stats
from coordinator.jobs.job_stats import (
    DrafterSkipped, JobStats, Resumed, RoundCommitted, RoundSentAhead, RoundsDiscarded, apply, figures,
    planner_figures)
from coordinator.spec import adapt
from coordinator.spec.adapt import AdaptState, TraversalFit


def fold(*events: job_stats.Event) -> JobStats:
    return functools.reduce(lambda stats, e: apply(e, stats), events, JobStats())


def test_a_committed_round_counts_its_traversal_its_drafter_and_the_first_commit_time():
    stats = fold(RoundCommitted(None, tokens=1, pipelined=False, since_start_s=0.5),  # the prefill
                 RoundCommitted("ngram", tokens=4, pipelined=False, since_start_s=0.7),
                 RoundCommitted("ngram", tokens=2, pipelined=True, since_start_s=0.8),
                 RoundCommitted("eagle", tokens=3, pipelined=False, since_start_s=0.9))
    assert stats.traversals == 4 and stats.pipelined == 1
    assert stats.ttft_s == 0.5  # the first commit, never a later one
    assert stats.drafted == {"ngram": 2, "eagle": 1}
    assert stats.drafted_tokens == {"ngram": 6, "eagle": 3}
    assert stats.undrafted_rounds == 0


def test_committed_rounds_sum_their_traversal_time_per_drafter():
    # Bug guarded: traversal time per drafter (the gateway's metrics divide it by the
    # rounds) mixing families or dropping undrafted rounds. Sound: sums by hand.
    stats = fold(RoundCommitted(None, 1, False, 0.5, traversal_s=0.5), RoundCommitted("ngram", 3, False, 0.7, 0.25),
                 RoundCommitted("ngram", 1, True, 0.8, 0.125), RoundCommitted(None, 1, False, 0.9, 0.0625))
    assert stats.traversal_s == {"none": 0.5625, "ngram": 0.375}


def test_undrafted_rounds_count_since_the_last_draft():
    # draft_round probes a drafter the planner gave up on after this many plain rounds:
    # the count must restart at every drafted round.
    plain = RoundCommitted(None, tokens=1, pipelined=False, since_start_s=1.0)
    drafted = RoundCommitted("ngram", tokens=3, pipelined=False, since_start_s=1.0)
    assert fold(plain, plain, plain).undrafted_rounds == 3
    assert fold(plain, plain, drafted, plain).undrafted_rounds == 1


def test_rounds_ahead_resumes_and_skipped_drafters_are_counted():
    stats = fold(RoundSentAhead(in_flight=2), RoundSentAhead(in_flight=4), RoundSentAhead(in_flight=3),
                 RoundsDiscarded(2), RoundsDiscarded(1), Resumed(), Resumed(),
                 DrafterSkipped(("eagle",)), DrafterSkipped(("eagle", "ngram")))
    assert stats.most_in_flight == 4  # the most at once, not the last
    assert stats.discarded == 3 and stats.resumes == 2
    assert stats.skipped == {"eagle": 2, "ngram": 1}
    assert JobStats().most_in_flight == 1  # the awaited round alone, before any is sent ahead


@given(st.lists(st.sampled_from([RoundCommitted("ngram", 2, False, 0.1), RoundSentAhead(3),
                                 RoundsDiscarded(1), Resumed(), DrafterSkipped(("eagle",))])))
def test_folding_never_changes_the_counters_it_was_given(events):
    # Bug guarded: a count mutated in place would change figures already read (a stats()
    # dict handed out earlier) and any job holding the same counters.
    start = fold(RoundCommitted("ngram", 2, False, 0.1), DrafterSkipped(("eagle",)))
    before = (dict(start.drafted), dict(start.drafted_tokens), dict(start.skipped))
    functools.reduce(lambda stats, e: apply(e, stats), events, start)
    assert (start.drafted, start.drafted_tokens, start.skipped) == before


def test_an_unknown_event_is_refused():
    with pytest.raises(TypeError, match="not a job event"):
        apply(object(), JobStats())  # type: ignore[arg-type]


def test_the_figures_keep_the_names_responses_and_benchmarks_read():
    # Bug guarded: a renamed or dropped key breaks the response's `shard` object and every
    # benchmark reading it, silently (a missing key reads as absent, not as an error).
    plain = RoundCommitted(None, tokens=1, pipelined=False, since_start_s=0.25)
    stats = fold(plain, plain, plain, RoundSentAhead(2), RoundsDiscarded(1), Resumed(), DrafterSkipped(("eagle",)))
    got = figures(stats, generated=3, ring_epoch=7, drafter="hybrid", planner=AdaptState(), job_id="j")
    assert got == {"traversals": 3, "tokens_per_traversal": 1.0, "ring_epoch": 7, "ttft_s": 0.25, "resumes": 1,
                   "drafter": "hybrid", "draft_rounds": {}, "draft_round_tokens": {},
                   "drafter_skipped_rounds": {"eagle": 1}, "traversal_s_by_drafter": {"none": 0.0},
                   "pipelined_rounds": 0, "most_rounds_in_flight": 2,
                   "pipelined_rounds_discarded": 1, "planner": planner_figures(AdaptState()), "job_id": "j"}
    assert figures(JobStats(), generated=0, ring_epoch=-1, drafter="none", planner=AdaptState(),
                   job_id="j")["tokens_per_traversal"] == 0.0  # no traversal yet: no division by zero


def test_planner_figures_are_milliseconds_or_none_until_measured():
    assert planner_figures(AdaptState()) == {"traversal_fixed_ms": None, "traversal_per_row_ms": None,
                                            "queue_ms": None}
    n, t = 5.0, 0.205  # 200 ms fixed, 1 ms a row, with spread in the rows seen
    state = AdaptState(traversal=TraversalFit(n=n, t=t, nn=n * n + 4.0, nt=n * t + 0.001 * 4.0), queue_s=0.005)
    fixed_s, per_row_s = adapt.traversal_line(state)
    assert planner_figures(state) == {"traversal_fixed_ms": round(fixed_s * 1e3, 2),
                                      "traversal_per_row_ms": round(per_row_s * 1e3, 2), "queue_ms": 5.0}
