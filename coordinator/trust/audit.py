"""Audits: recompute a stage's slice on the bytes it logged and compare with what it sent.

Receipts prove consistency, not correct computation: a stage can sign garbage. After a
job is finished (so no stage can tell an audited frame from any other, and no user token
waits), `plan_audits` selects each (job, epoch, stage) with probability `rate`. For a
selected stage the auditor fetches every frame it logged for that job and epoch
(AuditRequest over the control stream), checks each against the digests in that stage's
signed receipt (so the stage cannot substitute bytes after the fact), recomputes them
with the slice loaded from the coordinator's own store (coordinator.trust.audit_replay: all
frames, tree and verify frames and commits included, as one tree-masked forward, in a
worker thread) and compares every verified round. So a selected stage is caught if it
cheated on any verified frame of the job, and an audit costs about one prefill of the
job's rows on that slice. A stage that declared a weight quantisation (shard.quant) is
replayed on the same store quantised the same way, frame by frame, and held to the
kernels' bf16 step (stage_tolerance): running another scheme than declared is a mismatch.

A mismatch, a missing record, a record that does not hash to the receipt, or no reply at
all from a stage that is still connected (so going silent is no way out of an audit)
yields an EvidenceRecord signed by the coordinator and marks the stage faulty in the
swarm, which excludes it from the next ring formation. A stage that left the swarm before
answering is not accused (its records left with it; see docs/receipts.md).

It does not check receipt chains (receipt_check), choose rings, or serve HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
import trio

from coordinator.trust.audit_replay import ReplayStats, replay
from coordinator.trust.tolerance import TOLERANCES, stage_tolerance
from coordinator.trust.receipt_check import FinishedJob
from coordinator.swarm.swarm import Swarm
from receipts import (NodeKey, Receipt, SpotCheck, Tolerance, compare_outputs, sha256_digest, sign_evidence)
from ring import PeerId
from shard.activations import from_wire
from shard.errors import WireError
from shard.layers import LayerRange
from shard.options import option
from shard.stage import Stage
from shard.store import ModelStore
from shard.transport import TransportError
from shard.wire.codec import decode
from shard.quant import quantise_stage, scheme
from shard.wire.messages import AuditReply, AuditRequest, Forward, Result

log = logging.getLogger("shard.coordinator")

@dataclass(frozen=True)
class AuditConfig:
    # Probability that a (job, epoch, stage) is audited: its every verified frame of the
    # job recomputed and compared. A stage that cheats on at least one verified frame per
    # request escapes n requests with probability (1 - rate)^n: 0.75^20 = 0.3% at 0.25.
    # Cost: rate x (one batched replay of the job's rows / the ring's per-frame compute
    # of the job); docs/receipts.md gives the measured ratio (scripts/bench_receipts_ring.py).
    rate: float = option(0.25, "probability a (job, stage) is audited by replay; cost in docs/receipts.md",
                         flag="--audit-rate")
    reply_timeout_s: float = 30.0
    max_queued_jobs: int = 256  # finished jobs waiting for audit; more are not audited
    max_cached_slices: int = 4  # slices kept loaded for replays
    max_replay_rows: int = 1024  # rows per replay forward (its attention mask is rows x rows)
    # A job that waited longer than this for its audit is not audited: nodes drop a job's
    # frame log FrameLogConfig.grace_s (300 s) after it ends, and a dropped log reads as
    # a missing record, which would accuse an honest stage. Keep it below that grace.
    max_job_age_s: float = 240.0


@dataclass(frozen=True)
class AuditPlan:
    """One stage's frames of one (job, epoch) to replay, and which rounds to compare."""

    job_id: str
    epoch: int
    peer_id: PeerId
    layers: LayerRange
    is_tail: bool
    wire_dtype: str
    aux_dtype: str | None  # None: wire_dtype
    rounds: tuple[int, ...]  # every round sent on this epoch up to the last verified, in send order
    receipts: dict[int, Receipt]  # round -> this stage's verified receipt, for those rounds
    quant: str = "none"  # the weight quantisation the stage declared (shard.quant scheme name)


def plan_audits(job: FinishedJob, rate: float, rng: random.Random) -> list[AuditPlan]:
    """Select each (epoch, stage) of the job with probability `rate`; a plan covers every
    round sent on that epoch up to its last verified one. Pure given `rng` (the auditor
    uses SystemRandom: stages cannot predict it). One draw per (epoch, stage), in order."""
    plans = []
    for epoch, sent in sorted(job.sent_rounds.items()):
        view = job.epochs.get(epoch)
        if view is None:
            continue
        verified = [i for i, r in enumerate(sent) if r in job.verified and job.verified[r].epoch == epoch]
        for index, (peer, layers) in enumerate(view.ring.stages):
            if rng.random() >= rate or not verified:
                continue
            upto = sent[: verified[-1] + 1]
            receipts = {r: job.verified[r].receipts[index] for r in upto
                        if r in job.verified and job.verified[r].epoch == epoch}
            a = view.ring.assignments[index]
            plans.append(AuditPlan(job.job_id, epoch, peer, layers, index == len(view.ring.stages) - 1,
                                   a.wire_dtype, a.aux_dtype, tuple(upto), receipts))
    return plans


@dataclass(frozen=True)
class Finding:
    """Why a stage failed an audit: check name, round, one-line detail, the comparison."""

    check: str  # "missing_record" | "record_digest" | "structure" | "output_mismatch" | "unanswered"
    round: int
    detail: str
    spot: SpotCheck
    recomputed_digest: bytes


def _failed_spot(tolerance: Tolerance) -> SpotCheck:
    """The comparison recorded when there was nothing to compare: every element failed."""
    return SpotCheck(tolerance, 1, 1, float("inf"), float("inf"))


_SAME_FIELDS = ("job_id", "epoch", "round", "nonce", "phase", "ctx_len", "commit_src", "commit_dst", "want_aux_layers")


def _structure_error(inp: Forward, out: Forward | Result, is_tail: bool) -> str | None:
    """Fields a stage must pass through unchanged; None if it did."""
    if isinstance(out, Result) != is_tail:
        return f"sent a {type(out).__name__} as {'tail' if is_tail else 'a middle stage'}"
    names = _SAME_FIELDS[:3] if is_tail else _SAME_FIELDS
    for name in names:
        if getattr(inp, name) != getattr(out, name):
            return f"field '{name}' changed from {getattr(inp, name)!r} to {getattr(out, name)!r}"
    if not is_tail:
        for name in ("positions", "tree_parents"):
            a, b = getattr(inp, name), getattr(out, name)
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                return f"tensor '{name}' changed"
    return None


def check_frames(stage: Stage, plan: AuditPlan, records: dict[int, tuple[bytes, bytes]], limits,
                 max_replay_rows: int = 1024, stats: ReplayStats | None = None) -> Finding | None:
    """Pure over its inputs: verify the logged bytes against the receipts, replay, compare.
    `records`: round -> (input bytes, output bytes) as the stage returned them."""
    tol = stage_tolerance(plan.wire_dtype, plan.quant)
    inputs, outputs, rounds = [], [], []
    for r in plan.rounds:
        rec, receipt = records.get(r), plan.receipts.get(r)
        if rec is None:
            if receipt is not None:
                return Finding("missing_record", r, f"no logged frame for verified round {r}", _failed_spot(tol), bytes(32))
            continue  # a round the coordinator never verified (it failed): not replayable
        if receipt is not None:
            for side, data, claimed in (("input", rec[0], receipt.input_digest), ("output", rec[1], receipt.output_digest)):
                if sha256_digest(data) != claimed:
                    return Finding("record_digest", r, f"logged {side} of round {r} does not hash to its receipt",
                                   _failed_spot(tol), sha256_digest(data))
        try:
            inp, out = decode(rec[0], limits, canonical=True), decode(rec[1], limits, canonical=True)
        except WireError as exc:
            return Finding("structure", r, f"logged frame of round {r} does not decode: {exc}", _failed_spot(tol), bytes(32))
        if not isinstance(inp, Forward) or not isinstance(out, (Forward, Result)):
            return Finding("structure", r, f"logged frames of round {r} are not a Forward and its output",
                           _failed_spot(tol), bytes(32))
        inputs.append(inp), outputs.append(out), rounds.append(r)
    expected = replay(stage, plan.wire_dtype, inputs, max_replay_rows, stats, aux_dtype=plan.aux_dtype,
                      frame_by_frame=scheme(plan.quant).quantised)
    aux_tol = stage_tolerance(plan.aux_dtype or plan.wire_dtype, plan.quant)
    for r, inp, out, replayed in zip(rounds, inputs, outputs, expected):
        if r not in plan.receipts:
            continue
        problem = _structure_error(inp, out, plan.is_tail)
        if problem is not None:
            return Finding("structure", r, problem, _failed_spot(tol), bytes(32))
        if replayed is None:
            continue  # no row of this frame was kept (see audit_replay.plan_replay)
        keep, hidden, aux = replayed  # (K,), (K, H), (K, k*H) or None
        t = inp.positions.shape[0]
        trimmed = plan.is_tail and inp.phase == "prefill"  # the tail returns the last prompt row only
        claims = [("hidden", hidden, from_wire(out.hidden, out.hidden_scale, torch.float32), 1 if trimmed else t, tol)]
        if aux is not None or out.aux is not None:
            claims.append(("aux", aux, None if out.aux is None else from_wire(out.aux, out.aux_scale, torch.float32), t,
                           aux_tol))
        for name, e, a, rows, claim_tol in claims:
            if e is None or a is None or a.shape != (rows, e.shape[1]):
                return Finding("structure", r, f"'{name}' shape {None if a is None else list(a.shape)}, "
                               f"recomputed {None if e is None else [rows, e.shape[1]]}", _failed_spot(tol), bytes(32))
            if rows == t:
                a = a[keep]
            else:
                e = e[keep == t - 1]
            if e.shape[0] == 0:
                continue  # the tail's one row was not kept: nothing of this frame was read
            rms = e.pow(2).mean(dim=1, keepdim=True).sqrt().expand_as(e)  # (K, width): each element's row RMS
            spot = compare_outputs(e.reshape(-1).numpy(), a.reshape(-1).numpy(), claim_tol,
                                   scale=rms.reshape(-1).numpy())
            if not spot.passed:
                return Finding("output_mismatch", r, f"round {r} '{name}': {spot.num_outliers}/{spot.num_elements} "
                               f"elements off (max abs error {spot.max_abs_error:.3g})", spot,
                               sha256_digest(e.numpy().tobytes()))
    return None


@dataclass
class AuditStats:
    audits: int = 0
    frames_compared: int = 0
    replay_s: float = 0.0  # wall time of check_frames (digests, decode, replay, compare)
    replay: ReplayStats = dataclasses.field(default_factory=ReplayStats)  # forwards and rows replayed
    skipped_stale: int = 0  # jobs not audited: older than max_job_age_s when their turn came
    skipped_gone: int = 0  # (job, stage) audits not done: the stage left the swarm first


class Auditor:
    def __init__(self, swarm: Swarm, store: ModelStore, coordinator_seed: bytes, config: AuditConfig = AuditConfig(),
                 rng: random.Random | None = None, *, finished: trio.MemoryReceiveChannel[FinishedJob],
                 audit_replies: trio.MemoryReceiveChannel[tuple[PeerId, AuditReply]]) -> None:
        """`finished`: the jobs receipt_check finished (its buffer, AuditConfig.max_queued_jobs
        in the assembled coordinator, is the audit queue); `audit_replies`: (peer, AuditReply)
        pairs from the swarm's control streams. serve() is their only reader."""
        self.swarm, self.store, self.config = swarm, store, config
        self._finished, self._replies = finished, audit_replies
        self.key = NodeKey.from_private_bytes(coordinator_seed)
        self.rng = rng or random.SystemRandom()
        self.evidence: list = []  # EvidenceRecord, newest last
        self.stats = AuditStats()
        self._waiting: dict[tuple, list] = {}  # (peer, job, epoch, round, side) -> [Event, reply]
        self._slices: OrderedDict[tuple[LayerRange, str], Stage] = OrderedDict()  # (layers, quant) -> slice
        self._limiter = trio.CapacityLimiter(1)
        self._settled = trio.Event()  # set each time serve() has audited all it was handed

    async def wait_idle(self) -> None:
        """Return once every finished job handed over has been audited (tests and benchmarks).
        serve() waiting on an empty `finished` channel is exactly that: it parks there only
        with nothing queued and nothing in hand (a job handed straight to it unparks it)."""
        while not self._finished.statistics().tasks_waiting_receive:
            await self._settled.wait()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Audit finished jobs one at a time, and route audit replies to the fetches waiting
        for them, forever. Error handling: a stage that left the swarm is skipped (the
        swarm already re-forms without it); nothing here raises."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._serve_replies)
            task_status.started()
            await self._serve_audits()

    async def _serve_replies(self) -> None:
        async for peer, reply in self._replies:
            self._on_reply(peer, reply)

    async def _serve_audits(self) -> None:
        while True:
            self._settled.set()
            self._settled = trio.Event()
            job = await self._finished.receive()
            if time.monotonic() - job.finished_s > self.config.max_job_age_s:
                log.warning("audit backlog: job %s waited %.0f s, its frame logs may be gone; not audited",
                            job.job_id, time.monotonic() - job.finished_s)
                self.stats.skipped_stale += 1
                plans = []
            else:
                plans = plan_audits(job, self.config.rate, self.rng)
            for plan in plans:
                try:
                    await self.audit(plan)
                except (TransportError, trio.TooSlowError) as exc:
                    self.stats.skipped_gone += 1
                    log.info("audit of %s on job %s skipped, the stage left: %s", plan.peer_id, plan.job_id, exc)

    async def audit(self, plan: AuditPlan) -> Finding | None:
        """Audit one stage's frames of one job. Raises TransportError or TooSlowError only
        when the stage left the swarm before answering (then it is not accused). The stage
        is replayed under the quantisation it registered with."""
        member = self.swarm.members.get(plan.peer_id)
        if member is not None:
            plan = dataclasses.replace(plan, quant=member.register.quant)
        try:
            records = await self._fetch_all(plan)
        except (TransportError, trio.TooSlowError) as exc:
            if plan.peer_id not in self.swarm.members:
                raise
            first = min(plan.receipts)
            finding = Finding("unanswered", first, f"no audit reply within {self.config.reply_timeout_s:g} s "
                              f"while connected ({type(exc).__name__})", _failed_spot(TOLERANCES.get(plan.wire_dtype, TOLERANCES["f32"])),
                              bytes(32))
            self.stats.audits += 1
            self._accuse(plan, finding)
            return finding
        stage = await self._stage(plan.layers, plan.quant)
        started = time.perf_counter()
        finding = await trio.to_thread.run_sync(check_frames, stage, plan, records, self.swarm.control_limits,
                                                self.config.max_replay_rows, self.stats.replay, limiter=self._limiter)
        self.stats.replay_s += time.perf_counter() - started
        self.stats.audits += 1
        self.stats.frames_compared += len(plan.receipts)
        if finding is not None:
            self._accuse(plan, finding)
        return finding

    def _accuse(self, plan: AuditPlan, finding: Finding) -> None:
        """Sign evidence against the stage's receipt for the round and mark it faulty."""
        receipt = plan.receipts.get(finding.round) or next(iter(plan.receipts.values()))
        record = sign_evidence(self.key, receipt=receipt, recomputed_digest=finding.recomputed_digest,
                               check=finding.spot)
        self.evidence.append(record)
        self.swarm.mark_faulty(plan.peer_id, f"audit {finding.check}: job {plan.job_id}, {finding.detail}")

    async def _fetch_all(self, plan: AuditPlan) -> dict[int, tuple[bytes, bytes]]:
        """Both logged frames of every planned round, requested concurrently (a few at a
        time). Error handling: the first TransportError or TooSlowError is re-raised."""
        got: dict[tuple[int, str], bytes | None] = {}
        failed: list[Exception] = []
        limiter = trio.CapacityLimiter(16)

        async def one(r: int, side: str) -> None:
            async with limiter:
                try:
                    got[r, side] = await self._fetch(plan, r, side)
                except (TransportError, trio.TooSlowError) as exc:
                    failed.append(exc)

        async with trio.open_nursery() as nursery:
            for r in plan.rounds:
                for side in ("input", "output"):
                    nursery.start_soon(one, r, side)
        if failed:
            raise failed[0]
        return {r: (got[r, "input"], got[r, "output"]) for r in plan.rounds   # type: ignore[misc]
                if got.get((r, "input")) is not None and got.get((r, "output")) is not None}

    async def _fetch(self, plan: AuditPlan, round: int, side: str) -> bytes | None:
        key = (plan.peer_id, plan.job_id, plan.epoch, round, side)
        slot = self._waiting[key] = [trio.Event(), None]
        try:
            await self.swarm.send_control(plan.peer_id, AuditRequest(job_id=plan.job_id, epoch=plan.epoch,
                                                                     round=round, side=side))
            with trio.fail_after(self.config.reply_timeout_s):
                await slot[0].wait()
        finally:
            self._waiting.pop(key, None)
        reply: AuditReply = slot[1]
        return None if reply.frame is None else reply.frame.numpy().tobytes()

    def _on_reply(self, peer: PeerId, reply: AuditReply) -> None:
        slot = self._waiting.get((peer, reply.job_id, reply.epoch, reply.round, reply.side))
        if slot is not None:  # replies nobody asked for (or from another peer) are dropped
            slot[1] = reply
            slot[0].set()

    async def _stage(self, r: LayerRange, quant: str = "none") -> Stage:
        key = (r, quant)
        stage = self._slices.get(key)
        if stage is None:
            store, cfg = self.store, self.store.config

            def load() -> Stage:
                emb = store.load_embedding() if r.start == 0 else None
                stage = Stage(cfg, r, store.load_layers(r), dtype=torch.float32, device="cpu", embedding=emb)
                return quantise_stage(stage, scheme(quant))

            stage = self._slices[key] = await trio.to_thread.run_sync(load, limiter=self._limiter)
            while len(self._slices) > self.config.max_cached_slices:
                self._slices.popitem(last=False)
        self._slices.move_to_end(key)
        return stage
