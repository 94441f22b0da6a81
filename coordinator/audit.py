"""Audits: recompute a stage's slice on the bytes it logged and compare with what it sent.

Receipts prove consistency, not correct computation: a stage can sign garbage. After a
job is finished (so no stage can tell an audited frame from any other, and no user token
waits), `plan_audits` selects each (verified round, stage) with probability `rate`. A
selected stage is audited on its (job, epoch): the auditor fetches every frame the stage
logged for that job and epoch up to the last selected round (AuditRequest over the control
stream), checks each against the digests in that stage's signed receipt (so the stage
cannot substitute bytes after the fact), and replays the frames in order on a fresh KV
cache with the slice loaded from the coordinator's own store (in a worker thread). Every
replayed verified round is compared, not only the selected one: the replay computed them
anyway. Consecutive plain frames (no tree, no commit, contiguous slots) are replayed as
one batched forward, so auditing a whole decode costs about one prefill.

A mismatch, a missing record or a record that does not hash to the receipt yields an
EvidenceRecord signed by the coordinator and marks the stage faulty in the swarm, which
excludes it from the next ring formation.

It does not check receipt chains (receipt_check), choose rings, or serve HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import trio

from coordinator.receipt_check import FinishedJob
from coordinator.swarm import Swarm
from receipts import (NodeKey, Receipt, SpotCheck, Tolerance, compare_outputs, sha256_digest, sign_evidence)
from shard.activations import from_wire
from shard.errors import WireError
from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import ModelStore
from shard.transport import TransportError
from shard.wire.codec import decode
from shard.wire.messages import AuditReply, AuditRequest, Forward, Result

log = logging.getLogger("shard.coordinator")

# Recomputation in f32 on another machine, batched differently, differs from the stage's
# own f32 by ~1e-6 relative; after the wire codec that is at most one step of the wire
# dtype on an element that sat next to a rounding boundary. So an element may differ by
# one wire ulp (rel_tol) and a rare few (max_outlier_fraction) by more. Calibrated on
# honest tiny-model runs (tests/e2e/test_receipts_ring.py: zero outliers seen) with margin.
TOLERANCES: dict[str, Tolerance] = {
    "f32": Tolerance(abs_tol=1e-4, rel_tol=1e-3, max_outlier_fraction=1e-3),
    "f16": Tolerance(abs_tol=1e-3, rel_tol=2e-3, max_outlier_fraction=1e-3),
    "bf16": Tolerance(abs_tol=1e-2, rel_tol=1.6e-2, max_outlier_fraction=1e-3),  # ulp 2^-7
    "f8_e4m3fn": Tolerance(abs_tol=2e-2, rel_tol=0.13, max_outlier_fraction=2e-3),  # ulp 2^-3
    "f8_e5m2": Tolerance(abs_tol=4e-2, rel_tol=0.26, max_outlier_fraction=2e-3),  # ulp 2^-2
}


@dataclass(frozen=True)
class AuditConfig:
    # Probability that any one (round, stage) is selected. Cost: a selected stage's frames
    # of that job, up to the selected round, are replayed batched (≈ one prefill of the
    # job's context on that slice), so compute ≈ rate × frames per job × prefill/decode
    # cost ratio of the ring's compute; measured in scripts/bench_receipts_ring.py.
    rate: float = 0.05
    reply_timeout_s: float = 30.0
    max_queued_jobs: int = 256  # finished jobs waiting for audit; more are not audited
    max_cached_slices: int = 4  # slices kept loaded for replays


@dataclass(frozen=True)
class AuditPlan:
    """One stage's frames of one (job, epoch) to replay, and which rounds to compare."""

    job_id: str
    epoch: int
    peer_id: str
    layers: LayerRange
    is_tail: bool
    wire_dtype: str
    rounds: tuple[int, ...]  # every round sent on this epoch up to the last selected, in send order
    receipts: dict[int, Receipt]  # round -> this stage's verified receipt, for those rounds


def plan_audits(job: FinishedJob, rate: float, rng: random.Random) -> list[AuditPlan]:
    """Select each (verified round, stage) with probability `rate`; one plan per selected
    (epoch, stage). Pure given `rng` (the auditor uses SystemRandom: stages cannot predict it)."""
    plans = []
    for epoch, sent in sorted(job.sent_rounds.items()):
        view = job.epochs.get(epoch)
        if view is None:
            continue
        verified = [r for r in sent if r in job.verified and job.verified[r].epoch == epoch]
        for index, (peer, layers) in enumerate(view.ring.stages):
            picked = [r for r in verified if rng.random() < rate]
            if not picked:
                continue
            upto = sent[: sent.index(max(picked, key=sent.index)) + 1]
            receipts = {r: job.verified[r].receipts[index] for r in upto if r in job.verified}
            a = view.ring.assignments[index]
            plans.append(AuditPlan(job.job_id, epoch, peer, layers, index == len(view.ring.stages) - 1,
                                   a.wire_dtype, tuple(upto), receipts))
    return plans


@dataclass(frozen=True)
class Finding:
    """Why a stage failed an audit: check name, round, one-line detail, the comparison."""

    check: str  # "missing_record" | "record_digest" | "structure" | "output_mismatch"
    round: int
    detail: str
    spot: SpotCheck
    recomputed_digest: bytes


def _failed_spot(tolerance: Tolerance) -> SpotCheck:
    """The comparison recorded when there was nothing to compare: every element failed."""
    return SpotCheck(tolerance, 1, 1, float("inf"), float("inf"))


def _merge_key(f: Forward) -> tuple:
    return (f.tokens is None, f.want_aux_layers, None if f.hidden is None else f.hidden.dtype,
            None if f.aux is None else (f.aux.dtype, f.aux.shape[1]))


def _batches(frames: list[Forward]) -> list[list[int]]:
    """Indices of frames grouped into runs that one forward reproduces: no tree, no
    commit after the first, each starting where the previous one's slots ended."""
    runs: list[list[int]] = []
    for i, f in enumerate(frames):
        if runs:
            prev = frames[runs[-1][-1]]
            plain = f.tree_parents is None and prev.tree_parents is None and not f.commit_src
            if plain and f.ctx_len == prev.ctx_len + prev.positions.shape[0] and _merge_key(f) == _merge_key(prev):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]


def replay(stage: Stage, wire_dtype: str, frames: list[Forward]) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Recompute every frame in order on a fresh cache; per frame (hidden (T, H), aux
    (T, k*H) or None) in f32, as this slice sends them after the wire codec."""
    worker = StageWorker(stage, WorkerConfig(wire_dtype=wire_dtype, is_tail=False,
                                             max_context_tokens=stage.cfg.max_context_tokens))
    out: list[tuple[torch.Tensor, torch.Tensor | None]] = []
    job_id = "audit"
    for run in _batches(frames):
        parts = [frames[i] for i in run]
        first = parts[0]
        merged = dataclasses.replace(
            first, job_id=job_id, receipts=(), compute_s=(), phase="prefill" if len(parts) > 1 else first.phase,
            positions=torch.cat([p.positions for p in parts]), tokens=_cat([p.tokens for p in parts]),
            hidden=_cat([p.hidden for p in parts]), hidden_scale=_cat([p.hidden_scale for p in parts]),
            aux=_cat([p.aux for p in parts]), aux_scale=_cat([p.aux_scale for p in parts]))
        res = worker.process(merged)
        hidden = from_wire(res.hidden, res.hidden_scale, torch.float32)  # (sum T, H)
        aux = None if res.aux is None else from_wire(res.aux, res.aux_scale, torch.float32)
        start = 0
        for p in parts:
            t = p.positions.shape[0]
            out.append((hidden[start:start + t], None if aux is None else aux[start:start + t]))
            start += t
    worker.end_job(job_id)
    return out


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


def check_frames(stage: Stage, plan: AuditPlan, records: dict[int, tuple[bytes, bytes]], limits) -> Finding | None:
    """Pure over its inputs: verify the logged bytes against the receipts, replay, compare.
    `records`: round -> (input bytes, output bytes) as the stage returned them."""
    tol = TOLERANCES.get(plan.wire_dtype, TOLERANCES["f32"])
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
            inp, out = decode(rec[0], limits), decode(rec[1], limits)
        except WireError as exc:
            return Finding("structure", r, f"logged frame of round {r} does not decode: {exc}", _failed_spot(tol), bytes(32))
        if not isinstance(inp, Forward) or not isinstance(out, (Forward, Result)):
            return Finding("structure", r, f"logged frames of round {r} are not a Forward and its output",
                           _failed_spot(tol), bytes(32))
        inputs.append(inp), outputs.append(out), rounds.append(r)
    expected = replay(stage, plan.wire_dtype, inputs)
    for r, inp, out, (hidden, aux) in zip(rounds, inputs, outputs, expected):
        if r not in plan.receipts:
            continue
        problem = _structure_error(inp, out, plan.is_tail)
        if problem is not None:
            return Finding("structure", r, problem, _failed_spot(tol), bytes(32))
        if plan.is_tail and inp.phase == "prefill":
            hidden = hidden[-1:]  # the tail returns the last prompt row only
        claimed = from_wire(out.hidden, out.hidden_scale, torch.float32)
        pairs = [("hidden", hidden, claimed)]
        if aux is not None or out.aux is not None:
            pairs.append(("aux", aux, None if out.aux is None else from_wire(out.aux, out.aux_scale, torch.float32)))
        for name, e, a in pairs:
            if e is None or a is None or e.shape != a.shape:
                return Finding("structure", r, f"'{name}' shape {None if a is None else list(a.shape)}, "
                               f"recomputed {None if e is None else list(e.shape)}", _failed_spot(tol), bytes(32))
            spot = compare_outputs(e.reshape(-1).numpy(), a.reshape(-1).numpy(), tol)
            if not spot.passed:
                return Finding("output_mismatch", r, f"round {r} '{name}': {spot.num_outliers}/{spot.num_elements} "
                               f"elements off (max abs error {spot.max_abs_error:.3g})", spot,
                               sha256_digest(e.numpy().tobytes()))
    return None


@dataclass
class AuditStats:
    audits: int = 0
    frames_compared: int = 0
    replay_s: float = 0.0


class Auditor:
    def __init__(self, swarm: Swarm, store: ModelStore, coordinator_seed: bytes, config: AuditConfig = AuditConfig(),
                 rng: random.Random | None = None) -> None:
        self.swarm, self.store, self.config = swarm, store, config
        self.key = NodeKey.from_private_bytes(coordinator_seed)
        self.rng = rng or random.SystemRandom()
        self.evidence: list = []  # EvidenceRecord, newest last
        self.stats = AuditStats()
        self._send, self._recv = trio.open_memory_channel(config.max_queued_jobs)
        self._waiting: dict[tuple, list] = {}  # (peer, job, epoch, round, side) -> [Event, reply]
        self._slices: OrderedDict[LayerRange, Stage] = OrderedDict()
        self._limiter = trio.CapacityLimiter(1)
        self._pending = 0  # jobs submitted and not yet audited
        self._idle = trio.Event()
        self._idle.set()
        swarm.audit_reply_handler = self._on_reply

    def submit_nowait(self, job: FinishedJob) -> None:
        """Queue a finished job (a receipt_check listener). Never blocks; drops when full."""
        try:
            self._send.send_nowait(job)
        except trio.WouldBlock:
            log.warning("audit queue full: job %s is not audited", job.job_id)
            return
        if self._pending == 0:
            self._idle = trio.Event()
        self._pending += 1

    async def wait_idle(self) -> None:
        """Return once every submitted job has been audited (tests and benchmarks)."""
        await self._idle.wait()

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Audit finished jobs one at a time, forever. Error handling: a stage that cannot
        be reached is skipped (it left; the swarm already re-forms); nothing here raises."""
        task_status.started()
        while True:
            job = await self._recv.receive()
            for plan in plan_audits(job, self.config.rate, self.rng):
                try:
                    await self.audit(plan)
                except (TransportError, trio.TooSlowError) as exc:
                    log.info("audit of %s on job %s skipped: %s", plan.peer_id, plan.job_id, exc)
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    async def audit(self, plan: AuditPlan) -> Finding | None:
        records: dict[int, tuple[bytes, bytes]] = {}
        for r in plan.rounds:
            sides = [await self._fetch(plan, r, side) for side in ("input", "output")]
            if sides[0] is not None and sides[1] is not None:
                records[r] = (sides[0], sides[1])
        stage = await self._stage(plan.layers)
        started = time.perf_counter()
        finding = await trio.to_thread.run_sync(check_frames, stage, plan, records, self.swarm.control_limits,
                                                limiter=self._limiter)
        self.stats.replay_s += time.perf_counter() - started
        self.stats.audits += 1
        self.stats.frames_compared += len(plan.receipts)
        if finding is not None:
            receipt = plan.receipts.get(finding.round) or next(iter(plan.receipts.values()))
            record = sign_evidence(self.key, receipt=receipt, recomputed_digest=finding.recomputed_digest,
                                   check=finding.spot)
            self.evidence.append(record)
            self.swarm.mark_faulty(plan.peer_id, f"audit {finding.check}: job {plan.job_id}, {finding.detail}")
        return finding

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

    def _on_reply(self, peer: str, reply: AuditReply) -> None:
        slot = self._waiting.get((peer, reply.job_id, reply.epoch, reply.round, reply.side))
        if slot is not None:  # replies nobody asked for (or from another peer) are dropped
            slot[1] = reply
            slot[0].set()

    async def _stage(self, r: LayerRange) -> Stage:
        stage = self._slices.get(r)
        if stage is None:
            store, cfg = self.store, self.store.config

            def load() -> Stage:
                emb = store.load_embedding() if r.start == 0 else None
                return Stage(cfg, r, store.load_layers(r), dtype=torch.float32, device="cpu", embedding=emb)

            stage = self._slices[r] = await trio.to_thread.run_sync(load, limiter=self._limiter)
            while len(self._slices) > self.config.max_cached_slices:
                self._slices.popitem(last=False)
        self._slices.move_to_end(r)
        return stage
