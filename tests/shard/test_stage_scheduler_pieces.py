"""StageScheduler with pieces: a long prefill chunk runs beside decode rows a piece at a time.

Bugs guarded: a chunk run whole while decode rows wait (they stall for its whole forward),
a job's later frame overtaking its part-done frame (it needs the K/V the rest writes), a
piece handed out twice or a row skipped, a failed piece's frame kept running piece after
piece, a former epoch's part-done frame resumed on the new one, a part-done frame's kept
outputs outside the memory bound, a lone prompt cut into pieces for nobody. Sound:
run_batch records (message, piece) per batch and each batch waits on an event the test
sets, so the test reads the queue only while every task is blocked; the clock is the
test's own number.
"""

from __future__ import annotations

import trio
import trio.testing

from shard.stage_scheduler import SchedulerConfig, StageScheduler, Waiting


def frame(state, job: str, rows: int, split: int = 0, nbytes: int = 100) -> Waiting:
    return Waiting(state, f"{job}:{rows}", memoryview(b""), job, rows, nbytes, split)


class Harness:
    """A scheduler whose run_batch records each batch, holds until `step()`, and reports
    the jobs in `fail` as failed."""

    def __init__(self, config: SchedulerConfig, state: str = "e1") -> None:
        self.batches: list[list[tuple[str, tuple[int, int] | None]]] = []
        self.go, self.fail, self.state, self.now = trio.Event(), set(), [state], [0.0]
        self.sched = StageScheduler(lambda: self.state[0], self.run_batch, config, clock=lambda: self.now[0])

    async def run_batch(self, state, batch):
        self.batches.append([(w.msg, w.piece) for w in batch])
        await self.go.wait()
        self.go = trio.Event()
        return [w.job_id for w in batch if w.job_id in self.fail]

    async def step(self):
        self.go.set()
        await trio.testing.wait_all_tasks_blocked()


def run(test):
    async def main():
        async with trio.open_nursery() as nursery:
            await test(nursery)
            nursery.cancel_scope.cancel()
    trio.run(main)


def test_a_chunk_runs_in_pieces_beside_decode_rows_and_its_job_waits_behind_it():
    h = Harness(SchedulerConfig(token_budget=320, piece_rows=64))

    async def test(nursery):
        await nursery.start(h.sched.serve)
        await h.sched.submit(frame("e1", "a", 1))  # runs at once, alone: a is decoding
        await trio.testing.wait_all_tasks_blocked()
        for w in (frame("e1", "p", 150, split=8, nbytes=1000), frame("e1", "p", 20, split=8),
                  frame("e1", "a", 1), frame("e1", "b", 1)):
            await h.sched.submit(w)
        await h.step()
        assert h.batches[1] == [("p:150", (0, 64)), ("a:1", None), ("b:1", None)]
        # The part-done frame keeps its place; its 64 rows of outputs count (8 bytes a row).
        assert [w.msg for w in h.sched.waiting] == ["p:150", "p:20"]
        assert h.sched.waiting_bytes == 1000 + 100 + 64 * 8
        await h.sched.submit(frame("e1", "a", 1))
        await h.step()
        assert h.batches[2] == [("p:150", (64, 128)), ("a:1", None)]
        await h.step()
        # Nothing but p waits, but a decoded within the busy window: still a piece, the last.
        assert h.batches[3] == [("p:150", (128, 150))]
        await h.step()
        assert h.batches[4] == [("p:20", None)]  # a frame that fits one piece runs whole
        assert h.sched.waiting == [] and h.sched.waiting_bytes == 0
        h.go.set()

    run(test)


def test_a_lone_prompt_runs_whole_and_the_busy_window_expires():
    h = Harness(SchedulerConfig(token_budget=320, piece_rows=64, busy_window_s=1.0))

    async def test(nursery):
        await nursery.start(h.sched.serve)
        await h.sched.submit(frame("e1", "p", 300, split=8))
        await trio.testing.wait_all_tasks_blocked()
        assert h.batches == [[("p:300", None)]]  # nobody decodes: whole, past the budget even
        await h.step()
        await h.sched.submit(frame("e1", "a", 1))  # a decodes at t = 0
        await trio.testing.wait_all_tasks_blocked()
        await h.step()
        h.now[0] = 0.5
        await h.sched.submit(frame("e1", "q", 100, split=8))
        await trio.testing.wait_all_tasks_blocked()
        assert h.batches[2] == [("q:100", (0, 64))]  # a decoded 0.5 s ago: it will be back
        h.now[0] = 2.0
        await h.step()
        assert h.batches[3] == [("q:100", (64, 100))]  # a gone quiet: the rest at once
        await h.step()
        await h.sched.submit(frame("e1", "a", 1))
        await trio.testing.wait_all_tasks_blocked()
        await h.sched.submit(frame("e1", "a", 0))  # a's end
        await h.sched.submit(frame("e1", "r", 100, split=8))
        await h.step()
        assert h.batches[-1] == [("a:0", None), ("r:100", None)]  # a ends: nobody left to protect
        h.go.set()

    run(test)


def test_a_failed_piece_ends_its_frame_and_its_job_goes_on():
    h = Harness(SchedulerConfig(token_budget=320, piece_rows=64))

    async def test(nursery):
        await nursery.start(h.sched.serve)
        await h.sched.submit(frame("e1", "a", 1))
        await trio.testing.wait_all_tasks_blocked()
        for w in (frame("e1", "p", 200, split=8), frame("e1", "a", 1), frame("e1", "p", 10, split=8)):
            await h.sched.submit(w)
        await h.step()
        assert h.batches[1] == [("p:200", (0, 64)), ("a:1", None)]
        h.fail.add("p")  # that piece fails
        await h.step()
        # The failed frame left; p's next frame (say, its re-prefill) runs from its start.
        assert h.batches[2] == [("p:10", None)]
        assert h.sched.waiting == [] and h.sched.done == {}
        h.go.set()

    run(test)


def test_an_epoch_change_drops_a_part_done_frame():
    h = Harness(SchedulerConfig(token_budget=320, piece_rows=64))

    async def test(nursery):
        await nursery.start(h.sched.serve)
        await h.sched.submit(frame("e1", "a", 1))
        await trio.testing.wait_all_tasks_blocked()
        await h.sched.submit(frame("e1", "p", 200, split=8))
        await h.sched.submit(frame("e1", "a", 1))
        await h.step()
        assert h.batches[1][0] == ("p:200", (0, 64)) and h.sched.done == {"p": 64}
        h.state[0] = "e2"
        await h.sched.submit(frame("e2", "p", 30, split=8))
        await h.step()
        assert h.batches[2] == [("p:30", None)]
        assert h.sched.waiting == [] and h.sched.done == {} and h.sched.waiting_bytes == 0
        h.go.set()

    run(test)


def test_kept_outputs_hold_back_submit_at_the_byte_bound():
    h = Harness(SchedulerConfig(token_budget=320, piece_rows=64, max_waiting_bytes=2000))

    async def test(nursery):
        await nursery.start(h.sched.serve)
        await h.sched.submit(frame("e1", "a", 1))
        await trio.testing.wait_all_tasks_blocked()
        await h.sched.submit(frame("e1", "p", 150, split=20, nbytes=500))
        await h.sched.submit(frame("e1", "a", 1))
        await h.step()
        assert h.sched.waiting_bytes == 500 + 64 * 20  # 1780: a 300-byte frame no longer fits
        submitted = []

        async def send():
            await h.sched.submit(frame("e1", "b", 1, nbytes=300))
            submitted.append("b")

        nursery.start_soon(send)
        await trio.testing.wait_all_tasks_blocked()
        assert submitted == []
        await h.step()  # p's second piece: 128 rows kept, 500 + 2560 bytes, still full
        assert submitted == []
        await h.step()  # p's last piece taken: it leaves, and b gets in
        assert submitted == ["b"]
        h.go.set()

    run(test)
