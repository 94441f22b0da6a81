"""StageScheduler: which waiting frames run together, and what it keeps waiting.

Bugs guarded: frames of a former epoch run on the new epoch's worker (wrong caches), a
frame kept waiting for company, a job's frames run out of order or two in one batch, the
queue growing past its bounds. Sound: run_batch records each batch it is handed; the
test adds frames while a batch is held (each batch waits on an event the test sets) and
looks once every task is blocked, so the batches' contents are determined, not raced.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import trio
import trio.testing

from shard.stage_scheduler import BatchTally, SchedulerConfig, StageScheduler, Waiting


def frame(state, job: str, rows: int, nbytes: int = 100) -> Waiting:
    return Waiting(state, f"{job}:{rows}", memoryview(b""), job, rows, nbytes)


def test_batches_follow_arrivals_and_drop_a_former_epochs_frames():
    batches: list[list[str]] = []
    go = [trio.Event()]
    state = ["epoch1"]

    async def run_batch(st, batch):
        assert st == state[0]
        batches.append([w.msg for w in batch])
        await go[0].wait()
        go[0] = trio.Event()

    async def main():
        sched = StageScheduler(lambda: state[0], run_batch, SchedulerConfig(token_budget=10))
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.serve)
            await sched.submit(frame("epoch1", "a", 2))
            await trio.testing.wait_all_tasks_blocked()
            assert batches == [["a:2"]]  # alone, at once
            for job, rows in (("a", 1), ("b", 8), ("c", 3), ("d", 1)):
                await sched.submit(frame("epoch1", job, rows))
            go[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert batches[1] == ["a:1", "b:8", "d:1"]  # c's 3 rows did not fit the 10
            await sched.submit(frame("epoch1", "e", 1))
            state[0] = "epoch2"
            await sched.submit(frame("epoch2", "f", 1))
            go[0].set()
            await trio.testing.wait_all_tasks_blocked()
            assert batches[2] == ["f:1"] and sched.waiting == []  # c and e were epoch 1's
            go[0].set()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_submit_waits_while_the_bounds_are_reached():
    release = trio.Event()

    async def run_batch(st, batch):
        await release.wait()

    async def main():
        sched = StageScheduler(lambda: "s", run_batch, SchedulerConfig(max_waiting_frames=3, max_waiting_bytes=250))
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.serve)
            await sched.submit(frame("s", "a", 1))  # taken at once; the forward holds
            await trio.testing.wait_all_tasks_blocked()
            await sched.submit(frame("s", "b", 1, nbytes=1000))  # past the bytes, but the queue is empty
            submitted = []

            async def send(job):
                await sched.submit(frame("s", job, 1, nbytes=10))
                submitted.append(job)

            nursery.start_soon(send, "c")
            await trio.testing.wait_all_tasks_blocked()
            assert submitted == [] and len(sched.waiting) == 1  # 1000 + 10 bytes > 250
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert submitted == ["c"]
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_tally_counts_forwards_by_frames_and_rows_with_pieces_as_their_rows():
    # Bug guarded: the logged rows per forward counting a piece as its whole frame or a
    # job's end as rows (issue 21: are batches full at 16 streams?). Sound: hand-made batches.
    # Rows are also counted by their frame's phase (what a stage's rows went to, issue 21).
    s = object()

    def phased(job: str, rows: int, phase: str) -> Waiting:
        return dataclasses.replace(frame(s, job, rows), msg=SimpleNamespace(phase=phase))

    tally = BatchTally(since=10.0)
    tally.add([phased("a", 1, "decode"), phased("b", 5, "prefill")], 0.02)
    tally.add([dataclasses.replace(phased("c", 256, "prefill"), piece=(64, 128)), frame(s, "a", 0)], 0.03)
    tally.add([phased("b", 1, "verify")], 0.01)
    assert tally.by_frames == {2: 2, 1: 1} and tally.rows == 1 + 5 + 64 + 1
    assert tally.by_phase == {"decode": 1, "prefill": 5 + 64, "verify": 1}
    assert tally.summary(now=20.0) == ("3 in 10 s, busy 0.1 s; 1.7 frames and 23.7 rows each (decode 1, prefill 69, "
                                       "verify 1); frames per forward:count 1:1 2:2; waited for bursts 0 times, 0.00 ms each")
