"""A head product's next frames leave together (coordinator.jobs.burst_gate)."""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from coordinator.jobs.burst_gate import GATHER_S, BurstGate
from coordinator.jobs.frames import chunk_frame
from shard.wire.codec import decode_frame, encode_body, encode_trailer
from shard.wire.limits import Limits


def frame(job: str, burst: tuple[int, ...]):
    fwd = dataclasses.replace(chunk_frame(job, 1, b"n" * 16, 5, [7], decode=True, commit=((), 0), aux_layers=()),
                              burst=burst)
    return encode_body(fwd) + encode_trailer(fwd), fwd


class Recorder:
    def __init__(self, fail: bool = False) -> None:
        self.writes: list[tuple[object, float, list]] = []  # (ring, when, decoded frames)
        self.fail = fail

    async def flush(self, ring, bodies: list[bytes]) -> None:
        await trio.lowlevel.checkpoint()
        self.writes.append((ring, trio.current_time(), [decode_frame(b, Limits())[0] for b in bodies]))
        if self.fail:
            raise ConnectionError("stream broke")


def run(main):
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def send_spaced(gate: BurstGate, jobs: int, burst: tuple[int, ...], gap_s: float) -> None:
    """`jobs` jobs of `burst` each send a frame, `gap_s` apart (all sent when it returns)."""
    async with trio.open_nursery() as n:
        for i in range(jobs):
            n.start_soon(gate.send, "ring", *frame(f"j{i}", burst))
            await trio.sleep(gap_s)


def test_a_products_frames_leave_in_one_write_restamped():
    # Bug guarded: a product's 16 jobs sent their frames one by one over 5-15 ms and the
    # head stage ran them as several small forwards. Sound: three jobs send 1 ms apart;
    # one write carries all three, stamped as a burst of exactly three.
    rec = Recorder()
    gate = BurstGate(rec.flush)

    run(lambda: send_spaced(gate, 3, (41, 3), 0.001))
    assert len(rec.writes) == 1
    ring, when, frames = rec.writes[0]
    assert ring == "ring" and sorted(f.job_id for f in frames) == ["j0", "j1", "j2"]
    assert {f.burst for f in frames} == {(frames[0].burst[0], 3)} and when < GATHER_S  # complete: no bound waited


def test_a_job_that_ended_is_not_waited_for_and_the_stamp_counts_what_came():
    rec = Recorder()
    gate = BurstGate(rec.flush)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(send_spaced, gate, 2, (9, 3), 0.001)
            await trio.sleep(0.002)
            gate.leave((9, 3))

    run(main)
    (_, when, frames), = rec.writes
    assert len(frames) == 2 and all(f.burst[1] == 2 for f in frames) and when == pytest.approx(0.002)


def test_a_frame_that_never_comes_costs_at_most_the_bound_and_a_late_one_goes_alone():
    rec = Recorder()
    gate = BurstGate(rec.flush)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(gate.send, "ring", *frame("j0", (5, 3)))
            n.start_soon(gate.send, "ring", *frame("j1", (5, 3)))
            await trio.sleep(2 * GATHER_S)
            await gate.send("ring", *frame("j2", (5, 3)))

    run(main)
    assert [len(f) for _, _, f in rec.writes] == [2, 1]
    assert rec.writes[0][1] == pytest.approx(GATHER_S)
    assert rec.writes[1][2][0].burst == ()  # alone: no company announced


def test_lone_frames_go_at_once_and_rings_get_a_write_each():
    rec = Recorder()
    gate = BurstGate(rec.flush)

    async def main():
        await gate.send("ring", *frame("lone", ()))
        async with trio.open_nursery() as n:
            for i, ring in enumerate(["a", "b", "a"]):
                n.start_soon(gate.send, ring, *frame(f"j{i}", (3, 3)))

    run(main)
    assert rec.writes[0][1] == 0 and rec.writes[0][2][0].burst == ()
    by_ring = {ring: sorted((f.job_id, f.burst[1:]) for f in frames) for ring, _, frames in rec.writes[1:]}
    assert by_ring == {"a": [("j0", (2,)), ("j2", (2,))], "b": [("j1", ())]}  # b's one frame: no company


def test_a_failed_write_reaches_every_job_in_it():
    rec = Recorder(fail=True)
    gate = BurstGate(rec.flush)
    failed = []

    async def one(i):
        try:
            await gate.send("ring", *frame(f"j{i}", (8, 2)))
        except ConnectionError:
            failed.append(i)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(one, 0)
            n.start_soon(one, 1)

    run(main)
    assert sorted(failed) == [0, 1] and len(rec.writes) == 1


def test_a_cancelled_first_job_still_sends_the_others_frames():
    rec = Recorder()
    gate = BurstGate(rec.flush)
    leader = trio.CancelScope()

    async def lead():
        with leader:
            await gate.send("ring", *frame("j0", (4, 3)))

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(lead)
            await trio.sleep(0.001)
            n.start_soon(gate.send, "ring", *frame("j1", (4, 3)))
            await trio.sleep(0.001)
            leader.cancel()

    run(main)
    assert [[f.job_id for f in frames] for _, _, frames in rec.writes] == [["j0", "j1"]]
    assert rec.writes[0][1] == pytest.approx(0.002)


def test_a_job_that_waits_for_a_result_instead_of_sending_leaves_its_burst():
    # Bug guarded: a pipelined job whose next round was already in flight sent nothing
    # after its head product, and the product's other frames waited out the bound for it.
    from coordinator.jobs import head_batch
    from coordinator.jobs.engine_config import EngineConfig
    from coordinator.jobs.ring_job import RingJob
    from coordinator.spec.sampling import SamplingParams

    class Port:
        left: list = []
        ring = None

        def leave_burst(self, burst):
            self.left.append(burst)

    class Ring:
        epoch = 1

    port = Port()
    _, inbox = trio.open_memory_channel(1)
    job = RingJob(port, "j", [1, 2], SamplingParams(temperature=0.0), inbox, EngineConfig(draft="none"),
                  head=None, max_context_tokens=64)

    async def main():
        head_batch._NEXT.set((7, 3))  # what the job's head product handed its task
        with trio.move_on_after(0.01):
            await job._receive(Ring(), 1)
        assert head_batch.take_next_burst() == ()

    run(main)
    assert port.left == [(7, 3)]


def test_a_frame_that_comes_while_its_burst_is_being_written_is_sent_alone():
    # Bug guarded (bench_load, 16 streams, 240 s windows: three runs in four): the first
    # frame's write was under way (the stream busy, the flush awaiting) when late frames of
    # its burst came; they joined the list already taken for the write, were never written,
    # and were told they were sent: their jobs waited for Results that could not come, 120 s
    # (the round's cap), then the misses blamed an honest stage and the ring re-formed
    # under every job. Sound: the write blocks until the late frame has come; the late
    # frame must still leave, in a write of its own, stamped as no burst.
    writes, release, started = [], trio.Event(), trio.Event()

    async def flush(ring, bodies):
        first = not started.is_set()
        started.set()
        if first:
            await release.wait()  # the first write takes a while: the stream is busy
        writes.append([decode_frame(b, Limits())[0] for b in bodies])

    gate = BurstGate(flush)

    async def main():
        async with trio.open_nursery() as n:
            n.start_soon(gate.send, "ring", *frame("j0", (7, 3)))
            await started.wait()  # the bound passed: j0's write is under way, alone
            with trio.move_on_after(1):
                await gate.send("ring", *frame("j1", (7, 3)))  # late: must not wait for nothing
            release.set()
            await trio.sleep(0.1)
            if len(writes) < 2:  # j1's send returned without a write of its own
                n.cancel_scope.cancel()
    run(main)
    assert sorted([f.job_id for f in w] for w in writes) == [["j0"], ["j1"]]
    assert all(w[0].burst == () for w in writes)
