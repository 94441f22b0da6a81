"""A finished job's audits are drawn as it arrives, so a backlog holds only drawn stages' frames.

Bug guarded: the auditor drew a job's audits only when an audit slot freed, so while audits
fell behind every queued job's frames stayed on every stage, those no audit would ask for
included: at 32 streams of the full mix a stage held 250 ended jobs (~110 MB), let go in
bursts as the backlog drained (the sustained run's RSS swing, issue 21). Sound: trio's mock
clock; the first drawn audit never gets its frames (its stage never answers), so every other
drawn job waits for the one slot; each ReleaseFrames a stage is sent is recorded. Checked:
within a few seconds every job was drawn, each (job, stage) not drawn was released, a job
with no audit holds nothing, and the drawn ones wait, their frames kept.
"""

from __future__ import annotations

import dataclasses
import random
import time
from types import SimpleNamespace

import trio
import trio.testing

from coordinator.trust.audit import AuditConfig, Auditor
from shard.wire.release_frames import ReleaseFrames
from tests.coordinator.trust.test_audit_replay import finished_job

JOBS, STAGES = 12, 3


class RecordingAuditor(Auditor):
    drawn: dict[str, set[str]]

    def _draw(self, job):
        plans = super()._draw(job)
        self.drawn[job.job_id] = {p.peer_id for p in plans}
        return plans


def test_a_backlog_holds_only_the_frames_of_stages_drawn():
    released: dict[str, set[str]] = {}
    asked: list[str] = []

    async def send_control(peer, msg):
        if isinstance(msg, ReleaseFrames):
            for job_id in msg.job_ids:
                released.setdefault(job_id, set()).add(peer)
            return
        asked.append(msg.job_id)
        await trio.sleep_forever()  # the first audit's stage never answers: the rest queue

    swarm = SimpleNamespace(members={}, faulty={}, send_control=send_control)
    jobs = [dataclasses.replace(finished_job(STAGES, {1: [1, 2]}, {1: 1, 2: 1}), job_id=f"job{i}",
                                finished_s=time.monotonic()) for i in range(JOBS)]

    async def main():
        finished_in, finished = trio.open_memory_channel(JOBS)
        _, replies = trio.open_memory_channel(0)
        auditor = RecordingAuditor(swarm, None, bytes(32), AuditConfig(rate=0.4, max_concurrent_audits=1, spread_s=0.0),
                                   rng=random.Random(3), finished=finished, audit_replies=replies)
        auditor.drawn = {}
        for job in jobs:
            finished_in.send_nowait(job)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            await trio.sleep(5.0)  # the releaser flushes every second
            nursery.cancel_scope.cancel()
        return auditor

    auditor = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    every = {f"peer{i}" for i in range(STAGES)}
    assert set(auditor.drawn) == {job.job_id for job in jobs}  # all drawn, though one slot is stuck
    assert len(set(asked)) == 1  # one audit began; the other drawn jobs wait
    waiting = [j for j, peers in auditor.drawn.items() if peers and j not in asked]
    assert waiting and any(not peers for peers in auditor.drawn.values())  # the seeded draw has both
    for job_id, peers in auditor.drawn.items():
        assert released.get(job_id, set()) == every - peers, job_id
