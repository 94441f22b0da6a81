"""A probation stage's round recomputed by verifier nodes before its tokens are released.

A gateway that cannot recompute the ring itself (its store lacks the layers, so the shadow
of coordinator.trust.shadow is off) still verifies a newcomer's rounds before release: for
a job's newest round on a stage on probation it fetches the stage's logged frames of the
job on that epoch (AuditRequest, only those not fetched yet), checks them against the
stage's verified receipts, and has a verifier node replay the stage's inputs
(VerifyRequest, shard.verifier). The stage's outputs are held to the recomputation under
the stage's tolerance (coordinator.trust.compare); a verifier that disagrees with the stage
gets a second opinion, and verifiers that disagree with each other a third
(coordinator.trust.opinions), as in an audit. The round's frames travel through the
auditor's request machinery (coordinator.trust.audit), which the swarm's replies reach.

Credit (issue 20): a passed check earns the stage its rounds only when a trusted verifier
(off probation, or listed by the operator) agreed; trusted verifiers outvote newcomers
(opinions.settle_trusted). Checked by newcomers alone, a disagreement still blocks the round,
an agreement earns nothing (`Outcome.vouched` False) and those rounds stay uncompared, so a
trusted verifier asked later credits them.

Who verifies (coordinator.trust.opinions.candidates, pure, shared with audits): a member
other than the stage, not faulty, whose node keeps every layer of the slice (loaded or in
its store): those off probation first, then those holding exactly the slice loaded, then
the one that verified this slice last, then those verifying no other slice (a node keeps
one verify slice loaded: asked for two in turn, it reloads one per round), then by peer id.

Disputes (coordinator.trust.disputes): where no trusted verifier took part and no two
parties agree against one (one newcomer verifier against a newcomer stage, or every party
on its own), nobody is marked faulty on that word: the round is held back as for a catch,
the disagreeing parties sit out of rings for a while ("disputed with <peer>"), nobody
earns credit, and the dispute is kept; a node in dispute with two distinct partners who
disputed with nobody else is marked faulty (and its partners may join rings again). The book
is the auditor's (coordinator.trust.dispute_desk), shared with audits after a job.

A catch is signed evidence against the stage's own receipt for the round (kept with the
gateway's probation catches, ReceiptChecker.keep_catch) and marks the stage faulty; an
outvoted verifier is marked faulty too. Costs: the verifier replays every row the stage
computed for the job on that epoch at each check, and the gateway compares them (a job's
rounds on probation cost O(rounds x rows) of one slice). It does not know tokens or the
probation book; the caller credits the rounds and releases them (coordinator.jobs.release_gate).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import trio

from coordinator.swarm.formation import RingState
from coordinator.swarm.swarm import Swarm
from coordinator.trust import disputes, opinions
from coordinator.trust.audit import Auditor
from coordinator.trust.audit_plan import AuditPlan
from coordinator.trust.opinions import candidates
from coordinator.trust.compare import Finding, agree, compare, logged_frames
from coordinator.trust.receipt_check import JobReceipts, ReceiptChecker
from ring import PeerId
from shard.layers import LayerRange
from shard.transport import TransportError
from shard.verify_parts import upload_cap

log = logging.getLogger("shard.coordinator")

# (job, epoch, stage) whose fetched frames are kept for the next check (a job's are dropped
# when it finishes); past it the oldest are fetched again. A 2k-token prompt's frames on
# SmolLM2 are ~10 MB.
MAX_JOBS_KEPT = 64
FETCH_TIMEOUT_S = 30.0  # for a stage to hand over the frames of one check
MAX_OPINIONS = 3


@dataclass(frozen=True)
class Outcome:
    """One stage's check for one round: passed (True), caught (False), or None when no
    verifier node could recompute it (the round goes out unverified, `detail` says why)."""

    passed: bool | None
    rounds: int  # the stage's rounds compared for the first time (what it earns when passed)
    detail: str
    # Passed with a trusted verifier agreeing (opinions.vouched); False: only newcomers
    # agreed, the round is not credited and `detail` says so.
    vouched: bool = True


def stage_plan(job: JobReceipts, ring: RingState, index: int, upto_round: int, quant: str) -> AuditPlan:
    """The frames of `ring`'s `index`-th stage to check for `job`'s round `upto_round`:
    every round sent on the epoch up to it (in send order), with the stage's receipts."""
    sent, verified = job.rounds_on(ring.epoch, upto_round)
    peer, layers = ring.stages[index]
    a = ring.assignments[index]
    return AuditPlan(job.job_id, ring.epoch, peer, layers, index == len(ring.stages) - 1, a.wire_dtype, a.aux_dtype,
                     tuple(sent), {r: receipts[index] for r, receipts in verified.items()}, quant)


@dataclass
class _Fetched:
    records: dict[int, tuple[bytes, bytes]] = dataclasses.field(default_factory=dict)  # round -> (input, output)
    compared: set[int] = dataclasses.field(default_factory=set)  # rounds with a receipt already held to a replay


class RoundVerifier:
    def __init__(self, swarm: Swarm, auditor: Auditor, checker: ReceiptChecker | None) -> None:
        self.swarm, self.auditor, self.checker = swarm, auditor, checker
        self._fetched: OrderedDict[tuple[str, int, PeerId], _Fetched] = OrderedDict()
        self._verifying: dict[PeerId, LayerRange] = {}  # verifier -> the slice it last recomputed
        self.checks = 0  # stage rounds checked by a verifier node
        self.catches = 0

    def forget(self, job_id: str) -> None:
        """Drop what was fetched for `job_id` (it finished)."""
        for key in [k for k in self._fetched if k[0] == job_id]:
            del self._fetched[key]

    async def check(self, ring: RingState, index: int, upto_round: int, job: JobReceipts,
                    on_probation: Callable[[PeerId], bool]) -> Outcome:
        """Check `ring`'s `index`-th stage's frames of `job` up to round `upto_round` against
        verifier nodes' recomputation. Error handling: a stage that does not hand over its
        frames in FETCH_TIMEOUT_S fails the check (it sits out: it may be only slow); a
        verifier that does not answer is passed over; nothing here raises."""
        peer = ring.stages[index][0]
        member = self.swarm.members.get(peer)
        plan = stage_plan(job, ring, index, upto_round, member.register.quant if member is not None else "none")
        key = (job.job_id, ring.epoch, peer)
        fetched = self._fetched.setdefault(key, _Fetched())
        self._fetched.move_to_end(key)
        while len(self._fetched) > MAX_JOBS_KEPT:
            self._fetched.popitem(last=False)
        missing = tuple(r for r in plan.rounds if r not in fetched.records)
        try:
            with trio.fail_after(FETCH_TIMEOUT_S):
                fetched.records.update(await self.auditor.fetch_all(dataclasses.replace(plan, rounds=missing)))
        except (TransportError, trio.TooSlowError) as exc:
            why = f"on probation: it did not hand over its frames of round {upto_round} to be verified ({type(exc).__name__})"
            self.swarm.report_unreachable(peer, why, "unverified")
            return Outcome(False, 0, f"stage {peer[-6:]} {why}")
        logged = await trio.to_thread.run_sync(logged_frames, plan, fetched.records, self.swarm.control_limits)
        if isinstance(logged, Finding):  # its log does not match its own receipts
            return self._caught(plan, logged, "its receipts")
        cap, size = upload_cap(self.swarm.control_limits), sum(map(len, logged.input_bytes))
        if size > cap:  # as Auditor.ask_verifier refuses it (past one control frame it sends parts: shard.verify_parts)
            return Outcome(None, 0, f"the frames of stage {peer[-6:]} on probation ({size} bytes) are past a verify "
                                    f"request's cap ({cap} bytes)")
        fresh = [r for r in plan.receipts if r not in fetched.compared]
        # Every frame is replayed (the stage's K/V holds them all); only the rounds not yet
        # compared are held to the replay (the gateway's share of the cost stays per round).
        plan = dataclasses.replace(plan, receipts={r: plan.receipts[r] for r in fresh})
        ids, parties, findings, recomputed, trust = [0], [peer], [None], [None], [False]
        excluded = {peer} | set(self.swarm.faulty)
        registers = {p: m.register for p, m in self.swarm.members.items()}
        for verifier in candidates(registers, plan.layers, excluded, on_probation, self._verifying):
            if not opinions.need_another(ids, MAX_OPINIONS):
                break
            expected = await self.auditor.ask_verifier(verifier, plan, logged)
            if expected is None:
                continue
            self._verifying[verifier] = plan.layers
            finding = await trio.to_thread.run_sync(compare, plan, logged, expected)
            opinion = 0 if finding is None else next(
                (i for i in range(1, len(ids)) if ids[i] == i and agree(plan, logged, recomputed[i], expected)), len(ids))
            parties.append(verifier), ids.append(opinion), findings.append(finding), recomputed.append(expected)
            trust.append(not on_probation(verifier))
        if len(ids) == 1:
            return Outcome(None, 0, f"no verifier node could recompute layers [{plan.layers.start}, {plan.layers.end}) "
                                    f"of stage {peer[-6:]} on probation")
        self.checks += 1
        if disputes.lone_word(ids, trust):
            what = f"layers [{plan.layers.start}, {plan.layers.end}) of round {upto_round} of job {job.job_id}"
            return self._disputed(parties, ids, what)
        verdict = opinions.settle_trusted(ids, trust)
        for i in verdict.lying:
            self.swarm.mark_faulty(parties[i], f"verifier outvoted: its recomputation of layers {plan.layers} on "
                                   f"probation round {upto_round} of job {job.job_id} disagreed with the others")
        if not verdict.stage_faulty and not opinions.vouched(ids, trust):  # newcomers agreed: no credit
            return Outcome(True, 0, f"stage {peer[-6:]} on probation was checked only by nodes on probation "
                                    f"({', '.join(p[-6:] for p in parties[1:])}): no trusted node or the gateway could "
                                    f"recompute layers [{plan.layers.start}, {plan.layers.end})", vouched=False)
        if not verdict.stage_faulty:
            fetched.compared.update(fresh)
            return Outcome(True, len(fresh), "")
        found = next(i for i, f in enumerate(findings) if f is not None and i not in verdict.lying)
        return self._caught(plan, findings[found], f"verifier node {parties[found][-6:]}")  # type: ignore[arg-type]

    def _disputed(self, parties: list[PeerId], ids: list[int], what: str) -> Outcome:
        """Newcomers disagree and nothing settles it: the auditor's dispute desk records it
        (they sit out; a liar it names is marked faulty). The round is held back (passed
        False) and earns nothing, unless every verifier that disagreed with the stage was
        just found the liar: then the stage was checked by newcomers alone (passed, not
        vouched), as when they agree."""
        found = self.auditor.disputes.dispute(parties, ids, what)
        dissent = {parties[i] for i in range(1, len(ids)) if ids[i] != ids[0]}
        if parties[0] not in found and dissent <= found:
            return Outcome(True, 0, f"stage {parties[0][-6:]} on probation was checked only by nodes on probation: its "
                                    f"dissenter(s) {', '.join(sorted(p[-6:] for p in dissent))} found lying by their "
                                    f"disputes", vouched=False)
        names = ", ".join(p[-6:] for p in parties)
        return Outcome(False, 0, f"nodes on probation {names} disagree over {what} and no trusted node or majority "
                                 f"settles it: they sit out, disputed")

    def open_disputes(self) -> list[dict]:
        return self.auditor.disputes.open()

    def _caught(self, plan: AuditPlan, finding: Finding, by: str) -> Outcome:
        """Sign evidence against the stage's receipt for the round and mark it faulty."""
        self.catches += 1
        what = (f"round {finding.round} on ring epoch {plan.epoch} differs from the recomputation of {by} "
                f"({finding.check}: {finding.detail})")
        receipt = plan.receipts.get(finding.round) or next(iter(plan.receipts.values()), None)
        if self.checker is not None and receipt is not None:
            self.checker.keep_catch(receipt, finding.recomputed_digest, finding.spot)
        self.swarm.mark_faulty(plan.peer_id, f"on probation: {what}")
        return Outcome(False, 0, f"stage {plan.peer_id[-6:]}'s {what}")
