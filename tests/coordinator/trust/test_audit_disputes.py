"""Audits after a job never accuse on a newcomer verifier's word alone (issue 20).

With a newcomer stage audited by the only verifier that could be asked, itself a newcomer,
`opinions.settle` took the verifier's word (one against one, the verifier wins): a lying
newcomer verifier framed every honest stage it was asked about. Now such an audit accuses
nobody: the two are in dispute on the gateway's one book (coordinator.trust.dispute_desk,
shared with probation's round checks), both sit out, and a verifier in dispute with two
stages that disputed with nobody else is marked faulty. A trusted verifier's word still
decides. The recomputation and the comparison are stubbed (their maths has its own tests:
test_audit_replay, test_opinions); what runs is the Auditor's judging and the book.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import trio

from coordinator.trust import audit as audit_module
from coordinator.trust.audit import AuditConfig, Auditor
from coordinator.trust.audit_plan import AuditPlan
from coordinator.trust.compare import Finding
from coordinator.trust.round_verifier import RoundVerifier
from shard.layers import LayerRange


class Swarm(SimpleNamespace):
    def __init__(self):
        super().__init__(members={}, faulty={}, sat_out=[], readmitted=[])

    async def send_control(self, peer, msg):  # frame releases: none matter here
        pass

    def mark_faulty(self, peer, why):
        self.faulty[peer] = why

    def report_unreachable(self, peer, why, kind):
        self.sat_out.append((peer, kind))

    def readmit(self, peers, kind):
        self.readmitted.extend(sorted(peers))


def _plan(stage: str) -> AuditPlan:
    return AuditPlan(f"job-{stage}", 1, stage, LayerRange(0, 2), False, "f32", None, (0,), {})


def _auditor(monkeypatch, swarm, answers: dict[str, str], probation: set[str]) -> Auditor:
    """An Auditor whose verifiers answer `answers[verifier]` ("right" or "wrong"), asked in
    sorted order; a "wrong" answer disagrees with the (honest) stage."""
    _, finished = trio.open_memory_channel(0)
    _, replies = trio.open_memory_channel(0)
    auditor = Auditor(swarm, None, bytes(32), AuditConfig(rate=1.0, replay_here=False), rng=random.Random(0),
                      finished=finished, audit_replies=replies)
    auditor.on_probation = lambda peer: peer in probation

    async def recompute(plan, logged, asked):
        left = [v for v in sorted(answers) if v not in asked]
        if not left:
            return None
        asked.add(left[0])
        return left[0], answers[left[0]]

    monkeypatch.setattr(auditor, "_recompute", recompute)
    wrong = Finding("output_mismatch", 0, "rows differ", None, bytes(32))
    monkeypatch.setattr(audit_module, "compare", lambda plan, logged, expected: wrong if expected == "wrong" else None)
    monkeypatch.setattr(audit_module, "agree", lambda plan, logged, a, b: a == b)
    return auditor


def test_a_lone_newcomer_verifier_disputes_instead_of_framing_and_is_named_after_two_stages(monkeypatch):
    swarm = Swarm()
    auditor = _auditor(monkeypatch, swarm, {"liar": "wrong"}, probation={"liar", "s1", "s2"})
    verifier = RoundVerifier(swarm, auditor, None)

    async def main():
        first = await auditor._judge(_plan("s1"), logged=None)
        assert first == (True, None) and swarm.faulty == {}  # before: s1 faulty on the liar's word
        assert sorted(swarm.sat_out) == [("liar", "disputed"), ("s1", "disputed")]
        assert [d["nodes"] for d in verifier.open_disputes()] == [["s1", "liar"]]  # one book with probation's checks
        second = await auditor._judge(_plan("s2"), logged=None)
        assert second == (True, None)
        assert set(swarm.faulty) == {"liar"} and swarm.readmitted == ["s1", "s2"]
        assert auditor.stats.disputed == 2 and verifier.open_disputes() == []

    trio.run(main)


def test_a_trusted_verifier_still_decides_alone_and_two_newcomers_agreeing_outvote_one(monkeypatch):
    swarm = Swarm()
    auditor = _auditor(monkeypatch, swarm, {"veteran": "wrong"}, probation={"s1"})

    async def main():
        judged, finding = await auditor._judge(_plan("s1"), logged=None)
        assert judged and finding is not None and finding.check == "output_mismatch"  # the caller accuses s1
        assert auditor.stats.disputed == 0 and swarm.sat_out == []

    trio.run(main)
    swarm = Swarm()  # newcomer verifiers a and b agree with each other against the stage: a majority, not a lone word
    auditor = _auditor(monkeypatch, swarm, {"a": "wrong", "b": "wrong"}, probation={"a", "b", "s1"})

    async def majority():
        judged, finding = await auditor._judge(_plan("s1"), logged=None)
        assert judged and finding is not None and auditor.stats.disputed == 0

    trio.run(majority)
