"""Pins: a prefix source's frames and FinishedJob kept while a fork may be audited
(coordinator.trust.frame_release, with the auditor).

Bugs guarded: a source's frames released on the stages (by its own audit's end or its
undrawn stages) while a fork of it may still be audited, so the fork's audit reads them as
missing records and accuses an honest stage; held releases never sent once the last pin
goes (stages keep the source's frames until grace_s); the source's FinishedJob dropped
before a fork's plan is drawn (its audit skipped) or kept for good; a fork's pin on its
source dropped twice (the source released under a later fork) or never (kept for good):
once by the unaudited path, once after the auditor's audits, never by the auditor's
release of its undrawn stages; a fork whose source is unknown accusing anyone; a fork
audited after its source's stages were told it ended longer ago than max_job_age_s (their
logs keep its frames only grace_s after, pinned or not: missing records, an honest stage
accused). Sound: the
releases are what reaches the stages' control streams (ReleaseFrames) after a flush; the
auditor is the real one, its draw made by plan_audits.
"""

from __future__ import annotations

import dataclasses
import logging
import random

import trio

from coordinator.trust.audit import AuditConfig, Auditor
from coordinator.trust.frame_release import FrameReleaser
from shard.errors import TransportError
from shard.wire.release_frames import ReleaseFrames
from tests.coordinator.trust.test_audit_replay import finished_job

STAGES = {f"peer{i}" for i in range(3)}


def _jobs():
    source = dataclasses.replace(finished_job(3, {1: [1, 2]}, {1: 1, 2: 1}), job_id="src")
    fork = dataclasses.replace(finished_job(3, {1: [1, 2]}, {1: 1, 2: 1}), job_id="fork", prefix=(1, "src", 4))
    return source, fork


class _Stages:
    """The swarm's control streams: releases recorded as (stage, job, epoch); a stage asked
    for its frames has left (TransportError), so audits are skipped, nobody accused."""

    def __init__(self) -> None:
        self.released: set[tuple[str, str, int]] = set()
        self.asked: list[str] = []  # jobs whose frames were asked for
        self.members, self.faulty = {}, {}

    async def send_control(self, peer, msg):
        if isinstance(msg, ReleaseFrames):
            self.released.update((peer, j, e) for j, e in zip(msg.job_ids, msg.epochs))
            return
        self.asked.append(msg.job_id)
        raise TransportError(f"{peer} left")

    def of(self, job_id: str) -> set[str]:
        return {p for p, j, _ in self.released if j == job_id}


def _flushed(releaser: FrameReleaser) -> None:
    trio.run(releaser.flush)


def test_a_pinned_jobs_releases_and_finishedjob_wait_for_the_last_unpin():
    stages, (source, _) = _Stages(), _jobs()
    releaser = FrameReleaser(stages.send_control)
    releaser.pin("src"), releaser.pin("src")  # in the prefix index, and forked once
    assert releaser.source("src") is None  # not finished yet
    releaser.release_job(source, keep={("peer0", 1)}, done=False)
    releaser.release("peer0", "src", 1)  # its audit of peer0 is over
    _flushed(releaser)
    assert stages.of("src") == set() and releaser.source("src") is source
    releaser.unpin("src")
    _flushed(releaser)
    assert stages.of("src") == set() and releaser.source("src") is source
    releaser.unpin("src")
    _flushed(releaser)
    assert stages.of("src") == STAGES and releaser.source("src") is None
    stages.released.clear()
    releaser.release("peer1", "src", 1)  # unpinned: no longer held
    _flushed(releaser)
    assert stages.released == {("peer1", "src", 1)}


def test_a_forks_pin_goes_with_the_unaudited_path_and_after_audits_but_not_with_the_draw(caplog):
    stages, (source, fork) = _Stages(), _jobs()
    releaser = FrameReleaser(stages.send_control)
    releaser.pin("src")  # the fork's own pin
    releaser.release_job(source, done=False)
    releaser.release_job(fork, keep={("peer0", 1)}, done=False)  # the auditor's draw: audits to come
    _flushed(releaser)
    assert stages.of("src") == set() and stages.of("fork") == {"peer1", "peer2"}
    releaser.finished_with(fork)  # its audits are over
    _flushed(releaser)
    assert stages.of("src") == STAGES
    releaser.pin("src")
    releaser.release_job(fork)  # ReceiptChecker's `unaudited`: nothing will audit it
    assert releaser.source("src") is None and releaser.pins("src") == 0
    with caplog.at_level(logging.WARNING, logger="shard.coordinator"):
        releaser.unpin("src")  # one unpin too many: said, and nothing else changes
    assert "unpin of job src, which is not pinned" in caplog.text and releaser.pins("src") == 0


def _audit(jobs, pins: list[str], ended_s_ago: float | None = None):
    """Run `jobs` (queued together, in order) through a real Auditor whose releaser holds
    `pins` (as the engine would; the last let go `ended_s_ago`, if given); (auditor,
    stages) once all are audited and flushed."""
    stages = _Stages()
    now = [1000.0]

    async def main():
        finished_in, finished = trio.open_memory_channel(len(jobs))
        _, replies = trio.open_memory_channel(0)
        releaser = FrameReleaser(stages.send_control, clock=lambda: now[0])
        auditor = Auditor(stages, None, bytes(32), AuditConfig(rate=1.0, max_concurrent_audits=4),
                          rng=random.Random(0), finished=finished, audit_replies=replies, releaser=releaser)
        for job_id in pins:
            releaser.pin(job_id)
        if ended_s_ago is not None:
            releaser.unpin(pins[-1], ended=True)
            now[0] += ended_s_ago
        for job in jobs:
            finished_in.send_nowait(job)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            with trio.fail_after(10):
                await auditor.wait_idle()
            await auditor.releaser.flush()
            nursery.cancel_scope.cancel()
        return auditor

    return trio.run(main), stages


def test_the_auditor_plans_a_fork_with_its_source_and_drops_the_forks_pin_once():
    source, fork = _jobs()
    auditor, stages = _audit([source, fork], pins=["src", "src"])  # the index's pin and the fork's
    assert auditor.stats.skipped_no_prefix == 0 and auditor.stats.skipped_gone == 6  # both audited (stages gone)
    assert stages.of("fork") == STAGES and stages.of("src") == set()
    assert auditor.releaser.source("src") is source and auditor.releaser.pins("src") == 1  # the index's
    auditor.releaser.unpin("src")  # the engine drops it from its index
    trio.run(auditor.releaser.flush)
    assert stages.of("src") == STAGES


def test_a_fork_audited_too_long_after_its_source_was_let_go_is_skipped():
    source, fork = _jobs()
    auditor, stages = _audit([source, fork], pins=["src", "src"], ended_s_ago=241.0)  # max_job_age_s: 240
    assert auditor.stats.skipped_no_prefix == 3 and stages.asked == ["src"] * 3  # the source's own audits
    assert auditor.releaser.pins("src") == 0 and stages.of("src") == STAGES
    auditor, stages = _audit([source, fork], pins=["src", "src"], ended_s_ago=239.0)
    assert auditor.stats.skipped_no_prefix == 0 and stages.asked.count("fork") == 3


def test_a_fork_whose_source_was_not_kept_is_skipped_and_nobody_is_accused():
    _, fork = _jobs()
    auditor, stages = _audit([fork], pins=["src"])  # the source finished nowhere the auditor saw
    assert auditor.stats.skipped_no_prefix == 3 and auditor.stats.audits == 0 and stages.asked == []
    assert auditor.evidence == [] and stages.faulty == {} and auditor.releaser.pins("src") == 0
    assert stages.of("fork") == STAGES
