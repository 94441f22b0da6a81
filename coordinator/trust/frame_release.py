"""Tell stages which frames no audit will ask for, so they drop them now, not grace_s later.

A stage keeps every frame of a job for FrameLogConfig.grace_s (300 s) after its end in case
an audit asks (shard.frame_log); under load that held five minutes of every job's frames.
Once the auditor has drawn a finished job's audits (coordinator.trust.audit_plan), the
(job, epoch) frames of each stage not drawn are released at once, and those of a drawn stage
once its audit is over (passed, caught or skipped); a job never audited (rate 0, the audit
queue full, its turn come too late, its receipts failed) is released whole. Releases wait
here per stage and go out as one ReleaseFrames per stage every FLUSH_S, or sooner when a
stage has MAX_RELEASE_JOBS waiting, so at hundreds of jobs a second they cost a message a
second per stage. A release that cannot be sent (the stage left) is dropped: the stage's
grace_s still bounds what it keeps. It decides nothing about audits and knows no bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection

import trio

from coordinator.trust.receipt_check import FinishedJob
from ring import PeerId
from shard.transport import TransportError
from shard.wire.release_frames import MAX_RELEASE_JOBS, ReleaseFrames

log = logging.getLogger("shard.coordinator")

# How long a release may wait for company: a stage's log holds one more second of jobs
# (at 32 streams on the local ring, a few jobs), against one message per job otherwise.
FLUSH_S = 1.0


class FrameReleaser:
    def __init__(self, send_control: Callable[[PeerId, ReleaseFrames], Awaitable[None]], flush_s: float = FLUSH_S) -> None:
        """`send_control`: Swarm.send_control (raises TransportError for a peer gone)."""
        self._send, self.flush_s = send_control, flush_s
        self._pending: dict[PeerId, list[tuple[str, int]]] = {}  # stage -> (job, epoch), oldest first
        self._full = trio.Event()  # a stage has a whole message's worth waiting
        self.sent = 0  # (job, epoch, stage) releases delivered to their stage's control stream
        self.dropped = 0  # those whose stage could not be reached (it left)

    def release(self, peer: PeerId, job_id: str, epoch: int) -> None:
        """Queue `peer`'s frames of `job_id` on `epoch` for release; never blocks."""
        keys = self._pending.setdefault(peer, [])
        keys.append((job_id, epoch))
        if len(keys) >= MAX_RELEASE_JOBS:
            self._full.set()

    def release_job(self, job: FinishedJob, keep: Collection[tuple[PeerId, int]] = ()) -> None:
        """Queue every stage's frames of `job` on every epoch it ran on, but those of the
        (stage, epoch) pairs in `keep` (the audits drawn: released when each is over)."""
        for epoch, view in sorted(job.epochs.items()):
            for peer, _ in view.ring.stages:
                if (peer, epoch) not in keep:
                    self.release(peer, job.job_id, epoch)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Send what waits every flush_s (or once a stage's batch is full), forever."""
        task_status.started()
        while True:
            with trio.move_on_after(self.flush_s):
                await self._full.wait()
            await self.flush()

    async def flush(self) -> None:
        """Send every waiting release now, at most MAX_RELEASE_JOBS per message. Error
        handling: a stage that cannot be reached loses its releases (counted in `dropped`)."""
        pending, self._pending = self._pending, {}
        self._full = trio.Event()
        for peer, keys in pending.items():
            for i in range(0, len(keys), MAX_RELEASE_JOBS):
                batch = keys[i:i + MAX_RELEASE_JOBS]
                try:
                    await self._send(peer, ReleaseFrames(job_ids=[j for j, _ in batch], epochs=[e for _, e in batch]))
                except TransportError as exc:
                    self.dropped += len(keys) - i
                    log.debug("could not release %d frame logs on %s: %s", len(keys) - i, peer, exc)
                    break
                self.sent += len(batch)
