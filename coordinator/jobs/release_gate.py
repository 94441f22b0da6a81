"""What a round's result passes before a job commits its tokens: receipts, then probation.

A job receives each Result of a round through `receive_result`, which checks the round's
receipt chain (coordinator.trust.receipt_check) and, where the gateway recomputes the ring
(coordinator.trust.shadow), the shadow's result, before handing it over. A gateway that
cannot recompute has the job await `ReleaseGate.release` for the round whose rows become
tokens (the last of a traversal, or a round sent ahead): every stage of the ring on
probation is checked by verifier nodes (coordinator.trust.round_verifier), concurrently.
Passed: each earns the rounds compared. Caught: nothing is released (JobFailedError; the
job resumes from its committed tokens on a ring without the liar, and the rounds sent
ahead on the unverified ones are discarded with the round). No verifier could answer: the
round goes out unverified, as before, and the engine's `probation_off` says why
(`GET /v1/ring`). It does not turn results into tokens, choose verifiers or rings.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import trio

from coordinator.errors import JobFailedError, KVRefused, RingLost
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
        if engine.shadow is not None or verifier is None or inner is None:
            return  # checked by the shadow already, or by nothing (engine.info says why)
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
        engine.clean_rounds, engine.probation_off = verdict.book, verdict.unverified

    def finish(self, output_ids: list[int]) -> None:
        if self.inner is not None:
            self.inner.finish(output_ids)
        if self.engine.round_verifier is not None and self.inner is not None:
            self.engine.round_verifier.forget(self.inner.job_id)


@dataclass(frozen=True)
class Release:
    """What the checks of one round decide: the probation book after it, why nothing is
    released (None: the round goes out), why it goes out unverified (None: it was verified)."""

    book: probation.Book
    caught: str | None
    unverified: str | None


def judge(outcomes: Mapping[PeerId, Outcome], book: probation.Book) -> Release:
    """Pure. Any stage caught: nothing is released and nobody earns the round (a caught
    round proves nothing of the others). Else each stage that passed earns the rounds it
    had compared; a stage nobody could check earns nothing, and the round goes out."""
    caught = [o.detail for o in outcomes.values() if o.passed is False]
    if caught:
        return Release(book, f"{'; '.join(caught)}; its tokens were not released", None)
    for peer, o in outcomes.items():
        if o.passed:
            book = probation.credit(book, [peer], o.rounds)
    unverified = [o.detail for o in outcomes.values() if o.passed is None]
    return Release(book, None, f"{'; '.join(unverified)}: its rounds go out unverified (audits alone vouch for it)"
                   if unverified else None)


async def receive_result(inbox: trio.MemoryReceiveChannel, port: JobPort, ring: RingState, expected_round: int,
                         gate: ReleaseGate | None) -> Result:
    """The Result of `expected_round` on `ring` from a job's inbox, its receipts (and the
    shadow's check) passed first when `gate` is set. Raises RingLost when the ring changed,
    JobFailedError for a stage's JobError, and what `gate.check` raises (ReceiptRejected
    fails the job closed)."""
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
            note_arrived(msg.result.burst)  # its rows ask the head as one of its burst (head_batch)
            return msg.result
        # a stale result from a discarded round or an old epoch: ignore it
