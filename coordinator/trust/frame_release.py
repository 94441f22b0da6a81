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
grace_s still bounds what it keeps.

Pins: a job another job forked from (a prefix source, docs/receipts.md) must keep its
frames on every stage as long as an audit of a fork may replay them, so releases of a
pinned job are held back here, and so is its FinishedJob (`source`: the audit's plan of
a fork needs the source's receipts). Pins are counted: the engine holds one while the job
is in its prefix index and one per fork it sent; a fork's pin goes when nothing will
audit the fork any more (`finished_with`: after its audits, or at once when it goes
unaudited). At zero the held releases are queued as usual and the FinishedJob dropped.
Pins hold back releases only: once the engine lets a source go (its EndJob), the stages
keep its frames grace_s from then whatever the pins, so that moment is kept (`ended_s`)
for the auditor to bound its audits of forks by, as it bounds any job's by its end.
It decides nothing about audits and knows no bytes.
"""

from __future__ import annotations

import logging
import time
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
    def __init__(self, send_control: Callable[[PeerId, ReleaseFrames], Awaitable[None]], flush_s: float = FLUSH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`send_control`: Swarm.send_control (raises TransportError for a peer gone);
        `clock`: the one FinishedJob.finished_s is read on."""
        self._send, self.flush_s, self.clock = send_control, flush_s, clock
        self._pending: dict[PeerId, list[tuple[str, int]]] = {}  # stage -> (job, epoch), oldest first
        self._full = trio.Event()  # a stage has a whole message's worth waiting
        self._pins: dict[str, int] = {}  # source job -> references to it (> 0)
        self._held: dict[str, list[tuple[PeerId, int]]] = {}  # pinned job -> (stage, epoch) releases held
        self._sources: dict[str, FinishedJob] = {}  # pinned job -> its FinishedJob, once it finished
        self._ended_s: dict[str, float] = {}  # pinned job -> when its stages were told it ended (clock)
        self.sent = 0  # (job, epoch, stage) releases delivered to their stage's control stream
        self.dropped = 0  # those whose stage could not be reached (it left)

    def pin(self, job_id: str) -> None:
        """One more reference to `job_id` as a prefix source: its frames stay on the stages
        (releases held) and its FinishedJob here (`source`) until every reference is gone."""
        self._pins[job_id] = self._pins.get(job_id, 0) + 1

    def unpin(self, job_id: str, *, ended: bool = False) -> None:
        """Drop one reference to `job_id`; the last one queues its held releases and drops
        its FinishedJob. `ended`: the stages were sent the job's EndJob now (the engine let
        a source go), which starts their frame logs' grace_s for it (`ended_s`). An unpin
        of a job not pinned is logged and ignored."""
        count = self._pins.get(job_id, 0)
        if count == 0:
            log.warning("unpin of job %s, which is not pinned", job_id)
            return
        if ended:
            self._ended_s.setdefault(job_id, self.clock())
        if count > 1:
            self._pins[job_id] = count - 1
        else:
            del self._pins[job_id]
            self._sources.pop(job_id, None)
            self._ended_s.pop(job_id, None)
            for peer, epoch in self._held.pop(job_id, ()):
                self.release(peer, job_id, epoch)

    def pins(self, job_id: str) -> int:
        """The references to `job_id` now (0: not pinned)."""
        return self._pins.get(job_id, 0)

    def source(self, job_id: str) -> FinishedJob | None:
        """The FinishedJob of pinned job `job_id`; None if not pinned or not finished yet."""
        return self._sources.get(job_id)

    def ended_s(self, job_id: str) -> float | None:
        """When pinned job `job_id`'s stages were told it ended (clock); None: not yet."""
        return self._ended_s.get(job_id)

    def release(self, peer: PeerId, job_id: str, epoch: int) -> None:
        """Queue `peer`'s frames of `job_id` on `epoch` for release (held while the job is
        pinned); never blocks."""
        if job_id in self._pins:
            self._held.setdefault(job_id, []).append((peer, epoch))
            return
        keys = self._pending.setdefault(peer, [])
        keys.append((job_id, epoch))
        if len(keys) >= MAX_RELEASE_JOBS:
            self._full.set()

    def release_job(self, job: FinishedJob, keep: Collection[tuple[PeerId, int]] = (), *, done: bool = True) -> None:
        """Queue every stage's frames of `job` on every epoch it ran on, but those of the
        (stage, epoch) pairs in `keep` (the audits drawn: released when each is over); keep
        `job` itself while it is pinned (`source`). `done`: no audit of `job` is to come (the
        default, as ReceiptChecker's `unaudited` calls it), so its pin on its source goes too
        (`finished_with`); the auditor passes False and calls finished_with after its audits."""
        if job.job_id in self._pins:
            self._sources[job.job_id] = job
        for epoch, view in sorted(job.epochs.items()):
            for peer, _ in view.ring.stages:
                if (peer, epoch) not in keep:
                    self.release(peer, job.job_id, epoch)
        if done:
            self.finished_with(job)

    def finished_with(self, job: FinishedJob) -> None:
        """Nothing will audit `job` any more: drop its reference to the source it forked
        from (job.prefix), if any. Call once per job."""
        if job.prefix is not None:
            self.unpin(job.prefix[1])

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
