"""A cluster of jobs that end together starts its audits spread over AuditConfig.spread_s.

Bug guarded: clients' requests end in clusters (a closed loop's every ~10 s at 16 streams), and
their audits, begun together, took the ring's CPU in bursts just as the cluster's next
requests were starting (the 16-stream ITL tail and TTFT, issue 21). Sound: trio's own clock
and a seeded rng; each stage answers an audit request by leaving the swarm 0.2 s later
(TransportError: nobody is accused and no receipts are needed), so a job's audit start is
the time its first AuditRequest is sent. Checked: a job alone starts at once; of a cluster, the first at once
and the others at distinct times within spread_s, every one audited; a backlog past
max_queued_jobs is not spread; a start that waited past max_job_age_s is skipped as stale,
its drawn stages told to drop their frames.
"""

from __future__ import annotations

import dataclasses
import random
import time
from types import SimpleNamespace

import trio
import trio.testing

from coordinator.trust.audit import AuditConfig, Auditor
from shard.errors import TransportError
from shard.wire.release_frames import ReleaseFrames
from tests.coordinator.trust.test_audit_replay import finished_job


def run_cluster(jobs: int, config: AuditConfig, clock=None) -> tuple[Auditor, dict[str, float], list]:
    """Hand `jobs` finished jobs (one stage each) over at once; (the auditor, each job's
    first audit request's time after serve started, the ReleaseFrames sent)."""
    started: dict[str, float] = {}
    released: list = []

    async def send_control(peer, msg):
        if isinstance(msg, ReleaseFrames):
            released.append(msg)
            return
        started.setdefault(msg.job_id, trio.current_time() - t0[0])
        await trio.sleep(0.2)  # an audit takes a while: the cluster's other jobs find it in flight
        raise TransportError(f"{peer} left")

    t0 = [0.0]
    swarm = SimpleNamespace(members={}, faulty={}, send_control=send_control)
    cluster = [dataclasses.replace(finished_job(1, {1: [1, 2]}, {1: 1, 2: 1}), job_id=f"job{i}",
                                   finished_s=time.monotonic()) for i in range(jobs)]

    async def main():
        finished_in, finished = trio.open_memory_channel(jobs)
        _, replies = trio.open_memory_channel(0)
        auditor = Auditor(swarm, None, bytes(32), config, rng=random.Random(0), finished=finished,
                          audit_replies=replies)
        for job in cluster:
            finished_in.send_nowait(job)
        async with trio.open_nursery() as nursery:
            t0[0] = trio.current_time()
            await nursery.start(auditor.serve)
            await auditor.wait_idle()
            await trio.sleep(1.0)  # the releaser's batched ReleaseFrames go out
            nursery.cancel_scope.cancel()
        return auditor

    auditor = trio.run(main, clock=clock)
    return auditor, started, released


def test_a_job_alone_starts_its_audit_at_once():
    auditor, started, _ = run_cluster(1, AuditConfig(rate=1.0, spread_s=10.0),
                                      trio.testing.MockClock(autojump_threshold=0))
    assert started == {"job0": 0.0} and auditor.stats.skipped_gone == 1


def test_a_cluster_starts_its_audits_spread_over_spread_s_and_audits_every_job():
    auditor, started, _ = run_cluster(8, AuditConfig(rate=1.0, spread_s=10.0, max_concurrent_audits=4),
                                      trio.testing.MockClock(autojump_threshold=0))
    times = sorted(started.values())
    assert len(started) == 8 and auditor.stats.skipped_gone == 8 and auditor.stats.skipped_stale == 0
    assert times[0] == 0.0 and all(t <= 10.0 for t in times)
    assert len(set(times)) == 8 and times[-1] > 5.0  # one at a time, not together (seeded draws)
    # Without a spread, the first four start together (the slots' bound), as before.
    _, together, _ = run_cluster(8, AuditConfig(rate=1.0, spread_s=0.0, max_concurrent_audits=4),
                                 trio.testing.MockClock(autojump_threshold=0))
    assert sorted(together.values())[:4] == [0.0] * 4


def test_a_backlog_past_max_queued_jobs_is_not_spread():
    # Sleeping starts are bounded: past max_queued_jobs jobs in flight, a job starts as a slot frees.
    auditor, started, _ = run_cluster(8, AuditConfig(rate=1.0, spread_s=10.0, max_concurrent_audits=4,
                                                     max_queued_jobs=2), trio.testing.MockClock(autojump_threshold=0))
    times = sorted(started.values())
    assert len(started) == 8 and auditor.stats.skipped_gone == 8
    assert times[:4] == [0.0] * 4 and sum(t < 1.0 for t in times) >= 6  # spread only while <= 2 are in flight


def test_a_start_that_waited_past_max_job_age_s_is_skipped_as_stale_and_its_frames_released():
    # Real time: the age is measured on time.monotonic, as the receipt checker stamps it.
    auditor, started, released = run_cluster(4, AuditConfig(rate=1.0, spread_s=3.0, max_job_age_s=0.3))
    assert "job0" in started  # the first one started at once
    stale = {f"job{i}" for i in range(4)} - set(started)
    assert stale and auditor.stats.skipped_stale == len(stale)
    assert stale <= {job for msg in released for job in msg.job_ids}
