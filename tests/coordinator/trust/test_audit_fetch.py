"""The auditor's ranged fetch of a stage's logged frames (coordinator.trust.audit.fetch_all).

Guards issue 21's audit cost and the audit's soundness together: every planned round's two
frames arrive, byte for byte, in as few AuditRequests as the reply budget allows (not two
per round), a round the stage kept no record of is absent (so the audit reads it as a
missing record), and a stage whose reply breaks the rules gets no more requests: the rest
of its frames count as not kept, which accuses it, instead of an audit that never ends.
"""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import trio

from coordinator.trust.audit import AuditConfig, Auditor
from coordinator.trust.audit_plan import AuditPlan
from shard.audit_answers import answer
from shard.frame_log import FrameLog
from shard.layers import LayerRange
from shard.wire.audit_frames import AuditReply, AuditRequest
from shard.wire.limits import Limits

ROUNDS = tuple(range(1, 41))


def _plan(rounds=ROUNDS) -> AuditPlan:
    return AuditPlan(job_id="job", epoch=1, peer_id="stage", layers=LayerRange(0, 1), is_tail=False, wire_dtype="f32",
                     aux_dtype=None, rounds=rounds, receipts={})


def _fetch(log: FrameLog, reply_bytes: int, tamper=None):
    """fetch_all of _plan() from a stage answering from `log`; (frames, requests seen)."""
    asked: list[AuditRequest] = []

    async def main():
        replies_in, replies = trio.open_memory_channel(16)

        async def send_control(peer, msg):
            if isinstance(msg, AuditRequest):
                asked.append(msg)
                reply = answer(log, msg)
                await replies_in.send((peer, tamper(reply) if tamper else reply))

        swarm = SimpleNamespace(members={}, faulty={}, send_control=send_control, control_limits=Limits())
        _, finished = trio.open_memory_channel(0)
        auditor = Auditor(swarm, None, bytes(32), AuditConfig(fetch_reply_bytes=reply_bytes), rng=random.Random(0),
                          finished=finished, audit_replies=replies)
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            with trio.fail_after(10):
                got = await auditor.fetch_all(_plan())
            nursery.cancel_scope.cancel()
        return got

    return trio.run(main), asked


def _log(skip=()) -> FrameLog:
    log = FrameLog()
    for r in ROUNDS:
        if r not in skip:
            log.record("job", 1, r, b"in%d." % r + bytes(600), b"out%d." % r + bytes(900))
    return log


def test_every_round_arrives_whole_in_a_few_requests():
    got, asked = _fetch(_log(), reply_bytes=10_000)  # 40 rounds of ~1.5 KB: six or seven a reply
    assert got == {r: (b"in%d." % r + bytes(600), b"out%d." % r + bytes(900)) for r in ROUNDS}
    assert 6 <= len(asked) <= 8  # two a round (80) before
    assert [r for req in asked for r in req.rounds][:2] == [1, 1] and asked[0].sides[:2] == ("input", "output")
    got, asked = _fetch(_log(), reply_bytes=1 << 20)
    assert len(got) == len(ROUNDS) and len(asked) == 1


def test_a_round_not_kept_is_absent():
    got, _ = _fetch(_log(skip={7, 30}), reply_bytes=10_000)
    assert sorted(got) == [r for r in ROUNDS if r not in (7, 30)]


def test_a_reply_breaking_the_rules_ends_the_fetch_and_the_rest_reads_as_not_kept():
    got, asked = _fetch(_log(), reply_bytes=10_000, tamper=lambda reply: AuditReply(request_id=reply.request_id, sizes=()))
    assert got == {} and len(asked) == 1
    calls = []

    def second_reply_empty(reply):
        calls.append(reply)
        return reply if len(calls) == 1 else dataclasses.replace(reply, sizes=(), frames=None)

    got, asked = _fetch(_log(), reply_bytes=10_000, tamper=second_reply_empty)
    first = calls[0].sizes
    assert len(asked) == 2 and sorted(got) == list(ROUNDS[:len(first) // 2])
