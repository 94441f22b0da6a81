"""A job's receipt bundle: every round's receipt chain plus the ring assignments, signed by
the coordinator; its JSON form; and offline verification.

The coordinator's signature covers a domain tag and the canonical msgpack of every field
(the JSON form is only a readable carrier, so its whitespace and key order do not matter).
A job may span ring epochs (heal/resume): each round names its epoch, and its chain is
checked against the assignments recorded for that epoch. The request and output token
digests are bound by the coordinator's signature only; no stage ever saw token ids as such.

This module does not know where bundles are stored (store.py) or how a chain is checked
beyond calling `verify_chain`.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from receipts.chain import Assignment, verify_chain
from receipts.digests import DIGEST_BYTES
from receipts.errors import (
    BadSignature,
    LayerCountMismatch,
    MalformedError,
    Truncated,
    UnknownSchemaVersion,
    VerificationError,
    WrongCoordinator,
    WrongManifest,
)
from receipts.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeKey, verify_signature
from receipts.receipt import MAX_RECEIPT_BYTES
from receipts.schema import MAX_LAYERS, check_bytes, check_job_id, check_layers, check_nonce, check_uint, pack_canonical

BUNDLE_VERSION = 1
SUPPORTED_VERSIONS = (BUNDLE_VERSION,)
BUNDLE_DOMAIN = b"shard/bundle\x00"
MAX_BUNDLE_BYTES = 128 * 2**20  # ~300k receipts; a bundle is read from local disk only


@dataclass(frozen=True)
class StageAssignment:
    """One key's signed assignment in one ring epoch: layers [layer_start, layer_end)."""

    public_key: bytes
    layer_start: int
    layer_end: int
    weights_digest: bytes
    epoch: int

    def __post_init__(self) -> None:
        check_bytes("assignment.public_key", self.public_key, length=PUBLIC_KEY_BYTES)
        check_layers("assignment", self.layer_start, self.layer_end)
        check_bytes("assignment.weights_digest", self.weights_digest, length=DIGEST_BYTES)
        check_uint("assignment.epoch", self.epoch)

    def fields(self) -> list[object]:
        return [self.public_key, self.layer_start, self.layer_end, self.weights_digest, self.epoch]


@dataclass(frozen=True)
class RoundRecord:
    """One frame's chain: what the coordinator sent and received, and the encoded receipts."""

    round: int
    epoch: int
    sent_digest: bytes
    received_digest: bytes
    receipts: tuple[bytes, ...]  # encoded receipts, head first

    def __post_init__(self) -> None:
        check_uint("round.round", self.round)
        check_uint("round.epoch", self.epoch)
        check_bytes("round.sent_digest", self.sent_digest, length=DIGEST_BYTES)
        check_bytes("round.received_digest", self.received_digest, length=DIGEST_BYTES)
        if not isinstance(self.receipts, tuple):
            raise MalformedError("round.receipts", f"expected a tuple, got {type(self.receipts).__name__}")
        for r in self.receipts:
            check_bytes("round.receipts[]", r, min_len=1, max_len=MAX_RECEIPT_BYTES)

    def fields(self) -> list[object]:
        return [self.round, self.epoch, self.sent_digest, self.received_digest, list(self.receipts)]


@dataclass(frozen=True)
class Bundle:
    """Everything needed to check offline that every layer ran for every round of a job."""

    version: int
    job_id: str
    nonce: bytes
    manifest_digest: bytes
    num_layers: int
    request_digest: bytes  # token_digest of the prompt's ids
    output_digest: bytes  # token_digest of the returned ids
    assignments: tuple[StageAssignment, ...]
    rounds: tuple[RoundRecord, ...]
    coordinator_key: bytes
    signature: bytes

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version not in SUPPORTED_VERSIONS:
            raise UnknownSchemaVersion("bundle", self.version, SUPPORTED_VERSIONS)
        check_job_id(self.job_id)
        check_nonce(self.nonce)
        check_bytes("bundle.manifest_digest", self.manifest_digest, length=DIGEST_BYTES)
        check_uint("bundle.num_layers", self.num_layers, limit=MAX_LAYERS)
        check_bytes("bundle.request_digest", self.request_digest, length=DIGEST_BYTES)
        check_bytes("bundle.output_digest", self.output_digest, length=DIGEST_BYTES)
        check_bytes("bundle.coordinator_key", self.coordinator_key, length=PUBLIC_KEY_BYTES)
        check_bytes("bundle.signature", self.signature, length=SIGNATURE_BYTES)
        for name, items, kind in (("assignments", self.assignments, StageAssignment), ("rounds", self.rounds, RoundRecord)):
            if not isinstance(items, tuple) or not all(isinstance(x, kind) for x in items):
                raise MalformedError(f"bundle.{name}", f"expected a tuple of {kind.__name__}")
        keys = [(a.epoch, a.public_key) for a in self.assignments]
        if len(set(keys)) != len(keys):
            raise MalformedError("bundle.assignments", "a key has two assignments in one epoch")
        frames = [(r.epoch, r.round) for r in self.rounds]
        if len(set(frames)) != len(frames):
            raise MalformedError("bundle.rounds", "an (epoch, round) appears twice")

    def signed_message(self) -> bytes:
        """Exactly the bytes the coordinator signs: domain tag + canonical fields."""
        fields = [
            self.version,
            self.job_id,
            self.nonce,
            self.manifest_digest,
            self.num_layers,
            self.request_digest,
            self.output_digest,
            [a.fields() for a in self.assignments],
            [r.fields() for r in self.rounds],
            self.coordinator_key,
        ]
        return BUNDLE_DOMAIN + pack_canonical(fields)

    def assignments_for(self, epoch: int) -> dict[bytes, Assignment]:
        """The `verify_chain` assignments mapping for one epoch."""
        return {
            a.public_key: Assignment(a.layer_start, a.layer_end, a.weights_digest)
            for a in self.assignments
            if a.epoch == epoch
        }


def sign_bundle(
    key: NodeKey,
    *,
    job_id: str,
    nonce: bytes,
    manifest_digest: bytes,
    num_layers: int,
    request_digest: bytes,
    output_digest: bytes,
    assignments: Iterable[StageAssignment],
    rounds: Iterable[RoundRecord],
) -> Bundle:
    """The bundle for a finished job, signed with the coordinator's key.

    Error handling: MalformedError if a field breaks its type or length rule.
    """
    fields = dict(
        version=BUNDLE_VERSION,
        job_id=job_id,
        nonce=nonce,
        manifest_digest=manifest_digest,
        num_layers=num_layers,
        request_digest=request_digest,
        output_digest=output_digest,
        assignments=tuple(assignments),
        rounds=tuple(rounds),
        coordinator_key=key.public_bytes(),
    )
    unsigned = Bundle(**fields, signature=bytes(SIGNATURE_BYTES))
    return Bundle(**fields, signature=key.sign(unsigned.signed_message()))


def bundle_failures(
    bundle: Bundle,
    *,
    num_layers: int,
    manifest_digest: bytes | None = None,
    coordinator_key: bytes | None = None,
) -> list[VerificationError]:
    """Every failure in `bundle`: one bundle-level failure, or the first failure of each round.

    `num_layers` must come from the model manifest. With `manifest_digest` and
    `coordinator_key` given, the bundle must name exactly them. An empty list means it verifies.
    """
    if coordinator_key is not None and bundle.coordinator_key != coordinator_key:
        return [WrongCoordinator("bundle is signed by another coordinator key than the expected one")]
    if not verify_signature(bundle.coordinator_key, bundle.signed_message(), bundle.signature):
        return [BadSignature("coordinator signature over the bundle does not verify")]
    if bundle.num_layers != num_layers:
        return [LayerCountMismatch(f"bundle records {bundle.num_layers} layers, the model manifest {num_layers}")]
    if manifest_digest is not None and bundle.manifest_digest != manifest_digest:
        return [WrongManifest("bundle is for another model manifest")]
    if not bundle.rounds:
        return [Truncated("bundle records no rounds")]
    failures = []
    for record in bundle.rounds:
        try:
            verify_chain(
                record.receipts,
                manifest_digest=bundle.manifest_digest,
                num_layers=num_layers,
                epoch=record.epoch,
                job_id=bundle.job_id,
                round=record.round,
                nonce=bundle.nonce,
                sent_digest=record.sent_digest,
                received_digest=record.received_digest,
                assignments=bundle.assignments_for(record.epoch),
            )
        except VerificationError as e:
            failures.append(e.in_round(record.round))
    return failures


def verify_bundle(
    bundle: Bundle,
    *,
    num_layers: int,
    manifest_digest: bytes | None = None,
    coordinator_key: bytes | None = None,
) -> None:
    """Raise the first of `bundle_failures` (a VerificationError subclass), if any."""
    failures = bundle_failures(bundle, num_layers=num_layers, manifest_digest=manifest_digest, coordinator_key=coordinator_key)
    if failures:
        raise failures[0]


# --- JSON form: hex for keys/digests/signatures, base64 for encoded receipts ---------------

_ASSIGNMENT_KEYS = {"public_key", "layer_start", "layer_end", "weights_digest", "epoch"}
_ROUND_KEYS = {"round", "epoch", "sent_digest", "received_digest", "receipts"}
_BUNDLE_KEYS = {
    "version", "job_id", "nonce", "manifest_digest", "num_layers", "request_digest", "output_digest",
    "assignments", "rounds", "coordinator_key", "signature",
}  # fmt: skip


def bundle_to_json(bundle: Bundle) -> dict[str, object]:
    """The bundle as plain JSON-able data."""
    return {
        "version": bundle.version,
        "job_id": bundle.job_id,
        "nonce": bundle.nonce.hex(),
        "manifest_digest": bundle.manifest_digest.hex(),
        "num_layers": bundle.num_layers,
        "request_digest": bundle.request_digest.hex(),
        "output_digest": bundle.output_digest.hex(),
        "assignments": [
            {
                "public_key": a.public_key.hex(),
                "layer_start": a.layer_start,
                "layer_end": a.layer_end,
                "weights_digest": a.weights_digest.hex(),
                "epoch": a.epoch,
            }
            for a in bundle.assignments
        ],
        "rounds": [
            {
                "round": r.round,
                "epoch": r.epoch,
                "sent_digest": r.sent_digest.hex(),
                "received_digest": r.received_digest.hex(),
                "receipts": [base64.b64encode(x).decode("ascii") for x in r.receipts],
            }
            for r in bundle.rounds
        ],
        "coordinator_key": bundle.coordinator_key.hex(),
        "signature": bundle.signature.hex(),
    }


def encode_bundle(bundle: Bundle) -> bytes:
    """UTF-8 JSON, one key per line at the top level, for humans and `jq`."""
    return (json.dumps(bundle_to_json(bundle), indent=1) + "\n").encode("utf-8")


def decode_bundle(data: bytes) -> Bundle:
    """Parse and strictly validate a bundle's JSON bytes. Does not verify it.

    Error handling: raises MalformedError (UnknownSchemaVersion for an unknown version)
    and nothing else, whatever the bytes.
    """
    if len(data) > MAX_BUNDLE_BYTES:
        raise MalformedError("bundle", f"{len(data)} bytes exceeds the limit of {MAX_BUNDLE_BYTES}")
    try:
        obj = json.loads(data, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MalformedError("bundle", f"not JSON ({e})") from e
    top = _object("bundle", obj, _BUNDLE_KEYS)
    if type(top["version"]) is not int or top["version"] not in SUPPORTED_VERSIONS:
        raise UnknownSchemaVersion("bundle", top["version"], SUPPORTED_VERSIONS)
    return Bundle(
        version=top["version"],
        job_id=top["job_id"],  # type: ignore[arg-type]  # Bundle validates every field
        nonce=_hex("bundle.nonce", top["nonce"]),
        manifest_digest=_hex("bundle.manifest_digest", top["manifest_digest"]),
        num_layers=top["num_layers"],  # type: ignore[arg-type]
        request_digest=_hex("bundle.request_digest", top["request_digest"]),
        output_digest=_hex("bundle.output_digest", top["output_digest"]),
        assignments=tuple(_assignment(a) for a in _list("bundle.assignments", top["assignments"])),
        rounds=tuple(_round(r) for r in _list("bundle.rounds", top["rounds"])),
        coordinator_key=_hex("bundle.coordinator_key", top["coordinator_key"]),
        signature=_hex("bundle.signature", top["signature"]),
    )


def _assignment(obj: object) -> StageAssignment:
    a = _object("assignment", obj, _ASSIGNMENT_KEYS)
    return StageAssignment(
        public_key=_hex("assignment.public_key", a["public_key"]),
        layer_start=a["layer_start"],  # type: ignore[arg-type]
        layer_end=a["layer_end"],  # type: ignore[arg-type]
        weights_digest=_hex("assignment.weights_digest", a["weights_digest"]),
        epoch=a["epoch"],  # type: ignore[arg-type]
    )


def _round(obj: object) -> RoundRecord:
    r = _object("round", obj, _ROUND_KEYS)
    return RoundRecord(
        round=r["round"],  # type: ignore[arg-type]
        epoch=r["epoch"],  # type: ignore[arg-type]
        sent_digest=_hex("round.sent_digest", r["sent_digest"]),
        received_digest=_hex("round.received_digest", r["received_digest"]),
        receipts=tuple(_b64("round.receipts[]", x) for x in _list("round.receipts", r["receipts"])),
    )


_HEX = re.compile(r"[0-9a-f]*")


def _reject_constant(name: str) -> None:
    raise MalformedError("bundle", f"JSON constant {name} is not allowed")


def _object(what: str, obj: object, keys: set[str]) -> Mapping[str, object]:
    if not isinstance(obj, dict):
        raise MalformedError(what, f"expected an object, got {type(obj).__name__}")
    if set(obj) != keys:
        missing, extra = sorted(keys - set(obj)), sorted(set(obj) - keys)
        raise MalformedError(what, f"missing keys {missing}, unknown keys {extra}")
    return obj


def _list(what: str, obj: object) -> Sequence[object]:
    if not isinstance(obj, list):
        raise MalformedError(what, f"expected a list, got {type(obj).__name__}")
    return obj


def _hex(what: str, obj: object) -> bytes:
    if not isinstance(obj, str) or not _HEX.fullmatch(obj) or len(obj) % 2:
        raise MalformedError(what, "expected an even-length lowercase hex string")
    return bytes.fromhex(obj)


def _b64(what: str, obj: object) -> bytes:
    if not isinstance(obj, str):
        raise MalformedError(what, f"expected a base64 string, got {type(obj).__name__}")
    try:
        return base64.b64decode(obj.encode("ascii"), validate=True)
    except (ValueError, binascii.Error) as e:  # UnicodeEncodeError is a ValueError
        raise MalformedError(what, f"not base64 ({e})") from e
