"""The coordinator's side of receipts: check every round's chain, then bundle the job.

Per job (`JobReceipts`): the digest of each Forward the coordinator sent the head is
recorded by round; each Result from the tail is checked with `receipts.verify_chain`
before its hidden states become tokens (fail closed: `ReceiptRejected`, an CoordinatorError
the HTTP layer turns into a clear 503, never caught by the resume loop). At the end the
verified rounds, the assignments of every epoch the job used and the request/output token
digests are signed into a `Bundle` (in a worker thread, off the rounds' path), kept in
memory (`recent` most recent) and appended to a BundleStore when a directory is configured.
Finished jobs leave on a channel (to the auditor), naming the source job whose K/V their
first frame started from if they forked (an audit replays the source's frames first:
coordinator.trust.prefix_audit). A round
that probation (coordinator.trust.shadow) caught is signed here as evidence against the
blamed stage's own receipt (`sign_catch`), as an audit's catch is.
The layer count and digests come from the coordinator's own model store; the
expected signers from the epoch's signed assignments (peer id -> Ed25519 key).

It does not send frames, choose rings, or recompute anything (coordinator.trust.audit does).
"""

from __future__ import annotations

import json
import logging
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from coordinator.errors import ReceiptRejected
from coordinator.swarm.swarm import RingState
from receipts import (
    Assignment,
    BundleStore,
    EvidenceRecord,
    MalformedError,
    NodeKey,
    Receipt,
    RoundRecord,
    StageAssignment,
    SpotCheck,
    StoreError,
    VerificationError,
    decode_receipt,
    sign_bundle,
    sign_evidence,
    token_digest,
    verify_chain,
)
from receipts.bundle import bundle_to_json
from ring import PeerId
from shard.assignment_rules import public_key_of_peer
from shard.layers import LayerRange
from shard.options import option
from shard.store import ModelStore
from shard.wire.messages import Forward, Result

log = logging.getLogger("shard.coordinator")


@dataclass(frozen=True)
class ReceiptConfig:
    enabled: bool = True  # check every round's receipts and bundle every job
    receipts_dir: str | None = option(None, "append every job's signed receipt bundle here (default: memory only)")
    recent_bundles: int = 1024  # bundles kept in memory for GET /v1/receipts/{id}, at most
    # ... and their bytes (compact JSON, zlib-compressed), at most. A bundle carries three
    # signed receipts a round: a 160-round job's (the receipt tests' 3-stage ring) is 220 KB
    # of compact JSON, 86 KB compressed (signatures and digests do not compress). Kept as JSON
    # dicts, 1000 such bundles held 543 MB of the gateway's RSS (issue 21); 16 MB keeps ~190
    # of them, or the 1024 newest of 10-40 rounds, and is all a gateway's RSS grows by for them.
    recent_bundles_mb: int = option(16, "memory for recent jobs' receipt bundles served by GET /v1/receipts/{id}, "
                                        "compressed (older ones only from --receipts-dir)")
    recent_evidence: int = 256  # probation catches' evidence records kept in memory

    def __post_init__(self) -> None:
        if self.recent_bundles_mb < 0:
            raise ValueError(f"recent bundles must be >= 0 MB (0: only the newest), got {self.recent_bundles_mb}")



@dataclass(frozen=True)
class EpochView:
    """One ring epoch as receipts see it: signer keys -> what each was assigned."""

    ring: RingState
    assignments: dict[bytes, Assignment]
    stage_assignments: tuple[StageAssignment, ...]
    peer_of_key: dict[bytes, PeerId]


@dataclass
class VerifiedRound:
    epoch: int
    receipts: list[Receipt]  # decoded, head first


@dataclass
class FinishedJob:
    """What the auditor needs: the rounds sent per epoch (in send order) and each
    verified round's receipts, plus the epochs' rings, and where the job forked."""

    job_id: str
    sent_rounds: dict[int, list[int]]  # epoch -> rounds sent on it, in order
    verified: dict[int, VerifiedRound]  # round -> receipts
    epochs: dict[int, EpochView]
    finished_s: float = field(default_factory=time.monotonic)  # when the job finished (monotonic clock)
    # (epoch, source job id, prefix length): the job's first frame on that epoch started from
    # the source's K/V slots [0, length) on each stage (docs/receipts.md, forked jobs); None: never
    prefix: tuple[int, str, int] | None = None


def packed(bundle_json: dict) -> bytes:
    """A bundle's JSON as kept in memory: compact, zlib's fastest level (~3 ms for a
    192-round job's on the dev VM)."""
    return zlib.compress(json.dumps(bundle_json, separators=(",", ":")).encode(), 1)


class ReceiptChecker:
    def __init__(self, store: ModelStore, coordinator_seed: bytes, config: ReceiptConfig = ReceiptConfig(), *,
                 finished: trio.MemorySendChannel[FinishedJob] | None = None,
                 unaudited: Callable[[FinishedJob], None] | None = None) -> None:
        """`finished` gets every job that finishes with a bundle (the auditor reads it); a
        full or closed channel drops the job from auditing, never blocks. None: nobody.
        `unaudited` gets every finished job that no audit will cover (a full or closed
        channel, failed receipts), so its stages drop its frames (FrameReleaser.release_job)."""
        self.config = config
        self._finished, self._unaudited = finished, unaudited
        self.key = NodeKey.from_private_bytes(coordinator_seed)
        self.store = store
        self.manifest_digest = bytes.fromhex(store.digest)
        self.num_layers = store.num_layers  # from the manifest, never from receipts
        self.bundle_store = BundleStore(config.receipts_dir) if config.receipts_dir else None
        self._epochs: dict[int, EpochView] = {}
        self._recent: OrderedDict[str, bytes] = OrderedDict()  # job id -> its bundle as compressed compact JSON
        self._recent_bytes = 0
        self.evidence: list[EvidenceRecord] = []  # probation catches (sign_catch), newest last

    def sign_catch(self, result: Result, peer: PeerId, recomputed_digest: bytes | None,
                   check: SpotCheck) -> EvidenceRecord | None:
        """Sign evidence that `peer`'s output for `result`'s round failed `check` against
        this coordinator's recomputation (`recomputed_digest`: of what `peer` should have
        sent), embedding `peer`'s own receipt for the round from `result`; kept in
        `evidence`. None when `result` carries no such receipt (none is accepted unchecked)."""
        key = public_key_of_peer(peer)
        for raw in result.receipts:
            try:
                receipt = decode_receipt(raw)
            except MalformedError:
                continue
            if receipt.signer == key and receipt.job_id == result.job_id and receipt.round == result.round:
                return self.keep_catch(receipt, recomputed_digest, check)
        return None

    def keep_catch(self, receipt: Receipt, recomputed_digest: bytes | None, check: SpotCheck) -> EvidenceRecord:
        """Sign evidence that the stage's output under `receipt` failed `check` against a
        recomputation (`recomputed_digest`: of what it should have sent); kept in `evidence`."""
        record = sign_evidence(self.key, receipt=receipt, recomputed_digest=recomputed_digest or bytes(32), check=check)
        self.evidence = [*self.evidence, record][-self.config.recent_evidence:]
        return record

    def epoch_view(self, ring: RingState) -> EpochView:
        view = self._epochs.get(ring.epoch)
        if view is None:
            assignments, stage_assignments, peers = {}, [], {}
            for a in ring.assignments:
                key = public_key_of_peer(a.peer_id)
                weights = bytes.fromhex(self.store.weights_digest(LayerRange(a.layer_start, a.layer_end)))
                assignments[key] = Assignment(a.layer_start, a.layer_end, weights)
                stage_assignments.append(StageAssignment(key, a.layer_start, a.layer_end, weights, ring.epoch))
                peers[key] = PeerId(a.peer_id)
            view = self._epochs[ring.epoch] = EpochView(ring, assignments, tuple(stage_assignments), peers)
            for old in sorted(self._epochs)[:-64]:  # jobs span a few epochs at most
                del self._epochs[old]
        return view

    def open_job(self, job_id: str, nonce: bytes, prompt_ids: list[int]) -> "JobReceipts":
        return JobReceipts(self, job_id, nonce, list(prompt_ids))

    def bundle(self, job_id: str) -> dict | None:
        """The job's bundle as JSON (memory first, then the store), None if unknown."""
        kept = self._recent.get(job_id)
        if kept is not None:
            return json.loads(zlib.decompress(kept))
        if self.bundle_store is not None and job_id in self.bundle_store:
            return bundle_to_json(self.bundle_store.get(job_id))
        return None

    def _keep(self, job_id: str, text: bytes) -> None:
        """Keep the newest bundle (`text`: `packed`); drop the oldest past
        recent_bundles or recent_bundles_mb (counted compressed)."""
        if (old := self._recent.pop(job_id, None)) is not None:
            self._recent_bytes -= len(old)
        self._recent[job_id] = text
        self._recent_bytes += len(text)
        cfg = self.config
        while len(self._recent) > 1 and (len(self._recent) > cfg.recent_bundles
                                         or self._recent_bytes > cfg.recent_bundles_mb << 20):
            self._recent_bytes -= len(self._recent.popitem(last=False)[1])


@dataclass
class JobReceipts:
    checker: ReceiptChecker
    job_id: str
    nonce: bytes
    prompt_ids: list[int]
    _sent: dict[int, tuple[int, bytes]] = field(default_factory=dict)  # round -> (epoch, digest)
    _order: dict[int, list[int]] = field(default_factory=dict)  # epoch -> rounds sent
    _rounds: dict[int, RoundRecord] = field(default_factory=dict)
    _verified: dict[int, VerifiedRound] = field(default_factory=dict)
    _epochs: dict[int, EpochView] = field(default_factory=dict)
    _prefix: tuple[int, str, int] | None = None  # (epoch, source job, length) of the frame that forked
    failed: bool = False

    def sent(self, fwd: Forward, digest: bytes) -> None:
        """Record a frame the coordinator sent to the head: `digest`, the SHA-256 of the
        canonical bytes it put on the wire; and the source it names, if it forks the job."""
        self._sent[fwd.round] = (fwd.epoch, digest)
        self._order.setdefault(fwd.epoch, []).append(fwd.round)
        if fwd.prefix_job is not None:
            self._prefix = (fwd.epoch, fwd.prefix_job, fwd.prefix_len)

    def check(self, ring: RingState, result: Result, received_digest: bytes) -> None:
        """Verify the chain behind `result`, whose canonical bytes as received hash to
        `received_digest`. Raises ReceiptRejected (and marks the job failed) on any
        failure; returns only if every layer is accounted for."""
        view = self.checker.epoch_view(ring)
        self._epochs[ring.epoch] = view
        epoch, sent_digest = self._sent.get(result.round, (result.epoch, bytes(32)))
        received = received_digest
        try:
            if epoch != result.epoch:
                raise VerificationError(f"result for epoch {result.epoch}, round {result.round} was sent on epoch {epoch}")
            decoded = verify_chain(
                result.receipts, manifest_digest=self.checker.manifest_digest, num_layers=self.checker.num_layers,
                epoch=ring.epoch, job_id=self.job_id, round=result.round, nonce=self.nonce,
                sent_digest=sent_digest, received_digest=received, assignments=view.assignments)
        except VerificationError as exc:
            self.failed = True
            # The receipt under blame names its layers; its index in a short chain need
            # not be the stage's place in the ring.
            peer = next((p for p, r in ring.stages if exc.layers == (r.start, r.end)), None)
            raise ReceiptRejected(self.job_id, result.round, exc, peer) from exc
        self._rounds[result.round] = RoundRecord(result.round, ring.epoch, sent_digest, received, tuple(result.receipts))
        self._verified[result.round] = VerifiedRound(ring.epoch, decoded)

    def rounds_on(self, epoch: int, upto_round: int) -> tuple[list[int], dict[int, list[Receipt]]]:
        """The rounds sent on `epoch` up to `upto_round` (in send order), and the receipts
        (head first) of those verified on it."""
        sent = self._order.get(epoch, [])
        sent = sent[:sent.index(upto_round) + 1] if upto_round in sent else list(sent)
        return sent, {r: self._verified[r].receipts for r in sent
                      if r in self._verified and self._verified[r].epoch == epoch}

    async def finish(self, output_ids: list[int]) -> None:
        """Sign and keep the bundle of the verified rounds; hand the job to the auditor.
        A job whose receipts failed gets no bundle: nothing of it is vouched for. The bundle
        is signed, compressed and stored (fsync'd under --receipts-dir) in a worker thread:
        ~4 ms for a 192-round job on the dev VM, plus the store's writes, which on the
        gateway's trio thread held every other job's rounds at each job's end (issue 21)."""
        checker = self.checker
        done = FinishedJob(self.job_id, {e: list(rs) for e, rs in self._order.items()}, dict(self._verified),
                           dict(self._epochs), prefix=self._prefix)
        if self.failed or not self._rounds:
            if checker._unaudited is not None:
                checker._unaudited(done)
            return
        epochs = sorted({r.epoch for r in self._rounds.values()})
        assignments = [a for e in epochs for a in self._epochs[e].stage_assignments]
        rounds = [self._rounds[r] for r in sorted(self._rounds)]
        text = await trio.to_thread.run_sync(self._sealed, output_ids, assignments, rounds)
        checker._keep(self.job_id, text)
        try:
            if checker._finished is not None:
                checker._finished.send_nowait(done)
                return
        except trio.WouldBlock:
            log.warning("audit queue full: job %s is not audited", self.job_id)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            log.info("job %s is not audited: nobody audits any more", self.job_id)
        if checker._unaudited is not None:
            checker._unaudited(done)

    def _sealed(self, output_ids: list[int], assignments: list[StageAssignment], rounds: list[RoundRecord]) -> bytes:
        """The job's signed bundle as compressed compact JSON (zlib's fastest level), appended
        to the store too when there is one (a store that refuses is logged: the bundle stays
        in memory and the job is audited all the same). Touches no shared state (a worker
        thread's)."""
        checker = self.checker
        bundle = sign_bundle(
            checker.key, job_id=self.job_id, nonce=self.nonce, manifest_digest=checker.manifest_digest,
            num_layers=checker.num_layers, request_digest=token_digest(self.prompt_ids),
            output_digest=token_digest(output_ids), assignments=assignments, rounds=rounds)
        if checker.bundle_store is not None:
            try:
                checker.bundle_store.append(bundle)
            except StoreError as exc:
                log.warning("job %s's receipt bundle not stored: %s", self.job_id, exc)
        return packed(bundle_to_json(bundle))
