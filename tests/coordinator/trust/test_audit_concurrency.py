"""The auditor audits several finished jobs at once, up to AuditConfig.max_concurrent_audits.

Bug guarded: audits ran one job at a time, and an audit mostly waits (on the stage's logged
frames, on a verifier's recomputation): at 16 streams helper C saw 1 audit in a 40 s window
and the rest of the queue aged past max_job_age_s into `skipped_stale`. Sound: real trio
timing; each stage answers its audit requests only after DELAY_S (then has left the swarm:
TransportError, so nobody is accused and no receipts are needed); the peak of jobs whose
requests are outstanding at once is the bound, never more, and N jobs take about
N / bound delays, not N. (Starts spread over AuditConfig.spread_s: test_audit_spread.py.)
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import trio

from coordinator.trust.audit import AuditConfig, Auditor
from shard.errors import TransportError
from shard.wire.release_frames import ReleaseFrames
from tests.coordinator.trust.test_audit_replay import finished_job

DELAY_S = 0.25
JOBS = 8


def run_audits(bound: int) -> tuple[Auditor, int, float]:
    """(the auditor, the peak of jobs audited at once, seconds until all JOBS were handled)."""
    waiting: dict[str, int] = {}
    peak = [0]

    async def send_control(peer, msg):  # a stage that takes DELAY_S and then is gone
        if isinstance(msg, ReleaseFrames):  # its frames released once its audit was skipped
            return
        waiting[msg.job_id] = waiting.get(msg.job_id, 0) + 1
        peak[0] = max(peak[0], len(waiting))
        try:
            await trio.sleep(DELAY_S)
        finally:
            waiting[msg.job_id] -= 1
            if not waiting[msg.job_id]:
                del waiting[msg.job_id]
        raise TransportError(f"{peer} left")

    swarm = SimpleNamespace(members={}, faulty={}, send_control=send_control)
    jobs = [dataclasses.replace(finished_job(1, {1: [1, 2]}, {1: 1, 2: 1}), job_id=f"job{i}") for i in range(JOBS)]

    async def main():
        finished_in, finished = trio.open_memory_channel(JOBS)
        _, replies = trio.open_memory_channel(0)
        auditor = Auditor(swarm, None, bytes(32), AuditConfig(rate=1.0, max_concurrent_audits=bound, spread_s=0.0),
                          rng=random.Random(0), finished=finished, audit_replies=replies)
        for job in jobs:
            finished_in.send_nowait(job)
        async with trio.open_nursery() as nursery:
            start = trio.current_time()
            await nursery.start(auditor.serve)
            await auditor.wait_idle()
            elapsed = trio.current_time() - start
            nursery.cancel_scope.cancel()
        return auditor, peak[0], elapsed

    return trio.run(main)


def test_queued_audits_run_concurrently_up_to_the_bound():
    auditor, peak, elapsed = run_audits(4)
    assert auditor.stats.skipped_gone == JOBS and auditor.stats.skipped_stale == 0
    assert peak == 4
    assert 2 * DELAY_S <= elapsed < 4 * DELAY_S  # 8 jobs, 4 at a time: two delays (one at a time: eight)


def test_a_bound_of_one_audits_one_job_at_a_time():
    auditor, peak, elapsed = run_audits(1)
    assert auditor.stats.skipped_gone == JOBS and peak == 1 and elapsed >= JOBS * DELAY_S
