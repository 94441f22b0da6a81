"""Verify one round's receipt chain: every layer ran, in order, by the assigned stages.

`verify_chain` is what the coordinator calls before it returns a round's tokens (fail
closed). The layer count and the assignments come from the caller (the model manifest and
the signed ring assignment), never from the receipts under test.

Checks run per receipt in ring order, and the first failure raises. The order is chosen so
each attack is reported by the check that names it: the signature first (any edit of a
signed field), then the frame binding (manifest, epoch, job, round, nonce: replays), then
the signer's assignment (a key claiming a range it was not given), then duplicates, then
layer coverage (out of range, order, gap, overlap), then the chain of custody of the bytes.
After the last receipt: coverage reaches num_layers (else Truncated) and the tail's output
is what the coordinator received.

This module does not know how receipts travel, how rings are chosen, or what a job is
beyond its id and nonce.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

from receipts.errors import (
    BadSignature,
    ChainBroken,
    CoverageGap,
    CoverageOverlap,
    DuplicateReceipt,
    LayerOutOfRange,
    MalformedError,
    MalformedReceipt,
    OutOfOrder,
    Replayed,
    StaleReceipt,
    Truncated,
    WrongManifest,
    WrongSigner,
    WrongWeights,
)
from receipts.receipt import Receipt, decode_receipt


class Assignment(NamedTuple):
    """What the ring assignment gave one key: layers [layer_start, layer_end) and weights."""

    layer_start: int
    layer_end: int
    weights_digest: bytes


def _short(key: bytes) -> str:
    return key.hex()[:16] + "…"


def verify_chain(
    receipts: Sequence[Receipt | bytes],
    *,
    manifest_digest: bytes,
    num_layers: int,
    epoch: int,
    job_id: str,
    round: int,
    nonce: bytes,
    sent_digest: bytes,
    received_digest: bytes,
    assignments: Mapping[bytes, Assignment | tuple[int, int, bytes]],
) -> list[Receipt]:
    """Check one round's receipts, head first; return them decoded if all is well.

    `sent_digest` is the SHA-256 of the bytes the coordinator sent the head and
    `received_digest` of those it got back from the tail. `assignments` maps each stage's
    raw Ed25519 public key to (layer_start, layer_end, weights_digest).

    Error handling: raises the VerificationError subclass of the first failed check, with
    `stage` (index in `receipts`) and `layers` set; never returns on failure.
    """
    if type(num_layers) is not int or num_layers <= 0:
        raise ValueError(f"num_layers must be a positive int from the model manifest, got {num_layers!r}")
    decoded = [_decode(i, r) for i, r in enumerate(receipts)]
    if not decoded:
        raise Truncated("no receipts at all for this round", layers=(0, num_layers))
    seen: set[bytes] = set()
    expected_start = 0  # every layer below this is covered exactly once so far
    previous_output = sent_digest
    for i, r in enumerate(decoded):
        where = dict(stage=i, layers=r.layers)
        if not r.signature_ok():
            raise BadSignature(f"signature does not verify under its signer key {_short(r.signer)}", **where)
        if r.manifest_digest != manifest_digest:
            raise WrongManifest(f"receipt is for manifest {_short(r.manifest_digest)}, not this model's", **where)
        if r.job_id != job_id:
            raise Replayed(f"receipt is for job {r.job_id!r}, not {job_id!r}", **where)
        if r.nonce != nonce:
            raise Replayed("receipt carries another nonce than this job's", **where)
        if r.epoch != epoch:
            raise StaleReceipt(f"receipt is from ring epoch {r.epoch}, not {epoch}", **where)
        if r.round != round:
            raise Replayed(f"receipt is for round {r.round}, not {round}", **where)
        _check_assignment(r, assignments.get(r.signer), where)
        if r.signer in seen:
            raise DuplicateReceipt(f"signer {_short(r.signer)} already has a receipt in this chain", **where)
        seen.add(r.signer)
        if r.layer_end > num_layers:
            raise LayerOutOfRange(f"the model has layers [0, {num_layers}) only", **where)
        if r.layer_start != expected_start:
            if any(later.layer_start == expected_start for later in decoded[i + 1 :]):
                raise OutOfOrder(f"expected the stage starting at layer {expected_start} here", **where)
            if r.layer_start > expected_start:
                raise CoverageGap(f"layers [{expected_start}, {r.layer_start}) were computed by nobody", **where)
            raise CoverageOverlap(f"layers [{r.layer_start}, {expected_start}) were already covered", **where)
        if r.input_digest != previous_output:
            source = "what the coordinator sent the head" if i == 0 else f"stage {i - 1}'s output"
            raise ChainBroken(f"input digest is not {source}", **where)
        expected_start, previous_output = r.layer_end, r.output_digest
    last = decoded[-1]
    if expected_start != num_layers:
        raise Truncated(
            f"chain ends at layer {expected_start}; layers [{expected_start}, {num_layers}) have no receipt",
            stage=len(decoded),
            layers=(expected_start, num_layers),
        )
    if last.output_digest != received_digest:
        raise ChainBroken(
            "tail's output digest is not what the coordinator received", stage=len(decoded) - 1, layers=last.layers
        )
    return decoded


def _decode(index: int, item: Receipt | bytes) -> Receipt:
    if isinstance(item, Receipt):
        return item
    try:
        return decode_receipt(item)
    except MalformedError as e:
        raise MalformedReceipt(str(e), stage=index) from e


def _check_assignment(r: Receipt, assigned: Assignment | tuple[int, int, bytes] | None, where: dict) -> None:
    if assigned is None:
        raise WrongSigner(f"signer {_short(r.signer)} has no assignment in this ring", **where)
    start, end, weights_digest = assigned
    if (r.layer_start, r.layer_end) != (start, end):
        raise WrongSigner(f"signer {_short(r.signer)} was assigned layers [{start}, {end})", **where)
    if r.weights_digest != weights_digest:
        raise WrongWeights(f"signer {_short(r.signer)} claims weights other than its assignment's", **where)
