"""Audits of a forked job on a real stage: its first frame started from a source job's K/V.

Bugs guarded: an honest stage accused at the audit of a job that forked (replayed alone on
an empty cache, its frames' outputs differ from what the stage sent over the source's K/V);
a stage that runs the fork on other K/V than the source's frames made (here: it skips the
copy, a cheap cheat, while its frames of the source stay honest) passing its audit; a stage
that kept no faithful record of the source's frames escaping (or the audit reading the
source's rounds against the job's receipts, whose round numbers collide here on purpose).
Sound: the frames are what a real StageWorker sent, logged and signed with real receipts,
answered through the stage's own audit answering (shard.audit_answers) and recomputed by
the auditor on the slice loaded from the tiny model's store; audited as the old code did
(the job's frames alone, on a fresh cache whose unwritten slots are zeros), the honest
stage is accused and the cheat passes, so each assertion below tells the two apart.
"""

from __future__ import annotations

import dataclasses
import random

import torch
import trio

from coordinator.trust.audit import AuditConfig, Auditor
from coordinator.trust.audit_plan import AuditPlan
from receipts import NodeKey, sha256_digest, sign_receipt
from shard.audit_answers import answer
from shard.frame_log import FrameLog
from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.audit_frames import AuditRequest
from shard.wire.codec import encode_body
from shard.wire.limits import Limits
from shard.wire.messages import Forward
from shard.wire.release_frames import ReleaseFrames

LAYERS = LayerRange(0, 2)
NONCE = bytes(16)
KEY = NodeKey.from_private_bytes(bytes(range(32)))
PREFIX_LEN = 7


def _frame(job: str, round_: int, ctx: int, ids: list[int], prefix: str | None = None) -> Forward:
    return Forward(job_id=job, epoch=1, round=round_, nonce=NONCE, phase="prefill" if len(ids) > 1 else "decode",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids),
                   prefix_job=prefix, prefix_len=ctx if prefix else 0)


# The source: a 6-token prompt and two decode steps (slots [0, 8)); the fork shares its
# first 7 slots, then decodes twice. Both jobs number their rounds from 1.
SOURCE = [_frame("src", 1, 0, [5, 9, 7, 4, 11, 3]), _frame("src", 2, 6, [8]), _frame("src", 3, 7, [2])]
FORK = [_frame("fork", 1, PREFIX_LEN, [6, 10, 12], prefix="src"), _frame("fork", 2, 10, [13]),
        _frame("fork", 3, 11, [14])]


def _stage_log(store, poison_fork: bool = False) -> tuple[FrameLog, dict[str, AuditPlan]]:
    """Run the source then the fork through one stage (layers [0, 2) of the tiny model),
    log and sign every frame as a stage does; the log and each job's plan. `poison_fork`:
    the stage zeroes the K/V it copied for the fork (it runs the fork without the prefix)."""
    stage = Stage(store.config, LAYERS, store.load_layers(LAYERS), embedding=store.load_embedding())
    worker = StageWorker(stage, WorkerConfig(wire_dtype="f32"))
    if poison_fork:
        fork = worker.cache.fork

        def skipped_copy(job_id, source_id, slots, max_slots):
            job = fork(job_id, source_id, slots, max_slots)
            job.k[:, :, :slots] = 0
            job.v[:, :, :slots] = 0
            return job

        worker.cache.fork = skipped_copy
    log, plans = FrameLog(), {}
    for frames in (SOURCE, FORK):
        receipts = {}
        for f in frames:
            inp, out = encode_body(f), encode_body(worker.process(f))
            log.record(f.job_id, f.epoch, f.round, inp, out)
            receipts[f.round] = sign_receipt(KEY, manifest_digest=bytes(32), weights_digest=bytes(32), epoch=1,
                                             job_id=f.job_id, round=f.round, nonce=NONCE, layer_start=LAYERS.start,
                                             layer_end=LAYERS.end, input_digest=sha256_digest(inp),
                                             output_digest=sha256_digest(out))
        plans[frames[0].job_id] = AuditPlan(frames[0].job_id, 1, "stage", LAYERS, False, "f32", None,
                                            tuple(f.round for f in frames), receipts)
    plans["fork"] = dataclasses.replace(plans["fork"], prefix=plans["src"], prefix_len=PREFIX_LEN)
    return log, plans


class _Swarm:
    """The audited stage answers from its log; no verifier exists, so the gateway replays."""

    def __init__(self, log: FrameLog, replies_in) -> None:
        self.log, self.replies_in = log, replies_in
        self.members, self.faulty, self.control_limits = {}, {}, Limits()
        self.asked: list[tuple[str, int]] = []  # (job, round) of every item fetched

    async def send_control(self, peer, msg):
        if isinstance(msg, ReleaseFrames):
            return
        assert isinstance(msg, AuditRequest), msg
        self.asked += [(msg.job_id, r) for r in msg.rounds]
        await self.replies_in.send((peer, answer(self.log, msg)))

    def mark_faulty(self, peer, why):
        self.faulty[peer] = why


def _audit(store, log: FrameLog, plan: AuditPlan):
    """(finding, auditor, swarm) of the real Auditor's audit of `plan`, replayed here."""
    findings, auditor, swarm = _audits(store, log, [plan])
    return findings[0], auditor, swarm


def _audits(store, log: FrameLog, plans: list[AuditPlan]):
    """([finding of each plan], auditor, swarm): one Auditor audits `plans` in turn."""

    async def main():
        replies_in, replies = trio.open_memory_channel(16)
        _, finished = trio.open_memory_channel(0)
        swarm = _Swarm(log, replies_in)
        auditor = Auditor(swarm, store, bytes(32), AuditConfig(rate=1.0), rng=random.Random(0), finished=finished,
                          audit_replies=replies)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            with trio.fail_after(30):
                findings = [await auditor.audit(plan) for plan in plans]
            nursery.cancel_scope.cancel()
        return findings, auditor, swarm

    return trio.run(main)


def test_an_honest_stage_passes_the_audit_of_a_fork_that_its_frames_alone_would_fail(tiny_llama_store):
    log, plans = _stage_log(tiny_llama_store)
    finding, auditor, swarm = _audit(tiny_llama_store, log, plans["fork"])
    assert finding is None and swarm.faulty == {} and auditor.evidence == []
    assert auditor.stats.audits == 1 and auditor.stats.by_coordinator == 1
    assert auditor.stats.replay.rows >= 6 + 1 + 3  # the source's rows were recomputed first
    assert {("src", r) for r in (1, 2, 3)} <= set(swarm.asked)  # the source's frames fetched from the stage
    # The old audit (the fork's frames alone, on an empty cache) accuses this honest stage.
    alone = dataclasses.replace(plans["fork"], prefix=None, prefix_len=0)
    finding, _, swarm = _audit(tiny_llama_store, log, alone)
    assert finding is not None and finding.check == "output_mismatch" and finding.round == 1
    assert "stage" in swarm.faulty


def test_the_next_fork_of_a_source_on_the_stage_is_audited_on_its_frames_fetched_once(tiny_llama_store):
    # Guards the source-frames cache (coordinator.trust.source_frames): a source's frames are
    # fetched from a stage once, not at every audit of a fork of it, and still checked and
    # replayed at each.
    log, plans = _stage_log(tiny_llama_store)
    findings, auditor, swarm = _audits(tiny_llama_store, log, [plans["fork"], plans["fork"]])
    assert findings == [None, None] and swarm.faulty == {} and auditor.stats.audits == 2
    assert swarm.asked.count(("src", 1)) == 2  # its input and output, once
    assert swarm.asked.count(("fork", 1)) == 4  # the fork's own frames at each audit
    assert (auditor.sources.fetches, auditor.sources.hits) == (1, 1)
    # A stage that ran the fork on other K/V is caught on the kept frames as on fetched ones.
    poisoned, plans = _stage_log(tiny_llama_store, poison_fork=True)
    findings, _, swarm = _audits(tiny_llama_store, poisoned, [plans["fork"], plans["fork"]])
    assert [f.check for f in findings] == ["output_mismatch"] * 2 and "stage" in swarm.faulty


def test_a_stage_that_runs_the_fork_on_other_kv_than_the_source_made_is_caught(tiny_llama_store):
    log, plans = _stage_log(tiny_llama_store, poison_fork=True)
    assert _audit(tiny_llama_store, log, plans["src"])[0] is None  # its frames of the source are honest
    alone = dataclasses.replace(plans["fork"], prefix=None, prefix_len=0)
    assert _audit(tiny_llama_store, log, alone)[0] is None  # the old audit: zeroed K/V is what it replays
    finding, auditor, swarm = _audit(tiny_llama_store, log, plans["fork"])
    assert finding is not None and finding.check == "output_mismatch" and finding.round == 1
    assert "stage" in swarm.faulty and "job fork" in swarm.faulty["stage"]
    (record,) = auditor.evidence
    assert (record.receipt.job_id, record.receipt.round) == ("fork", 1)  # the fork's own signed receipt


def test_a_missing_or_altered_record_of_the_source_is_a_finding_on_the_fork_round(tiny_llama_store):
    log, plans = _stage_log(tiny_llama_store)
    for change, check in (("drop", "missing_record"), ("alter", "record_digest")):
        kept = FrameLog()
        for job, frames in (("src", SOURCE), ("fork", FORK)):
            for f in frames:
                rec = log.get(job, 1, f.round)
                if job == "src" and f.round == 2:
                    if change == "drop":
                        continue
                    rec = dataclasses.replace(rec, output_frame=rec.output_frame[:-1] + b"\x00")
                kept.record(job, 1, f.round, rec.input_frame, rec.output_frame)
        finding, auditor, swarm = _audit(tiny_llama_store, kept, plans["fork"])
        assert finding is not None and finding.check == check, change
        assert finding.round == 1 and "source job src (round 2)" in finding.detail
        assert auditor.evidence[0].receipt.job_id == "fork" and "stage" in swarm.faulty
