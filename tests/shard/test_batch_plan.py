"""plan_batch: which waiting frames share a stage's next forward, and which rows of each.

Bugs guarded: a job's later frame run before (or beside) its earlier one (it needs the K/V
the earlier one writes: wrong states, silently), a long prefill chunk walling off the
decode rows behind it, the oldest frame starved by a stream of small ones, a batch past
its token budget, a prefill chunk run whole beside waiting decode rows (they wait for its
whole forward), a lone prompt cut into pieces for nobody (its TTFT grows). Sound: the
properties below are checked over random queues, and the examples pin the exact choice.
"""

from __future__ import annotations

from hypothesis import given, strategies as st

from shard.batch_plan import plan_batch


def take_batch(waiting, budget):
    """The frames a plan runs, none splittable: the scheduler's choice before pieces."""
    picked = plan_batch([(job, rows, False) for job, rows in waiting], budget)
    assert all(n == waiting[i][1] for i, n in picked)  # unsplittable frames run whole
    return [i for i, _ in picked]


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


def test_a_lone_prefill_chunk_runs_whole():
    # Only its own job's frames wait and no decode ran lately: no one to protect.
    assert plan_batch([("p", 1024, True), ("p", 256, True)], 320, 64) == [(0, 1024)]
    assert plan_batch([("p", 256, True), ("q", 256, True)], 320, 64) == [(0, 256)]  # prefill only: no split


def test_decode_rows_waiting_cut_the_chunk_to_a_piece():
    waiting = [("p", 256, True), ("a", 1, False), ("b", 1, False), ("p", 100, True)]
    assert plan_batch(waiting, 320, 64) == [(0, 64), (1, 1), (2, 1)]
    # Decode rows ran lately (busy) though none waits now: still in pieces.
    assert plan_batch([("p", 256, True)], 320, 64, busy=True) == [(0, 64)]
    assert plan_batch([("p", 40, True)], 320, 64, busy=True) == [(0, 40)]  # the rest fits a piece
    assert plan_batch([("p", 256, True), ("a", 1, False)], 320, 0) == [(0, 256), (1, 1)]  # 0: never split


def test_prefill_pieces_share_one_allowance_and_the_budget():
    # Decode rows first fill 300 of 320: the chunk gets what is left, not its whole piece.
    waiting = [("a", 300, False), ("p", 256, True), ("q", 256, True)]
    assert plan_batch(waiting, 320, 64) == [(0, 300), (1, 20)]
    # Two chunks behind decode rows: 64 prefill rows in all, the older chunk first.
    waiting = [("a", 1, False), ("p", 50, True), ("q", 256, True)]
    assert plan_batch(waiting, 320, 64) == [(0, 1), (1, 50), (2, 14)]


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 600), st.booleans()), max_size=30),
       st.integers(1, 600), st.integers(0, 128), st.booleans())
def test_split_properties(waiting, budget, piece_rows, busy):
    picked = plan_batch(waiting, budget, piece_rows, busy)
    if not waiting:
        assert picked == []
        return
    taken = [i for i, _ in picked]
    assert taken[0] == 0 and taken == sorted(set(taken))  # the oldest runs; arrival order kept
    assert len({waiting[i][0] for i in taken}) == len(taken)  # one frame per job
    for i in taken:  # never ahead of an earlier frame of its own job
        assert all(waiting[j][0] != waiting[i][0] for j in range(i))
    rows = dict(picked)
    for i, n in picked:
        assert 0 <= n <= waiting[i][1] and (n > 0 or waiting[i][1] == 0)  # a piece is some of its rows
        assert n == waiting[i][1] or waiting[i][2]  # only a splittable frame runs in part
    assert sum(rows.values()) <= budget or taken == [0] or (rows[0] > budget and len(taken) == 1)
    decode_about = busy or any(not split and n for _, n, split in waiting)
    prefill = sum(n for i, n in picked if waiting[i][2])
    if piece_rows and decode_about:
        assert prefill <= piece_rows  # decode rows never wait behind more than one piece of prefill
    else:
        assert all(n == waiting[i][1] for i, n in picked)  # nothing about to protect: whole frames
