"""plan_batch: which waiting frames share a stage's next forward, and which rows of each.

Bugs guarded: a job's later frame run before (or beside) its earlier one (it needs the K/V
the earlier one writes: wrong states, silently), a long prefill chunk walling off the
decode rows behind it, the oldest frame starved by a stream of small ones, a batch past
its token budget, a prefill chunk run whole beside waiting decode rows (they wait for its
whole forward), a lone prompt cut into pieces for nobody (its TTFT grows), a short prompt
queued behind a long prompt's pieces, a long prompt starved by short ones. Sound: the
properties below are checked over random queues, and the examples pin the exact choice.
"""

from __future__ import annotations

from hypothesis import given, strategies as st

from shard.batch_plan import PREFILL_ORDERS, passed_over, plan_batch, prefill_rank


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


def test_a_short_prompt_does_not_wait_behind_a_long_prompts_pieces():
    # Bug guarded (bench_load, 16 streams, 1 in 4 prompts 1.9k tokens): a 43-token prompt's
    # chunk waited behind every earlier long prompt's ~30 pieces. Sound: the same queue in
    # arrival order gives the long chunk the whole allowance and the short one nothing.
    waiting = [("L", 256, True), ("L", 256, True), ("a", 1, False), ("s", 43, True)]
    assert plan_batch(waiting, 320, 64) == [(0, 21), (2, 1), (3, 43)]
    assert plan_batch(waiting, 320, 64, order="arrival") == [(0, 64), (2, 1)]
    # Remaining counts the job's later chunks waiting here: 200 + 256 left against 300.
    waiting = [("L", 200, True), ("L", 256, True), ("M", 300, True), ("a", 1, False)]
    assert plan_batch(waiting, 320, 64) == [(2, 64), (3, 1)]
    # Aged: passed over max_passes times, the long chunk goes first again.
    assert plan_batch(waiting, 320, 64, passed={"L": 8}) == [(0, 64), (3, 1)]
    assert plan_batch(waiting, 320, 64, passed={"L": 7}) == [(2, 64), (3, 1)]
    # Whole chunks (no decode rows about): shortest first too; the first place runs.
    assert plan_batch([("L", 256, True), ("s", 43, True), ("t", 43, True)], 320, 64) == [(1, 43), (2, 43)]
    assert plan_batch([("L", 256, True), ("s", 43, True)], 60, 64) == [(1, 43)]


def test_passed_over_counts_chunks_left_without_rows_and_forgets_the_rest():
    waiting = [("L", 256, True), ("L", 256, True), ("a", 1, False), ("s", 43, True), ("t", 0, False)]
    assert passed_over(waiting, [(2, 1), (3, 43)], {"L": 3, "s": 5, "a": 2}) == {"L": 4}
    assert passed_over(waiting, [(0, 21), (2, 1), (3, 43)], {"L": 3}) == {}
    assert passed_over([("L", 0, True)], [], {"L": 3}) == {}  # no rows: nothing to pass over


def test_a_long_prompt_under_a_stream_of_short_ones_gets_a_piece_every_max_passes_forwards():
    # Bug guarded: shortest-first starving a long prompt while short prompts keep coming.
    # Sound: every forward a new 64-row prompt arrives (enough to take the whole allowance
    # on its own), beside decode rows; the long prompt must still finish, and never go
    # more than max_passes forwards without a piece.
    queue = [("L", 256, True)] * 4
    passed, since, gaps, k = {}, 0, [], 0
    while any(job == "L" for job, _, _ in queue):
        queue.append((f"s{k}", 64, True))
        queue.append((f"d{k}", 1, False))
        k += 1
        picked = plan_batch(queue, 320, 64, passed=passed, max_passes=8)
        passed = passed_over(queue, picked, passed)
        ran = dict(picked)
        since = 0 if any(queue[i][0] == "L" for i in ran) else since + 1
        gaps.append(since)
        queue = [(job, rows - ran.get(i, 0), split) for i, (job, rows, split) in enumerate(queue)
                 if rows - ran.get(i, 0) > 0]
        assert k < 1000
    assert max(gaps) == 8  # passed over 8 times, then first
    # Every other forward's allowance went to a short prompt: one arrives per forward, so
    # those still waiting are exactly the forwards the long prompt took (16 pieces of 64).
    assert sum(1 for job, _, _ in queue if job.startswith("s")) == gaps.count(0) == 16


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(0, 600), st.booleans()), max_size=30),
       st.integers(1, 600), st.integers(0, 128), st.booleans(),
       st.dictionaries(st.sampled_from("abcdef"), st.integers(0, 12)), st.sampled_from(PREFILL_ORDERS))
def test_split_properties(waiting, budget, piece_rows, busy, passed, order):
    picked = plan_batch(waiting, budget, piece_rows, busy, passed, order, max_passes=4)
    if not waiting:
        assert picked == []
        return
    taken = [i for i, _ in picked]
    assert taken and taken == sorted(set(taken))  # something runs; arrival order kept
    assert len({waiting[i][0] for i in taken}) == len(taken)  # one frame per job
    for i in taken:  # never ahead of an earlier frame of its own job
        assert all(waiting[j][0] != waiting[i][0] for j in range(i))
    rows = dict(picked)
    for i, n in picked:
        assert 0 <= n <= waiting[i][1] and (n > 0 or waiting[i][1] == 0)  # a piece is some of its rows
        assert n == waiting[i][1] or waiting[i][2]  # only a splittable frame runs in part
    assert sum(rows.values()) <= budget or len(taken) == 1  # within budget, or one frame alone
    # The oldest frame runs unless it is a chunk that shorter ones passed (not yet aged).
    if not waiting[0][2] or order == "arrival" or passed.get(waiting[0][0], 0) >= 4:
        assert taken[0] == 0
    decode_about = busy or any(not split and n for _, n, split in waiting)
    prefill = sum(n for i, n in picked if waiting[i][2])
    if piece_rows and decode_about:
        assert prefill <= piece_rows  # decode rows never wait behind more than one piece of prefill
        # Prefill order: a chunk left without rows never ranks before one that got rows.
        remaining = {}
        for job, n, _ in waiting:
            remaining[job] = remaining.get(job, 0) + n
        key = prefill_rank(waiting, remaining, passed, order, 4)
        firsts = {}
        for i, (job, _, _) in enumerate(waiting):
            firsts.setdefault(job, i)
        chunks = [i for i in firsts.values() if waiting[i][2] and waiting[i][1] > 0]
        for a in chunks:
            for b in chunks:
                if rows.get(a, 0) > 0 and b not in rows:
                    assert key(a) < key(b)
    else:
        assert all(n == waiting[i][1] for i, n in picked)  # nothing about to protect: whole frames
