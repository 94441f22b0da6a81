"""What a round's result passes before a job commits its tokens: receipts, then probation.

A job receives each Result of a round through `receive_result`, which checks the round's
receipt chain (coordinator.trust.receipt_check) and, where the gateway recomputes the ring
(coordinator.trust.shadow), the shadow's result, before handing it over. A gateway that
cannot recompute has the job await `ReleaseGate.release` for the round whose rows become
tokens (the last of a traversal, or a round sent ahead): every stage of the ring on
probation is checked by verifier nodes (coordinator.trust.round_verifier), concurrently.
Passed with a trusted verifier agreeing: each earns the rounds compared. Caught: nothing
is released (JobFailedError; the job resumes from its committed tokens on a ring without
the liar, and the rounds sent ahead on the unverified ones are discarded with the round).
No verifier could answer, or only newcomers did (they vouch for nothing): by the operator's
`--unverified-newcomers` policy the round goes out unverified (`serve`, the default; the
engine's `probation_off` says why, `GET /v1/ring` counts such rounds) or is withheld
(`refuse`: UnverifiedNewcomers, a 503 naming the newcomers and what would verify them).
It does not turn results into tokens, choose verifiers or rings.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import trio

from coordinator.errors import JobFailedError, KVRefused, RingLost, UnverifiedNewcomers
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.head_batch import note_arrived
from coordinator.jobs.port import JobPort
from coordinator.swarm.swarm import RingState
from coordinator.trust import probation
from coordinator.trust.receipt_check import JobReceipts
from coordinator.trust.round_verifier import Outcome, RoundVerifier
from ring import PeerId
from shard.wire.messages import Forward, JobError, Result


class Probation(Protocol):
    """The engine's probation state, as the gate reads and credits it (RingEngine)."""

    shadow: object | None  # the gateway's own recomputation (coordinator.trust.shadow); None: off
    round_verifier: RoundVerifier | None
    clean_rounds: probation.Book
    probation: probation.ProbationPolicy
    probation_off: str | None  # why newcomers' rounds go out unverified
    probation_counts: dict[str, int]  # rounds released unverified / withheld, for GET /v1/ring
    config: EngineConfig  # unverified_newcomers: serve | refuse

    def on_probation(self, ring: RingState) -> tuple[PeerId, ...]: ...

    def verify_round(self, ring: RingState, result: Result) -> None: ...


@dataclass
class ReleaseGate:
    """A job's receipt checks (`inner`; None: receipts off) and the engine's probation."""

    inner: JobReceipts | None
    engine: Probation

    def sent(self, fwd: Forward, digest: bytes) -> None:
        if self.inner is not None:
            self.inner.sent(fwd, digest)

    def check(self, ring: RingState, result: Result, received_digest: bytes) -> None:
        """Receipts, then the shadow's recomputation (RingEngine.verify_round), for every Result."""
        if self.inner is not None:
            self.inner.check(ring, result, received_digest)
        self.engine.verify_round(ring, result)

    async def release(self, ring: RingState, result: Result) -> None:
        """Before `result`'s rows become tokens, on a gateway that cannot recompute the ring:
        verifier nodes check every stage on probation. Raises JobFailedError on a catch."""
        engine, inner = self.engine, self.inner
        verifier = engine.round_verifier
        if engine.shadow is not None:
            return  # checked by the shadow already
        if verifier is None or inner is None:  # checked by nothing (engine.probation_off says why)
            newcomers = probation.probation_stages(engine.clean_rounds, [p for p, _ in ring.stages], engine.probation)
            if newcomers and engine.config.unverified_newcomers == "refuse":
                outcomes = {p: Outcome(None, 0, f"no verifier can check stage {p[-6:]} on probation (receipts off)")
                            for p in newcomers}
                self._out(judge(outcomes, engine.clean_rounds))
            return
        suspects = engine.on_probation(ring)
        if not suspects:
            return
        stages = [p for p, _ in ring.stages]
        outcomes = {}

        async def one(peer):
            outcomes[peer] = await verifier.check(ring, stages.index(peer), result.round, inner,
                                                  lambda p: probation.on_probation(engine.clean_rounds, p, engine.probation))

        async with trio.open_nursery() as nursery:
            for peer in suspects:
                nursery.start_soon(one, peer)
        verdict = judge(outcomes, engine.clean_rounds)
        if verdict.caught is not None:
            raise JobFailedError(verdict.caught)
        engine.clean_rounds = verdict.book
        self._out(verdict)

    def _out(self, verdict: Release) -> None:
        """A round with no catch: out (serve), or withheld when nothing trusted checked a
        newcomer and the operator refuses that (UnverifiedNewcomers: 503)."""
        engine = self.engine
        engine.probation_off = verdict.unverified
        if verdict.unverified is None:
            return
        if engine.config.unverified_newcomers == "refuse":
            engine.probation_counts["rounds_refused"] = engine.probation_counts.get("rounds_refused", 0) + 1
            names = ", ".join(p[-6:] for p in verdict.newcomers)
            raise UnverifiedNewcomers(verdict.newcomers, f"{verdict.reasons}; to verify newcomer(s) {names}: give the "
                                      f"gateway the model's layers, or list a node keeping their slice with "
                                      f"--trusted-nodes, or let a node that left probation keep it")
        engine.probation_counts["rounds_unverified"] = engine.probation_counts.get("rounds_unverified", 0) + 1

    async def finish(self, output_ids: list[int]) -> None:
        if self.inner is not None:
            await self.inner.finish(output_ids)
        if self.engine.round_verifier is not None and self.inner is not None:
            self.engine.round_verifier.forget(self.inner.job_id)


@dataclass(frozen=True)
class Release:
    """What the checks of one round decide: the probation book after it, why nothing is
    released (None: the round goes out), why it goes out unverified (None: it was verified)."""

    book: probation.Book
    caught: str | None
    unverified: str | None
    newcomers: tuple[PeerId, ...] = ()  # the stages nothing trusted checked
    reasons: str = ""  # why, one clause per stage


def judge(outcomes: Mapping[PeerId, Outcome], book: probation.Book) -> Release:
    """Pure. Any stage caught: nothing is released and nobody earns the round (a caught
    round proves nothing of the others). Else each stage that passed earns the rounds it
    had compared when a trusted verifier vouched for it; a stage nobody could check, or only
    newcomers did, earns nothing, and the round goes out unverified (or is refused: the
    caller's policy) with the stages and reasons named."""
    caught = [o.detail for o in outcomes.values() if o.passed is False]
    if caught:
        return Release(book, f"{'; '.join(caught)}; its tokens were not released", None)
    for peer, o in outcomes.items():
        if o.passed and o.vouched:
            book = probation.credit(book, [peer], o.rounds)
    lone = {p: o.detail for p, o in outcomes.items() if o.passed is None or not o.vouched}
    reasons = "; ".join(lone.values())
    return Release(book, None, f"{reasons}: its rounds go out unverified (audits alone vouch for it)" if lone else None,
                   tuple(lone), reasons)


async def receive_result(inbox: trio.MemoryReceiveChannel, port: JobPort, ring: RingState, expected_round: int,
                         gate: ReleaseGate | None, skipped: Callable[[tuple[int, ...], str], None] | None = None) -> Result:
    """The Result of `expected_round` on `ring` from a job's inbox, its receipts (and the
    shadow's check) passed first when `gate` is set; `skipped(burst, job_id)` hears of each
    stale Result passed over (the head stops waiting for its ask). Raises RingLost when the
    ring changed, JobFailedError for a stage's JobError, and what `gate.check` raises
    (ReceiptRejected fails the job closed)."""
    epoch = ring.epoch
    while True:
        msg = await inbox.receive()
        if isinstance(msg, RingLost):
            current = port.ring
            if current is not None and current.epoch == epoch:
                continue  # queued before this ring formed (epochs only grow): stale
            raise msg
        if isinstance(msg, JobError):
            if msg.epoch == epoch and msg.code == "CacheFullError":  # no room for its K/V: it waits, then resumes
                raise KVRefused(msg.stage, msg.message)
            if msg.epoch == epoch:
                raise JobFailedError(f"stage {msg.stage} failed: {msg.code}: {msg.message}")
            continue
        if msg.result.epoch == epoch and msg.result.round == expected_round:
            if gate is not None:
                gate.check(ring, msg.result, msg.digest)
            note_arrived(msg.result.burst, msg.result.job_id)  # its rows ask the head as one of its burst (head_batch)
            return msg.result
        if skipped is not None:  # a stale result from a discarded round or an old epoch: ignore it
            skipped(msg.result.burst, msg.result.job_id)
