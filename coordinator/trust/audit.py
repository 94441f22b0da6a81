"""Audits: have a stage's slice recomputed on the bytes it logged and compare with what it sent.

Receipts prove consistency, not correct computation: a stage can sign garbage. After a
job is finished (so no stage can tell an audited frame from any other, and no user token
waits), `plan_audits` selects each (job, epoch, stage) with probability `rate`; a job that
ends while others are being audited starts its audits at a random time within `spread_s`
(jobs end in clusters; their audits together took the ring's CPU in bursts). For a
selected stage the auditor fetches every frame it logged for that job and epoch
(AuditRequests over the control stream, each answered with many frames:
shard.wire.audit_frames) and checks each against the digests in that stage's signed
receipt (so the stage cannot substitute bytes after the fact). Then the stage's input
frames go to a verifier node (VerifyRequest: a spot-check verifier other than the stage,
drawn at random, one that keeps that slice warm first; else any other member, not faulty,
whose node keeps every layer of the slice, off probation first, in random order:
coordinator.trust.opinions.candidates, so in a ring whose every node is a stage the stages
audit each other), which recomputes them (shard.verifier: all frames, trees and commits
included, as one tree-masked forward) and sends back its rows; the auditor compares them
with the stage's outputs (coordinator.trust.compare). A verifier that disagrees with the
stage gets a second opinion, and verifiers that disagree with each other a third
(coordinator.trust.opinions settles who is right; newcomers do not outvote a verifier off
probation: settle_trusted). Only when no verifier can answer does the auditor recompute
the slice itself, if its own store holds those layers (`replay_here`). So a selected stage
is caught if it cheated on any verified frame of the job, and an audit costs about one
prefill of the job's rows on that slice. A stage that declared a weight quantisation
(shard.quant) is replayed on the same weights quantised the same way, frame by frame, and
held to the kernels' bf16 step (stage_tolerance).

A mismatch, a missing record, a record that does not hash to the receipt, or no reply at
all from a stage that is still connected (so going silent is no way out of an audit)
yields an EvidenceRecord signed by the coordinator and marks the stage faulty in the
swarm, which excludes it from the next ring formation. A verifier outvoted by the other
opinions is marked faulty too (no evidence record: it signed nothing). Where the verdict
would rest on a newcomer verifier's word alone (coordinator.trust.disputes.lone_word),
nobody is accused: the parties are in dispute (coordinator.trust.dispute_desk, the book
probation's checks keep too), and the one the book names the liar is marked faulty. A stage that left
the swarm before answering is not accused (its records left with it; see docs/receipts.md).
A job's audits are drawn as it arrives, and every stage not drawn is told at once to drop its
frames of the job, a drawn one once its audit is over (coordinator.trust.frame_release).

A forked job (its first frame started from a source job's K/V on each stage) is audited
with the source's frames on the same stage fetched too, checked against the source's
receipts, and replayed before the job's own, whose rows alone are compared
(coordinator.trust.prefix_audit). The source's FinishedJob comes from the releaser, which
keeps it, and the source's frames on the stages, while a fork may still be audited (pins);
a fork whose source is unknown there, or was let go (its EndJob) longer than max_job_age_s
ago, is not audited on that epoch (`skipped_no_prefix`). Jobs are drawn in queue order, so
a source is drawn (and kept) before its forks.

It does not check receipt chains (receipt_check), choose rings, or serve HTTP.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable

import trio

from coordinator.swarm.swarm import Swarm
from coordinator.trust import disputes, opinions
from coordinator.trust.audit_config import AuditConfig, AuditStats
from coordinator.trust.audit_plan import AuditPlan, plan_audits
from coordinator.trust.audit_replies import AwaitedReplies, fetch_logged
from coordinator.trust.dispute_desk import DisputeDesk
from coordinator.trust.compare import (Finding, Logged, agree, compare, failed_spot, replay_here, split_reply,
                                      verify_parts)
from coordinator.trust.frame_release import FrameReleaser
from coordinator.trust.prefix_audit import with_source
from coordinator.trust.receipt_check import FinishedJob
from coordinator.trust.replay_slices import ReplaySlices
from coordinator.trust.source_frames import SourceFrames
from coordinator.trust.tolerance import TOLERANCES
from receipts import NodeKey, sign_evidence
from ring import PeerId
from shard.errors import ShardError
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.replay import Replayed
from shard.store import ModelStore
from shard.transport import TransportError
from shard.wire.audit_frames import AuditReply
from shard.verify_parts import whole_limits
from shard.wire.verify import VerifyReply

log = logging.getLogger("shard.coordinator")


class Auditor:
    def __init__(self, swarm: Swarm, store: ModelStore, coordinator_seed: bytes, config: AuditConfig = AuditConfig(),
                 rng: random.Random | None = None, *, finished: trio.MemoryReceiveChannel[FinishedJob],
                 audit_replies: trio.MemoryReceiveChannel[tuple[PeerId, AuditReply | VerifyReply]],
                 releaser: FrameReleaser | None = None) -> None:
        """`finished`: the jobs receipt_check finished (its buffer, AuditConfig.max_queued_jobs
        in the assembled coordinator, is the audit queue); `audit_replies`: (peer, AuditReply
        or VerifyReply) pairs from the swarm's control streams. serve() is their only reader.
        `store`: the model's manifest, and the layers to recompute here when no verifier can
        (AuditConfig.replay_here), if it holds them. `releaser` (None: one of its own) tells
        stages which frames no audit needs; serve() runs it."""
        self.swarm, self.store, self.config = swarm, store, config
        self.releaser = releaser or FrameReleaser(swarm.send_control)
        self._finished, self._replies = finished, audit_replies
        self.key = NodeKey.from_private_bytes(coordinator_seed)
        self.rng = rng or random.SystemRandom()
        self.evidence: list = []  # EvidenceRecord, newest last
        self.stats = AuditStats()
        self.disputes = DisputeDesk(swarm)  # newcomers' lone words, with probation's checks
        self.replies = AwaitedReplies(swarm.send_control, lambda: swarm.control_limits)
        self._limiter = trio.CapacityLimiter(1)
        self.slices = ReplaySlices(store, config.max_cached_slices, self._limiter)  # for replays here
        self.sources = SourceFrames(config.source_frames_mb << 20)  # forks' sources' frames, fetched once a stage
        # Whether a member is on probation (the engine's book, set by coordinator.assembly):
        # members asked past the verifier-role nodes are asked off probation first.
        self.on_probation: Callable[[PeerId], bool] = lambda peer: False
        self._settled = trio.Event()  # set each time an audit ends or serve() waits for a job
        self._in_flight = 0  # jobs drawn and not done (waiting for their start, or being audited)
        # Jobs drawn with audits to do, in arrival order, waiting for a slot (_draw_arrivals).
        self._drawn_in, self._drawn = trio.open_memory_channel[tuple[FinishedJob, list[AuditPlan]]](
            max(1, config.max_queued_jobs))

    async def wait_idle(self) -> None:
        """Return once every finished job handed over has been audited (tests and benchmarks).
        serve() waiting on empty `finished` and drawn queues is exactly that: it parks there
        only with nothing queued (a job handed straight to it unparks it), and no audit running."""
        while (not self._finished.statistics().tasks_waiting_receive or self._in_flight
               or not self._drawn.statistics().tasks_waiting_receive):
            await self._settled.wait()

    def _settle(self) -> None:
        self._settled.set()
        self._settled = trio.Event()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Audit finished jobs, up to AuditConfig.max_concurrent_audits at once (a job's
        stages one after another), and route audit replies to the fetches waiting for them,
        forever. Error handling: a stage that left the swarm is skipped (the swarm already
        re-forms without it); nothing here raises."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_replies)
            await nursery.start(self.releaser.serve)
            task_status.started()
            await self._serve_audits()

    async def _serve_replies(self) -> None:
        async for peer, reply in self._replies:
            self.replies.on_reply(peer, reply)

    async def _serve_audits(self) -> None:
        slots = trio.Semaphore(max(1, self.config.max_concurrent_audits))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._draw_arrivals)
            while True:
                await slots.acquire()  # a drawn job is taken off the queue only when it can start now
                self._settle()
                drawn = None
                with trio.move_on_after(self.config.slice_idle_s if len(self.slices) else math.inf):
                    drawn = await self._drawn.receive()
                if drawn is None:  # no audit for a while: the slices loaded for replays go back
                    if not self._in_flight:
                        self.slices.release()
                    slots.release()
                    continue
                self._in_flight += 1
                nursery.start_soon(self._audit_job, *drawn, slots)

    async def _draw_arrivals(self) -> None:
        """Draw each finished job's audits as it arrives: its stages not drawn drop its frames
        at once, a job with none is done, and only drawn ones wait for a slot. (Drawn as a slot
        freed, a backlog of audits kept every queued job's frames on every stage: at 32 streams
        of the full mix, 250 ended jobs, ~110 MB a stage, let go in bursts; issue 21.)"""
        async for job in self._finished:
            plans = self._draw(job)
            if plans:
                await self._drawn_in.send((job, plans))  # a full queue holds the next jobs in _finished
            else:
                self._settle()

    def _draw(self, job: FinishedJob) -> list[AuditPlan]:
        """The job's audits, its stages not drawn released. Done as the job arrives, in queue
        order, so a source's FinishedJob is with the releaser (it is pinned) before the plans
        of any job that forked from it are drawn."""
        if time.monotonic() - job.finished_s > self.config.max_job_age_s:
            log.warning("audit backlog: job %s waited %.0f s, its frame logs may be gone; not audited",
                        job.job_id, time.monotonic() - job.finished_s)
            self.stats.skipped_stale += 1
            plans = []
        else:
            source = None if job.prefix is None else self.releaser.source(job.prefix[1])
            plans = plan_audits(job, self.config.rate, self.rng, source)
        self.releaser.release_job(job, keep={(p.peer_id, p.epoch) for p in plans}, done=not plans)
        return plans

    async def _audit_job(self, job: FinishedJob, plans: list[AuditPlan], slots: trio.Semaphore) -> None:
        held = True
        try:
            # One of a cluster (other jobs drawn, not done): it starts at a random time within
            # AuditConfig.spread_s, its slot free meanwhile; a backlog past max_queued_jobs is not spread.
            if 1 < self._in_flight <= self.config.max_queued_jobs and self.config.spread_s > 0:
                slots.release()
                held = False
                await trio.sleep(self.rng.uniform(0, self.config.spread_s))
                await slots.acquire()
                held = True
            await self._audit_plans(plans, job.finished_s)
        finally:
            self.releaser.finished_with(job)  # no audit of it is to come: its source may go
            self._in_flight -= 1
            if held:
                slots.release()
            self._settle()

    async def _audit_plans(self, plans: list[AuditPlan], finished_s: float) -> None:
        for plan in plans:
            try:
                if time.monotonic() - finished_s > self.config.max_job_age_s:  # its start came too late: the
                    self.stats.skipped_stale += plan is plans[0]  # stages' logs may be gone (counted if none began)
                    continue
                await self.audit(plan)
            except (TransportError, trio.TooSlowError) as exc:
                self.stats.skipped_gone += 1
                log.info("audit of %s on job %s skipped, the stage left: %s", plan.peer_id, plan.job_id, exc)
            finally:  # passed, caught or skipped: nothing will ask for these frames again
                self.releaser.release(plan.peer_id, plan.job_id, plan.epoch)

    async def audit(self, plan: AuditPlan) -> Finding | None:
        """Audit one stage's frames of one job. Raises TransportError or TooSlowError only
        when the stage left the swarm before answering (then it is not accused). The stage
        is replayed under the quantisation it registered with."""
        gone = self._source_gone(plan)
        if gone is not None:
            self.stats.skipped_no_prefix += 1
            log.warning("audit of %s on job %s skipped: the job forked on epoch %d from a source %s", plan.peer_id,
                        plan.job_id, plan.epoch, gone)
            return None
        member = self.swarm.members.get(plan.peer_id)
        if member is not None:
            plan = plan.under(member.register.quant)
        try:
            records = await self.fetch_all(plan)
            source = None if plan.prefix is None else await self.sources.records(plan.prefix, self.fetch_all)
        except (TransportError, trio.TooSlowError) as exc:
            if plan.peer_id not in self.swarm.members:
                raise
            first = min(plan.receipts)
            finding = Finding("unanswered", first, f"no audit reply within {self.config.reply_timeout_s:g} s "
                              f"while connected ({type(exc).__name__})", failed_spot(TOLERANCES.get(plan.wire_dtype, TOLERANCES["f32"])),
                              bytes(32))
            self.stats.audits += 1
            self._accuse(plan, finding)
            return finding
        started = time.perf_counter()
        logged = await trio.to_thread.run_sync(with_source, plan, records, source, self.swarm.control_limits,
                                               limiter=self._limiter)
        if logged is None:
            self.stats.skipped_no_prefix += 1
            log.warning("audit of %s on job %s skipped: its frames of source job %s cannot make the K/V its fork "
                        "started from", plan.peer_id, plan.job_id, plan.prefix and plan.prefix.job_id)
            return None
        judged, finding = (True, logged) if isinstance(logged, Finding) else await self._judge(plan, logged)
        self.stats.replay_s += time.perf_counter() - started
        if not judged:
            self.stats.skipped_no_verifier += 1
            log.warning("audit of %s on job %s skipped: no verifier node could recompute layers %s and this "
                        "gateway does not hold them", plan.peer_id, plan.job_id, plan.layers)
            return None
        self.stats.audits += 1
        self.stats.frames_compared += len(plan.receipts)
        if finding is not None:
            self._accuse(plan, finding)
        return finding

    def _source_gone(self, plan: AuditPlan) -> str | None:
        """Why the frames a forked job started from cannot be audited now, if they cannot: its
        source's receipts are unknown here, or its stages were told it ended longer ago than
        max_job_age_s (their logs keep its frames grace_s after, pinned or not)."""
        if plan.source_unknown:
            return "whose receipts are not known here"
        ended_s = None if plan.prefix is None else self.releaser.ended_s(plan.prefix.job_id)
        if ended_s is not None and self.releaser.clock() - ended_s > self.config.max_job_age_s:
            return f"let go {self.releaser.clock() - ended_s:.0f} s ago: its frames may be gone"
        return None

    async def _judge(self, plan: AuditPlan, logged: Logged) -> tuple[bool, Finding | None]:
        """Gather recomputations until coordinator.trust.opinions says they suffice, settle,
        exclude verifiers that lied; (judged, the finding against the stage or None).
        (False, None): nobody could recompute the slice."""
        parties: list[PeerId | None] = [plan.peer_id]  # then each recomputation's maker (None: here)
        ids, findings, recomputed, trusted = [0], [None], [None], [False]
        asked: set[PeerId] = {plan.peer_id}
        while opinions.need_another(ids, self.config.max_opinions):
            got = await self._recompute(plan, logged, asked)
            if got is None:
                break
            who, expected = got
            finding = await trio.to_thread.run_sync(compare, plan, logged, expected, limiter=self._limiter)
            opinion = 0 if finding is None else next(
                (i for i in range(1, len(ids)) if ids[i] == i and agree(plan, logged, recomputed[i], expected)), len(ids))
            parties.append(who), ids.append(opinion), findings.append(finding), recomputed.append(expected)
            trusted.append(who is None or not self.on_probation(who))  # None: replayed here
        if len(ids) == 1:
            return False, None
        self.stats.second_opinions += len(ids) > 2
        if disputes.lone_word(ids, trusted):  # a newcomer's word against the stage's: nobody judged
            self.stats.disputed += 1
            self.disputes.dispute(parties, ids, f"layers {plan.layers} of job {plan.job_id} (audit)")  # type: ignore[arg-type]
            return True, None
        verdict = opinions.settle_trusted(ids, trusted)  # newcomers cannot outvote a trusted recomputation
        if not verdict.settled:
            self.stats.unsettled += 1
            log.warning("audit of %s on job %s: recomputations tie (%s); no verifier accused", plan.peer_id,
                        plan.job_id, ids)
        for i in verdict.lying:
            if parties[i] is not None:
                self.stats.lying_verifiers += 1
                self.swarm.mark_faulty(parties[i], f"verifier outvoted: its recomputation of layers {plan.layers} "
                                       f"on job {plan.job_id} disagreed with {len(ids) - 2} other opinions")
        if not verdict.stage_faulty:
            return True, None
        return True, next(f for i, f in enumerate(findings) if f is not None and i not in verdict.lying)

    async def _recompute(self, plan: AuditPlan, logged: Logged, asked: set) -> tuple[PeerId | None, list] | None:
        """One more recomputation of the logged frames: by a verifier not asked yet (one
        that fails to answer is passed over), else by another member keeping the slice,
        else here if allowed and held, else None. `asked` holds the audited stage."""
        verifiers = opinions.verifier_slices(self.swarm.members)
        registers = {p: m.register for p, m in self.swarm.members.items()}
        for peer in opinions.audit_order(verifiers, registers, plan.layers, asked | set(self.swarm.faulty),
                                         self.on_probation, self.rng):
            asked.add(peer)
            expected = await self.ask_verifier(peer, plan, logged)
            if expected is not None:
                if peer in verifiers:
                    self.stats.by_verifiers += 1
                else:
                    self.stats.by_members += 1
                return peer, expected
        if None in asked or not self.config.replay_here or not self.holds(plan.layers):
            return None
        asked.add(None)
        stage = await self.slices.get(plan.layers, plan.quant)
        expected = await trio.to_thread.run_sync(replay_here, stage, plan, logged, self.config.max_replay_rows,
                                                 self.stats.replay, limiter=self._limiter)
        self.stats.by_coordinator += 1
        return None, expected

    def holds(self, layers: LayerRange) -> bool:
        """Whether this gateway's store has the layer files of `layers` (it can recompute them)."""
        return all((self.store.root / layer_file(i)).exists() for i in layers)

    async def ask_verifier(self, peer: PeerId, plan: AuditPlan, logged: Logged) -> list[Replayed | None] | None:
        """`peer`'s recomputation of the logged frames; None if it could not give one (past
        upload_cap, left, timed out, answered an error or a malformed reply). A request past
        one control frame goes in VerifyParts (shard.verify_parts), the reply may come so."""
        limits, cap = self.swarm.control_limits, self.replies.parts.cap
        part_bytes = min(self.config.verify_part_bytes or limits.max_frame_bytes, limits.max_frame_bytes)
        request_id = self.replies.next_id()
        try:  # the frames' bytes joined and encoded, and the reply cut per frame, in worker threads (up
            # to 1 MiB and hundreds of frames: on the gateway's trio thread they held up every job's tokens)
            parts = await trio.to_thread.run_sync(verify_parts, request_id, plan, logged, self.config.max_replay_rows,
                                                  cap, part_bytes, whole_limits(limits, cap))
        except ShardError as exc:
            log.info("job %s's frames cannot go to a verifier: %s", plan.job_id, exc)
            return None
        try:
            reply = await self.replies.ask(peer, request_id, parts, VerifyReply, self.config.verify_timeout_s,
                                           in_parts=True)
        except (TransportError, trio.TooSlowError) as exc:
            log.info("verifier %s did not answer for job %s: %s", peer, plan.job_id, type(exc).__name__)
            return None
        if reply.error is not None:
            log.info("verifier %s could not recompute layers %s: %s", peer, plan.layers, reply.error)
            return None
        expected = await trio.to_thread.run_sync(split_reply, reply, logged)
        if expected is None:
            log.warning("verifier %s sent rows that do not fit job %s's frames", peer, plan.job_id)
        return expected

    def _accuse(self, plan: AuditPlan, finding: Finding) -> None:
        """Sign evidence against the stage's receipt for the round and mark it faulty."""
        receipt = plan.receipts.get(finding.round) or next(iter(plan.receipts.values()))
        record = sign_evidence(self.key, receipt=receipt, recomputed_digest=finding.recomputed_digest,
                               check=finding.spot)
        self.evidence.append(record)
        self.swarm.mark_faulty(plan.peer_id, f"audit {finding.check}: job {plan.job_id}, {finding.detail}")

    async def fetch_all(self, plan: AuditPlan) -> dict[int, tuple[bytes, bytes]]:
        """Both logged frames of every planned round (coordinator.trust.audit_replies.fetch_logged).
        Error handling: TransportError or TooSlowError is re-raised."""
        return await fetch_logged(self.replies, plan, self.config.fetch_reply_bytes, self.config.reply_timeout_s)
