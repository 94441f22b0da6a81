"""take_batch: which waiting frames share a stage's next forward.

Bugs guarded: a job's later frame run before (or beside) its earlier one (it needs the K/V
the earlier one writes: wrong states, silently), a long prefill chunk walling off the
decode rows behind it, the oldest frame starved by a stream of small ones, a batch past
its token budget. Sound: the properties below are checked over random queues, and the
examples pin the exact choice.
"""

from __future__ import annotations

from hypothesis import given, strategies as st

from shard.batch_plan import take_batch

waiting_frames = st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 300)), max_size=30)


def test_nothing_waiting_is_no_batch():
    assert take_batch([], 320) == []


def test_decode_rows_pass_a_chunk_that_does_not_fit():
    waiting = [("a", 200), ("b", 256), ("c", 1), ("d", 60), ("e", 64)]
    assert take_batch(waiting, 320) == [0, 2, 3]  # 200 + 1 + 60 fit; 256 and then 64 do not


def test_a_frame_past_the_budget_runs_alone_when_first():
    assert take_batch([("a", 1000), ("b", 1)], 320) == [0]


def test_a_job_never_overtakes_its_own_frame():
    # b's first frame is passed over (too big), so its second must wait too.
    assert take_batch([("a", 100), ("b", 300), ("b", 1), ("a", 1), ("c", 1)], 320) == [0, 4]


@given(waiting_frames, st.integers(1, 600))
def test_properties(waiting, budget):
    taken = take_batch(waiting, budget)
    if not waiting:
        assert taken == []
        return
    assert taken[0] == 0 and taken == sorted(set(taken))  # the oldest runs; arrival order kept
    jobs = [waiting[i][0] for i in taken]
    assert len(jobs) == len(set(jobs))  # one frame per job
    rows = sum(waiting[i][1] for i in taken)
    assert rows <= budget or taken == [0]  # within budget, or the oldest alone
    for i in taken:  # never ahead of an earlier frame of its own job
        assert all(waiting[j][0] != waiting[i][0] for j in range(i) if j not in taken)
    # Greedy: every frame left out was blocked by its job or by the budget.
    left = budget - rows
    first_of_job = {}
    for i, (job, _) in enumerate(waiting):
        first_of_job.setdefault(job, i)
    for i, (job, n) in enumerate(waiting):
        if i not in taken and first_of_job[job] == i:
            assert n > left
