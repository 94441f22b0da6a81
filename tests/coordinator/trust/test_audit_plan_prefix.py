"""Audit plans of a forked job (coordinator.trust.audit_plan.plan_audits with a source).

Bugs guarded: a fork's plan on the epoch it forked on without its source's plan for the
same stage (its audit would replay the fork alone and accuse an honest stage); the source's
plan for another stage index, or past the source's last verified round; a plan on another
epoch given a prefix it never had; a source that is not the one the job named, or lost,
taken as known (the plan must say the source is unknown, so the audit is skipped and
counted, never run); the source changing the random draw (stages could tell forks from
other jobs). Also that the gateway notes the source a job's fork frame named
(receipt_check.JobReceipts.sent, FinishedJob.prefix). Sound: plans are compared with
plans made from the source's FinishedJob alone, by the same function.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import torch
import trio

from coordinator.trust.audit_plan import plan_audits
from coordinator.trust.receipt_check import JobReceipts
from shard.wire.messages import Forward
from tests.coordinator.trust.test_audit_replay import finished_job


def _jobs():
    """A source that ran rounds 1-3 on epoch 1 (3 unverified), and a fork of it that ran
    rounds 1-2 on epoch 1 and round 3 on epoch 2, three stages a ring."""
    source = dataclasses.replace(finished_job(3, {1: [1, 2, 3]}, {1: 1, 2: 1}), job_id="src")
    fork = dataclasses.replace(finished_job(3, {1: [1, 2], 2: [3]}, {1: 1, 2: 1, 3: 2}), job_id="fork",
                               prefix=(1, "src", 5))
    return source, fork


def test_a_plan_on_the_forks_epoch_carries_the_sources_plan_for_its_stage():
    source, fork = _jobs()
    plans = plan_audits(fork, 1.0, random.Random(0), source)
    own = plan_audits(source, 1.0, random.Random(0))
    assert [(p.epoch, p.peer_id, p.prefix_len) for p in plans] == [(1, f"peer{i}", 5) for i in range(3)] + [
        (2, f"peer{i}", 0) for i in range(3)]
    for i, plan in enumerate(plans[:3]):
        assert plan.prefix == own[i] and plan.prefix.rounds == (1, 2) and not plan.source_unknown
        assert plan.prefix.receipts == {1: "receipt1.%d" % i, 2: "receipt2.%d" % i}
    assert all(p.prefix is None and not p.source_unknown for p in plans[3:])
    assert plans[0].under("int8").prefix.quant == "int8"


def test_an_unknown_or_wrong_source_is_said_so_and_the_draw_does_not_change():
    source, fork = _jobs()
    known = plan_audits(fork, 0.5, random.Random(7), source)
    for lost in (None, dataclasses.replace(source, job_id="other"), dataclasses.replace(source, epochs={})):
        plans = plan_audits(fork, 0.5, random.Random(7), lost)
        assert [(p.epoch, p.peer_id) for p in plans] == [(p.epoch, p.peer_id) for p in known]
        assert [p.source_unknown for p in plans] == [p.epoch == 1 for p in plans]
    assert [(p.epoch, p.peer_id) for p in known] == [
        (p.epoch, p.peer_id) for p in plan_audits(dataclasses.replace(fork, prefix=None), 0.5, random.Random(7))]


def test_the_gateway_notes_the_source_its_fork_frame_named():
    got = []
    job = JobReceipts(SimpleNamespace(_unaudited=got.append), "fork", bytes(16), [1, 2, 3])
    for round_, ctx, prefix in ((1, 4, "src"), (2, 6, None)):
        job.sent(Forward(job_id="fork", epoch=3, round=round_, nonce=bytes(16), phase="prefill", ctx_len=ctx,
                         positions=torch.arange(ctx, ctx + 2), tokens=torch.tensor([5, 6]), prefix_job=prefix,
                         prefix_len=ctx if prefix else 0), bytes(32))
    trio.run(job.finish, [7])  # no round verified: the unaudited path
    assert [j.prefix for j in got] == [(3, "src", 4)]
    plain = JobReceipts(SimpleNamespace(_unaudited=got.append), "plain", bytes(16), [1])
    trio.run(plain.finish, [7])
    assert got[-1].prefix is None
