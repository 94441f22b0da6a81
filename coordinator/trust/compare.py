"""An audit's comparisons: a stage's logged frames against a recomputation of them, and two
recomputations against each other.

Pure over its inputs. `logged_frames` checks what a stage returned against its signed
receipts and decodes it; `compare` holds the stage's outputs to a recomputation (the
auditor's own replay or a verifier node's) under the stage's tolerance
(coordinator.trust.tolerance); `agree` holds two recomputations to the same tolerance,
so the auditor can tell which verifiers side with which (coordinator.trust.opinions);
`check_frames` is the three steps on a replay done here. A recomputation is, per frame,
the rows replayed (shard.replay.Replayed) or None; frames replayed before the logged
ones (`Logged.lead`: a forked job's source's) are recomputed, never compared.
`verify_parts` is the request a verifier node is asked with, `split_reply` its reply
back per frame. It does not
fetch, replay remotely, sign evidence or exclude anyone (coordinator.trust.audit does).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from coordinator.trust.audit_plan import AuditPlan
from coordinator.trust.tolerance import stage_tolerance
from receipts import SpotCheck, Tolerance, compare_outputs, sha256_digest
from shard.activations import from_wire
from shard.errors import WireError
from shard.quant import scheme
from shard.replay import Replayed, ReplayStats, replay
from shard.stage import Stage
from shard.wire.codec import decode
from shard.wire.messages import Forward, Result
from shard.verify_parts import split
from shard.wire.verify import MAX_VERIFY_REPLAY_ROWS, VerifyReply, VerifyRequest



@dataclass(frozen=True)
class Finding:
    """Why a stage failed an audit: check name, round, one-line detail, the comparison."""

    check: str  # "missing_record" | "record_digest" | "structure" | "output_mismatch" | "unanswered"
    round: int
    detail: str
    spot: SpotCheck
    recomputed_digest: bytes


@dataclass(frozen=True)
class Logged:
    """A stage's logged frames that passed their receipts' digests, in processing order."""

    rounds: tuple[int, ...]
    inputs: tuple[Forward, ...]
    outputs: tuple[Forward | Result, ...]
    input_bytes: tuple[bytes, ...]  # each input's canonical bytes, as logged (what a verifier is sent)
    # Frames recomputed before these and never compared: a forked job's source's frames on
    # the stage, which made the K/V its first frame started from (coordinator.trust.prefix_audit).
    lead: "Logged | None" = None

    @property
    def replayed_inputs(self) -> tuple[Forward, ...]:
        """What a recomputation runs, in order: the lead's inputs, then these."""
        return self.inputs if self.lead is None else self.lead.inputs + self.inputs

    @property
    def replayed_bytes(self) -> tuple[bytes, ...]:
        """The canonical bytes of replayed_inputs (what a verifier is sent)."""
        return self.input_bytes if self.lead is None else self.lead.input_bytes + self.input_bytes

    def own(self, recomputed: list[Replayed | None]) -> list[Replayed | None]:
        """A recomputation of replayed_inputs cut to these frames': the lead's rows dropped."""
        return recomputed if self.lead is None else recomputed[len(self.lead.inputs):]


def failed_spot(tolerance: Tolerance) -> SpotCheck:
    """The comparison recorded when there was nothing to compare: every element failed."""
    return SpotCheck(tolerance, 1, 1, float("inf"), float("inf"))


_SAME_FIELDS = ("job_id", "epoch", "round", "nonce", "phase", "ctx_len", "commit_src", "commit_dst", "want_aux_layers",
                "prefix_job", "prefix_len")


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


def logged_frames(plan: AuditPlan, records: dict[int, tuple[bytes, bytes]], limits) -> Logged | Finding:
    """Verify the logged bytes against the receipts and decode them. `records`: round ->
    (input bytes, output bytes) as the stage returned them."""
    tol = stage_tolerance(plan.wire_dtype, plan.quant)
    rounds, inputs, outputs, raw = [], [], [], []
    for r in plan.rounds:
        rec, receipt = records.get(r), plan.receipts.get(r)
        if rec is None:
            if receipt is not None:
                return Finding("missing_record", r, f"no logged frame for verified round {r}", failed_spot(tol), bytes(32))
            continue  # a round the coordinator never verified (it failed): not replayable
        if receipt is not None:
            for side, data, claimed in (("input", rec[0], receipt.input_digest), ("output", rec[1], receipt.output_digest)):
                if sha256_digest(data) != claimed:
                    return Finding("record_digest", r, f"logged {side} of round {r} does not hash to its receipt",
                                   failed_spot(tol), sha256_digest(data))
        try:
            inp, out = decode(rec[0], limits, canonical=True), decode(rec[1], limits, canonical=True)
        except WireError as exc:
            return Finding("structure", r, f"logged frame of round {r} does not decode: {exc}", failed_spot(tol), bytes(32))
        if not isinstance(inp, Forward) or not isinstance(out, (Forward, Result)):
            return Finding("structure", r, f"logged frames of round {r} are not a Forward and its output",
                           failed_spot(tol), bytes(32))
        rounds.append(r), inputs.append(inp), outputs.append(out), raw.append(rec[0])
    return Logged(tuple(rounds), tuple(inputs), tuple(outputs), tuple(raw))


def _claims(plan: AuditPlan, inp: Forward, out: Forward | Result, replayed: Replayed):
    """(name, recomputed (K, w), claimed (rows, w) or None, rows, tolerance) per output tensor."""
    keep, hidden, aux = replayed  # (K,), (K, H), (K, k*H) or None
    t = inp.positions.shape[0]
    trimmed = plan.is_tail and inp.phase == "prefill"  # the tail returns the last prompt row only
    tol = stage_tolerance(plan.wire_dtype, plan.quant)
    claims = [("hidden", hidden, from_wire(out.hidden, out.hidden_scale, torch.float32), 1 if trimmed else t, tol)]
    if aux is not None or out.aux is not None:
        claims.append(("aux", aux, None if out.aux is None else from_wire(out.aux, out.aux_scale, torch.float32), t,
                       stage_tolerance(plan.aux_dtype or plan.wire_dtype, plan.quant)))
    return claims


def _spot(e: torch.Tensor, a: torch.Tensor, tol: Tolerance) -> SpotCheck:
    rms = e.pow(2).mean(dim=1, keepdim=True).sqrt().expand_as(e)  # (K, width): each element's row RMS
    return compare_outputs(e.reshape(-1).numpy(), a.reshape(-1).numpy(), tol, scale=rms.reshape(-1).numpy())


def compare(plan: AuditPlan, logged: Logged, expected: Sequence[Replayed | None]) -> Finding | None:
    """Hold the stage's logged outputs to `expected` (one recomputation per logged frame)
    on every round it has a receipt for; the first failure, or None."""
    tol = stage_tolerance(plan.wire_dtype, plan.quant)
    if len(expected) != len(logged.rounds):
        return Finding("structure", logged.rounds[0] if logged.rounds else -1,
                       f"{len(expected)} frames recomputed for {len(logged.rounds)} logged", failed_spot(tol), bytes(32))
    for r, inp, out, replayed in zip(logged.rounds, logged.inputs, logged.outputs, expected):
        if r not in plan.receipts:
            continue
        problem = _structure_error(inp, out, plan.is_tail)
        if problem is not None:
            return Finding("structure", r, problem, failed_spot(tol), bytes(32))
        if replayed is None:
            continue  # no row of this frame was kept (see shard.replay.plan_replay)
        keep, t = replayed[0], inp.positions.shape[0]
        for name, e, a, rows, claim_tol in _claims(plan, inp, out, replayed):
            if e is None or a is None or a.shape != (rows, e.shape[1]):
                return Finding("structure", r, f"'{name}' shape {None if a is None else list(a.shape)}, "
                               f"recomputed {None if e is None else [rows, e.shape[1]]}", failed_spot(tol), bytes(32))
            if rows == t:
                a = a[keep]
            else:
                e = e[keep == t - 1]
            if e.shape[0] == 0:
                continue  # the tail's one row was not kept: nothing of this frame was read
            spot = _spot(e, a, claim_tol)
            if not spot.passed:
                return Finding("output_mismatch", r, f"round {r} '{name}': {spot.num_outliers}/{spot.num_elements} "
                               f"elements off (max abs error {spot.max_abs_error:.3g})", spot,
                               sha256_digest(e.numpy().tobytes()))
    return None


def agree(plan: AuditPlan, logged: Logged, a: Sequence[Replayed | None], b: Sequence[Replayed | None]) -> bool:
    """Whether two recomputations of the logged frames agree (same rows kept, values within
    the stage's tolerance of `a`) on every round the stage has a receipt for."""
    if len(a) != len(b):
        return False
    for r, x, y in zip(logged.rounds, a, b):
        if r not in plan.receipts:
            continue
        if (x is None) != (y is None):
            return False
        if x is None:
            continue
        if not torch.equal(x[0], y[0]) or (x[2] is None) != (y[2] is None):
            return False
        pairs = [(x[1], y[1], stage_tolerance(plan.wire_dtype, plan.quant))]
        if x[2] is not None:
            pairs.append((x[2], y[2], stage_tolerance(plan.aux_dtype or plan.wire_dtype, plan.quant)))
        for e, o, tol in pairs:
            if e.shape != o.shape or (e.shape[0] and not _spot(e, o, tol).passed):
                return False
    return True


def split_reply(reply: VerifyReply, logged: Logged) -> list[Replayed | None] | None:
    """A verifier's rows, per logged frame (as shard.replay returns them); None when they do
    not fit the frames it was sent (a count per frame, row indices within each frame, one
    order). The rows of the lead's frames are dropped."""
    frames = logged.replayed_inputs
    if len(reply.frame_rows) != len(frames):
        return None
    out: list[Replayed | None] = []
    start = 0
    for rows, inp in zip(reply.frame_rows, frames):
        keep = reply.keep[start:start + rows]
        if rows and (bool((keep[1:] <= keep[:-1]).any()) or int(keep[-1]) >= inp.positions.shape[0]):
            return None
        aux = None if reply.aux is None else reply.aux[start:start + rows]
        out.append((keep, reply.hidden[start:start + rows], aux) if rows else None)
        start += rows
    return logged.own(out)


def replay_here(stage: Stage, plan: AuditPlan, logged: Logged, max_replay_rows: int = 1024,
                stats: ReplayStats | None = None) -> list[Replayed | None]:
    """The auditor's own recomputation of the logged frames on `stage` (its slice), the
    lead's first (their rows dropped)."""
    return logged.own(replay(stage, plan.wire_dtype, list(logged.replayed_inputs), max_replay_rows, stats,
                             aux_dtype=plan.aux_dtype, frame_by_frame=scheme(plan.quant).quantised))


def check_frames(stage: Stage, plan: AuditPlan, records: dict[int, tuple[bytes, bytes]], limits,
                 max_replay_rows: int = 1024, stats: ReplayStats | None = None) -> Finding | None:
    """Verify the logged bytes against the receipts, replay them here on `stage`, compare."""
    logged = logged_frames(plan, records, limits)
    if isinstance(logged, Finding):
        return logged
    return compare(plan, logged, replay_here(stage, plan, logged, max_replay_rows, stats))


def verify_parts(request_id: int, plan: AuditPlan, logged: Logged, max_replay_rows: int, max_reply_bytes: int,
                 part_bytes: int, limits) -> list:
    """The VerifyRequest for the logged frames, cut to control frames (shard.verify_parts: ShardError if it cannot be)."""
    req = VerifyRequest(request_id=request_id, layer_start=plan.layers.start, layer_end=plan.layers.end, quant=plan.quant,
                        wire_dtype=plan.wire_dtype, aux_dtype=plan.aux_dtype, max_reply_bytes=max_reply_bytes,
                        max_replay_rows=min(max_replay_rows, MAX_VERIFY_REPLAY_ROWS), max_part_bytes=part_bytes,
                        frame_bytes=tuple(map(len, logged.replayed_bytes)),
                        frames=torch.frombuffer(bytearray(b"".join(logged.replayed_bytes)), dtype=torch.uint8))
    return split(req, part_bytes, limits)
