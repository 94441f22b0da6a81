"""A job waiting for its ring: a deadline, and stale ring notifications that cost nothing.

Bugs guarded (issue 19, measured on namespaces): a request in flight while a stage was
down waited in `wait_ring()` with no deadline (151 s), then burnt its remaining resume
attempts in ~10 ms on the RingLost notifications queued while it waited, and failed
with 503 although the ring was back. The job runs against a fake port (the ring as one
job sees it) on trio's mock clock, so waits are exact and cost no wall time.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from coordinator.errors import NotReadyError, RingLost, RingWaitTimeout
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.port import Arrived
from coordinator.jobs.ring_job import RingJob
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.swarm import RingState
from shard.wire.codec import decode_frame
from shard.wire.limits import Limits
from shard.wire.messages import Result

HIDDEN = 8


class EchoPort:
    """A ring that answers every frame at once with a (1, HIDDEN) Result of its round, on
    whichever ring is current; `ring` is set by the test."""

    def __init__(self, inbox: trio.MemorySendChannel) -> None:
        self.ring: RingState | None = None
        self.inbox = inbox
        self.ring_formed = trio.Event()
        self.stalled_epochs: set[int] = set()  # rings whose stages accept frames and answer nothing
        self.missed: list[tuple[int, int]] = []  # (epoch, round) reported missed

    def form(self, epoch: int) -> None:
        self.ring = RingState(epoch=epoch, stages=(), assignments=())
        self.ring_formed.set()

    async def wait_ring(self) -> RingState:
        await self.ring_formed.wait()
        return self.ring

    async def wait_change(self, epoch: int, timeout_s: float) -> None:
        await trio.lowlevel.checkpoint()

    async def send_body(self, ring: RingState, body: bytes, sent=None) -> None:
        if ring.epoch in self.stalled_epochs:
            return
        fwd, _ = decode_frame(body, Limits())
        self.inbox.send_nowait(Arrived(Result(job_id=fwd.job_id, epoch=ring.epoch, round=fwd.round,
                                              hidden=torch.zeros(1, HIDDEN), compute_s=(0.0,)), b""))

    def record_traversal(self, t) -> None:
        pass

    def prefix_for(self, ring, prompt, drafters):
        return None  # no prefix cache here

    def fork_failed(self, source: str) -> None:
        pass

    def keep_source(self, ring, job_id: str, tokens, drafters) -> bool:
        return False

    def round_timer(self, ring: RingState, shape):
        return trio.fail_after(4.0 * shape.frames)

    def round_missed(self, ring: RingState, round: int) -> None:
        self.missed.append((ring.epoch, round))
        self.form(ring.epoch + 1)  # the swarm re-forms without the stage it blamed


def job_on(config: EngineConfig) -> tuple[RingJob, EchoPort]:
    send, recv = trio.open_memory_channel(64)
    port = EchoPort(send)
    job = RingJob(port, "job", [1, 2, 3], SamplingParams(temperature=0.0), recv, config, head=None,
                  max_context_tokens=64)
    job.committed = [1, 2, 3]
    return job, port


def test_a_job_waiting_for_a_ring_fails_with_a_503_cause_when_its_deadline_passes():
    async def main():
        job, _ = job_on(EngineConfig(ring_wait_s=30.0))
        t0 = trio.current_time()
        with pytest.raises(RingWaitTimeout) as caught:
            await job._verify(DraftTree.empty(), 64)
        return trio.current_time() - t0, caught.value

    waited_s, error = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert waited_s == pytest.approx(30.0)
    # NotReadyError is what the gateway answers 503 for (coordinator.gateway.api.STATUS_OF).
    assert isinstance(error, NotReadyError)
    assert str(error) == ("engine not ready: no ring formed within 30 s (nodes left or cannot reach each other); "
                          "retry once nodes have joined")


def test_notifications_of_rings_gone_before_the_current_one_are_not_failed_attempts():
    async def main():
        job, port = job_on(EngineConfig(max_resumes=1))
        for _ in range(5):  # the ring went away and came back several times while the job waited
            port.inbox.send_nowait(RingLost())
        port.form(epoch=7)
        rows, _, _, _ = await job._verify(DraftTree.empty(), 64)
        return job, rows

    job, rows = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert rows.shape == (1, HIDDEN)
    assert job.ring_epoch == 7 and job.counts.resumes == 0


def test_a_job_resumes_on_the_ring_that_forms_while_it_waits():
    async def main():
        job, port = job_on(EngineConfig(ring_wait_s=60.0))
        async with trio.open_nursery() as nursery:
            result = []

            async def verify():
                result.append(await job._verify(DraftTree.empty(), 64))

            nursery.start_soon(verify)
            await trio.sleep(20.0)
            assert not result  # still waiting: no ring yet
            port.form(epoch=3)
        return job, result

    job, result = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert result and job.ring_epoch == 3


def test_a_ring_lost_after_the_round_started_still_ends_the_round():
    async def main():
        job, port = job_on(EngineConfig())
        port.form(epoch=4)
        port.ring = RingState(epoch=5, stages=(), assignments=())  # the ring changed under the job
        port.inbox.send_nowait(RingLost())
        with pytest.raises(RingLost):
            await job._receive(RingState(epoch=4, stages=(), assignments=()), 1)

    trio.run(main)


def test_a_round_past_its_deadline_is_reported_once_and_the_job_resumes_on_the_next_ring():
    # Bug guarded (issue 20): a stage that accepts frames and never answers held a request
    # for 120 s per frame, four times over, and nobody was told. Sound: on the mock clock
    # the round ends exactly at the port's deadline, the port hears of that round on that
    # ring once, and the result comes from the ring formed after it.
    async def main():
        job, port = job_on(EngineConfig())
        port.stalled_epochs.add(4)
        port.form(epoch=4)
        t0 = trio.current_time()
        rows, _, _, _ = await job._verify(DraftTree.empty(), 64)
        return job, port, rows, trio.current_time() - t0

    job, port, rows, took_s = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert port.missed == [(4, 1)] and took_s == pytest.approx(4.0)
    assert rows.shape == (1, HIDDEN) and job.ring_epoch == 5
