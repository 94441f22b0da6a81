"""Evidence records: a coordinator's signed account of one spot check of one stage's frame.

A record embeds the stage's own signed receipt (so the stage's claim — key, epoch, job,
round, layers, input and claimed output digests — is proven by the stage's signature), the
digest of the auditor's recomputed output, and the comparison's numbers, all signed by the
coordinator. Anyone can check both signatures offline and re-derive the verdict.
This module does not know how the recomputation was done or what a failed check leads to.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from receipts.digests import DIGEST_BYTES
from receipts.errors import BadSignature, MalformedError, SpotCheckError, UnknownSchemaVersion, WrongCoordinator
from receipts.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeKey, verify_signature
from receipts.receipt import Receipt, decode_receipt, encode_receipt
from receipts.schema import check_bytes, check_float, check_uint, pack_canonical, unpack_canonical
from receipts.spotcheck import SpotCheck, Tolerance

EVIDENCE_VERSION = 1
SUPPORTED_VERSIONS = (EVIDENCE_VERSION,)
EVIDENCE_DOMAIN = b"shard/evidence\x00"
MAX_EVIDENCE_BYTES = 8192
_NUM_FIELDS = 12  # 11 signed fields + the signature


@dataclass(frozen=True)
class EvidenceRecord:
    """The stage's receipt, what the auditor got instead, and how far apart they were."""

    version: int
    receipt: Receipt
    recomputed_digest: bytes
    check: SpotCheck
    coordinator_key: bytes
    signature: bytes

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version not in SUPPORTED_VERSIONS:
            raise UnknownSchemaVersion("evidence", self.version, SUPPORTED_VERSIONS)
        if not isinstance(self.receipt, Receipt) or not isinstance(self.check, SpotCheck):
            raise MalformedError("evidence", "receipt and check must be a Receipt and a SpotCheck")
        check_bytes("evidence.recomputed_digest", self.recomputed_digest, length=DIGEST_BYTES)
        check_bytes("evidence.coordinator_key", self.coordinator_key, length=PUBLIC_KEY_BYTES)
        check_bytes("evidence.signature", self.signature, length=SIGNATURE_BYTES)

    # The stage's claim, read from its signed receipt.
    @property
    def node_key(self) -> bytes:
        return self.receipt.signer

    @property
    def layers(self) -> tuple[int, int]:
        return self.receipt.layers

    @property
    def claimed_output_digest(self) -> bytes:
        return self.receipt.output_digest

    def signed_fields(self) -> list[object]:
        c, t = self.check, self.check.tolerance
        return [
            self.version,
            encode_receipt(self.receipt),
            self.recomputed_digest,
            t.abs_tol,
            t.rel_tol,
            t.max_outlier_fraction,
            c.num_elements,
            c.num_outliers,
            c.max_abs_error,
            c.max_rel_error,
            self.coordinator_key,
        ]

    def signed_message(self) -> bytes:
        return EVIDENCE_DOMAIN + pack_canonical(self.signed_fields())


def sign_evidence(
    key: NodeKey, *, receipt: Receipt | bytes, recomputed_digest: bytes, check: SpotCheck
) -> EvidenceRecord:
    """The coordinator's signed record of spot check `check` on the frame `receipt` covers.

    Error handling: MalformedError if the receipt does not decode or a field is malformed.
    """
    r = receipt if isinstance(receipt, Receipt) else decode_receipt(receipt)
    fields = dict(version=EVIDENCE_VERSION, receipt=r, recomputed_digest=recomputed_digest, check=check,
                  coordinator_key=key.public_bytes())  # fmt: skip
    unsigned = EvidenceRecord(**fields, signature=bytes(SIGNATURE_BYTES))
    return EvidenceRecord(**fields, signature=key.sign(unsigned.signed_message()))


def encode_evidence(record: EvidenceRecord) -> bytes:
    return pack_canonical([*record.signed_fields(), record.signature])


def decode_evidence(data: bytes) -> EvidenceRecord:
    """Parse and strictly validate evidence bytes. Does not check signatures.

    Error handling: raises MalformedError (or UnknownSchemaVersion) and nothing else.
    """
    f = unpack_canonical("evidence", data, max_bytes=MAX_EVIDENCE_BYTES, num_fields=_NUM_FIELDS)
    (version, receipt, recomputed, abs_tol, rel_tol, max_frac, n, n_out, max_abs, max_rel, coord, sig) = f
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise UnknownSchemaVersion("evidence", version, SUPPORTED_VERSIONS)
    num_elements = check_uint("evidence.num_elements", n)
    num_outliers = check_uint("evidence.num_outliers", n_out, limit=num_elements)
    if num_elements == 0:
        raise MalformedError("evidence.num_elements", "a check of no elements proves nothing")
    errors = [check_float(name, v) for name, v in (("evidence.max_abs_error", max_abs), ("evidence.max_rel_error", max_rel))]
    if any(math.isnan(v) or v < 0 for v in errors):
        raise MalformedError("evidence", "errors must be >= 0 (inf allowed, NaN not)")
    try:
        tolerance = Tolerance(
            check_float("evidence.abs_tol", abs_tol),
            check_float("evidence.rel_tol", rel_tol),
            check_float("evidence.max_outlier_fraction", max_frac),
        )
    except SpotCheckError as e:  # a tolerance out of range
        raise MalformedError("evidence.tolerance", str(e)) from e
    check = SpotCheck(tolerance, num_elements, num_outliers, errors[0], errors[1])
    return EvidenceRecord(
        version=version,
        receipt=decode_receipt(check_bytes("evidence.receipt", receipt)),
        recomputed_digest=recomputed,  # type: ignore[arg-type]  # EvidenceRecord validates it
        check=check,
        coordinator_key=coord,  # type: ignore[arg-type]
        signature=sig,  # type: ignore[arg-type]
    )


def verify_evidence(record: EvidenceRecord, *, coordinator_key: bytes | None = None) -> None:
    """Check the coordinator's signature and the embedded receipt's stage signature.

    Error handling: WrongCoordinator if `coordinator_key` is given and differs;
    BadSignature for either signature failing (stage=None for the coordinator's).
    """
    if coordinator_key is not None and record.coordinator_key != coordinator_key:
        raise WrongCoordinator("evidence is signed by another coordinator key than the expected one")
    if not verify_signature(record.coordinator_key, record.signed_message(), record.signature):
        raise BadSignature("coordinator signature over the evidence does not verify")
    if not record.receipt.signature_ok():
        raise BadSignature("the embedded receipt is not signed by the stage it names", layers=record.layers)
