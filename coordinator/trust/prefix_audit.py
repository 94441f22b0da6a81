"""A forked job's audit: the source's frames replayed before the job's own, never compared.

A job J's first frame on an epoch may name a source job P (prefix_job, prefix_len L): each
stage copies slots [0, L) of P's K/V cache, as P's frames left it there, into J's before
running the frame (shard.stage_worker). So J's outputs on a stage depend on K/V that P's
frames computed on that stage, and a replay of J's frames alone, on an empty cache, differs
from what an honest stage sent. The auditor fetches the stage's frames of P on the same
epoch as well (same stage: the epoch fixes the ring), each checked against the stage's
receipt for P's round like any record; `with_source` puts those that made slots [0, L)
before J's frames (`Logged.lead`), so the recomputation (shard.replay, on a verifier or
here) runs them first as one job and the comparison sees J's rows only. A missing or
altered record of P is a finding against the stage, on J's fork round: it signed J's
first frame, which names P, so it must show the K/V it started from.

Pure over decoded frames. It does not fetch, replay or judge (coordinator.trust.audit does).
"""

from __future__ import annotations

import dataclasses

from coordinator.trust.audit_plan import AuditPlan
from coordinator.trust.compare import Finding, Logged, failed_spot, logged_frames
from coordinator.trust.tolerance import stage_tolerance
from shard.wire.messages import Forward


def _slots_below(f: Forward, prefix_len: int) -> set[int]:
    """The slots below `prefix_len` that frame `f` writes: its commit's destination and its
    own rows (slot = ctx_len + row)."""
    rows = range(f.ctx_len, min(f.ctx_len + f.positions.shape[0], prefix_len))
    moved = range(f.commit_dst, min(f.commit_dst + len(f.commit_src), prefix_len))
    return set(rows) | set(moved)


def lead_frames(source: Logged, prefix_len: int) -> Logged | None:
    """The source's frames, in processing order, through the last one that writes a slot
    below `prefix_len` (its rows or its commit's destination): the frames that made slots
    [0, prefix_len) what the fork copied. In an engine's frames that is every frame whose
    ctx_len is below prefix_len and the first one at or past it when its commit moves rows
    below it; later frames write at or past their ctx_len. None when these frames leave a
    slot below prefix_len unwritten (a replay would read K/V that no logged frame made)."""
    written: set[int] = set()
    last = -1
    for i, f in enumerate(source.inputs):
        below = _slots_below(f, prefix_len)
        if below:
            written.update(below)
            last = i
    if len(written) < prefix_len:
        return None
    n = last + 1
    return Logged(source.rounds[:n], source.inputs[:n], source.outputs[:n], source.input_bytes[:n])


def with_source(plan: AuditPlan, records: dict[int, tuple[bytes, bytes]],
                source_records: dict[int, tuple[bytes, bytes]] | None, limits) -> Logged | Finding | None:
    """The stage's logged frames of plan's job (compare.logged_frames), with the source's
    frames to replay first (`lead`) when the stage ran the job's fork frame. A Finding
    against the stage when its records of either job fail their receipts or its fork frame
    names another source than the gateway sent; None when the source's frames cannot make
    the prefix (the fork is not the job's first frame here, or they leave a slot unwritten):
    not replayable, nobody accused. `source_records`: the stage's records of plan.prefix."""
    logged = logged_frames(plan, records, limits)
    if isinstance(logged, Finding) or plan.prefix is None or source_records is None:
        return logged
    fork = next((i for i, f in enumerate(logged.inputs) if f.prefix_job is not None), None)
    if fork is None:
        return logged  # the stage never ran the fork (it refused it; the job started again from 0)
    r, f, source = logged.rounds[fork], logged.inputs[fork], plan.prefix
    if (f.prefix_job, f.prefix_len) != (source.job_id, plan.prefix_len):
        return Finding("structure", r, f"logged frame of round {r} forks from job {f.prefix_job!r} at "
                       f"{f.prefix_len}, the gateway sent {source.job_id!r} at {plan.prefix_len}",
                       failed_spot(stage_tolerance(plan.wire_dtype, plan.quant)), bytes(32))
    if fork != 0:
        return None
    frames = logged_frames(source, source_records, limits)
    if isinstance(frames, Finding):
        return dataclasses.replace(frames, round=r, detail=f"its frames of source job {source.job_id} "
                                   f"(round {frames.round}): {frames.detail}")
    lead = lead_frames(frames, plan.prefix_len)
    return None if lead is None else dataclasses.replace(logged, lead=lead)
