"""Which stages are told to drop a finished job's frames, and when (coordinator.trust.frame_release).

Guards issue 21's memory under load from the coordinator's side: a stage kept every job's
frames for grace_s (300 s) although most are never audited. Stages the audit draw leaves
out must be released as soon as the draw is made; a drawn stage only once its audit is
over (released earlier, its log would read as missing records: an honest stage accused).
Sound: the auditor here is the real one with a real draw (its rng seeded, the expected
draw recomputed by plan_audits with the same seed), and a drawn stage's audit is held open
until the test has looked; only the swarm's control streams are replaced.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import trio
import trio.testing

from coordinator.trust.audit import AuditConfig, Auditor
from coordinator.trust.audit_plan import plan_audits
from coordinator.trust.frame_release import FrameReleaser
from shard.errors import TransportError
from shard.wire.limits import Limits
from shard.wire.release_frames import MAX_RELEASE_JOBS, ReleaseFrames
from tests.coordinator.trust.test_audit_replay import finished_job

SEED = 0


def _audit(job, rate: float, max_job_age_s: float = 240.0):
    """Run one job through a real Auditor; returns (auditor, released before the first drawn
    stage's audit ended, released at the end) as sets of (stage, epoch)."""
    released: set[tuple[str, int]] = set()
    asked, gone = trio.Event(), trio.Event()
    before = []

    async def send_control(peer, msg):
        if isinstance(msg, ReleaseFrames):
            assert set(msg.job_ids) == {job.job_id}
            released.update((peer, e) for e in msg.epochs)
            return
        asked.set()  # an AuditRequest: the drawn stage answers only once it has left
        await gone.wait()
        raise TransportError(f"{peer} left")

    swarm = SimpleNamespace(members={}, faulty={}, send_control=send_control, control_limits=Limits())

    async def main():
        finished_in, finished = trio.open_memory_channel(1)
        _, replies = trio.open_memory_channel(0)
        auditor = Auditor(swarm, None, bytes(32), AuditConfig(rate=rate, max_job_age_s=max_job_age_s),
                          rng=random.Random(SEED), finished=finished, audit_replies=replies)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            finished_in.send_nowait(job)
            with trio.fail_after(10):
                if max_job_age_s > 0 and plan_audits(job, rate, random.Random(SEED)):
                    await asked.wait()  # the first drawn stage's audit is under way
                else:
                    await auditor.wait_idle()
            await auditor.releaser.flush()
            before.append(set(released))
            gone.set()
            await auditor.wait_idle()
            await auditor.releaser.flush()
            nursery.cancel_scope.cancel()
        return auditor

    auditor = trio.run(main)
    return auditor, before[0], released


def test_stages_not_drawn_are_released_at_once_and_a_drawn_one_after_its_audit():
    job = finished_job(4, {1: [1, 2], 2: [3]}, {1: 1, 2: 1, 3: 2})  # two epochs, four stages each
    every = {(f"peer{i}", e) for i in range(4) for e in (1, 2)}
    drawn = {(p.peer_id, p.epoch) for p in plan_audits(job, 0.5, random.Random(SEED))}
    assert drawn and drawn != every  # the seed draws some stages and leaves others
    auditor, before, after = _audit(job, 0.5)
    assert before == every - drawn
    assert after == every and auditor.stats.skipped_gone == len(drawn)


def test_a_job_never_audited_is_released_whole():
    # Rate 0 (audits off) and a job whose turn came past max_job_age_s: no audit will ask.
    job = finished_job(3, {1: [1, 2]}, {1: 1, 2: 1})
    every = {(f"peer{i}", 1) for i in range(3)}
    for rate, age in ((0.0, 240.0), (1.0, -1.0)):
        auditor, before, after = _audit(job, rate, age)
        assert before == after == every and auditor.stats.audits == 0


def test_releases_are_batched_per_stage_a_full_batch_goes_at_once_and_a_gone_stage_is_dropped():
    sent: list[tuple[str, int]] = []

    async def send_control(peer, msg):
        if peer == "gone":
            raise TransportError("gone left", peer)
        sent.append((peer, len(msg.job_ids)))

    async def main():
        releaser = FrameReleaser(send_control, flush_s=1000.0)  # the mock clock never gets there
        async with trio.open_nursery() as nursery:
            await nursery.start(releaser.serve)
            releaser.release("gone", "j", 1)
            for i in range(MAX_RELEASE_JOBS + 5):
                releaser.release("p", f"j{i}", 1)
            await trio.testing.wait_all_tasks_blocked()
            nursery.cancel_scope.cancel()
        return releaser

    releaser = trio.run(main, clock=trio.testing.MockClock())
    assert sent == [("p", MAX_RELEASE_JOBS), ("p", 5)]
    assert releaser.sent == MAX_RELEASE_JOBS + 5 and releaser.dropped == 1


def test_a_job_whose_receipts_failed_goes_to_release_not_to_the_audit_queue(tiny_llama_store):
    # A job whose receipt chain was rejected gets no bundle and no audit (the chain itself
    # blamed a stage); its stages' frames would otherwise wait out grace_s. Sound: the
    # checker is the real one; only the job's failed state is set by hand (reaching it takes
    # a ring that signs wrong receipts: tests/e2e/test_receipts_ring.py).
    from coordinator.trust.receipt_check import ReceiptChecker

    unaudited = []
    finished_in, finished = trio.open_memory_channel(1)
    checker = ReceiptChecker(tiny_llama_store, bytes(32), finished=finished_in, unaudited=unaudited.append)
    ran = finished_job(3, {1: [1, 2]}, {1: 1, 2: 1})
    job = checker.open_job("job", bytes(16), [1, 2, 3])
    job._order, job._epochs, job.failed = {1: [1, 2]}, dict(ran.epochs), True
    trio.run(job.finish, [7])
    assert finished.statistics().current_buffer_used == 0
    [done] = unaudited
    assert done.job_id == "job" and done.epochs == ran.epochs

    released: set[tuple[str, int]] = set()

    async def send_control(peer, msg):
        released.update((peer, e) for e in msg.epochs)

    async def main():
        releaser = FrameReleaser(send_control)
        releaser.release_job(done)
        await releaser.flush()

    trio.run(main)
    assert released == {(f"peer{i}", 1) for i in range(3)}
