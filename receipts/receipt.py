"""One stage's signed receipt for one frame: the record, its canonical bytes, sign, decode.

A receipt binds what a stage did (layers [layer_start, layer_end) of the model whose
manifest digest it names, with the weights it holds) to one frame of one job (epoch, job,
round, the coordinator's nonce) and to the exact bytes it read and wrote (SHA-256 of the
wire bytes). It is signed with the stage's Ed25519 node key over a domain tag followed by
the canonical field list, so a receipt signature can never be mistaken for any other
signature made with the same (libp2p identity) key.

This module does not know rings, assignments or what a valid chain is (see chain.py),
nor how frames carry the encoded bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from receipts.digests import DIGEST_BYTES
from receipts.errors import MalformedError, UnknownSchemaVersion
from receipts.keys import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeKey, verify_signature
from receipts.schema import (
    check_bytes,
    check_job_id,
    check_layers,
    check_nonce,
    check_uint,
    pack_canonical,
    unpack_canonical,
)

RECEIPT_VERSION = 1
SUPPORTED_VERSIONS = (RECEIPT_VERSION,)
MAX_RECEIPT_BYTES = 4096  # the wire reserves this much per receipt; ours are ~450 bytes
RECEIPT_DOMAIN = b"shard/receipt\x00"
_NUM_FIELDS = 13  # 12 signed fields + the signature


@dataclass(frozen=True)
class Receipt:
    """A signed receipt. Constructing one validates every field's type and length.

    Digests are raw 32-byte SHA-256 values; keys are raw 32-byte Ed25519 public keys.
    """

    version: int
    manifest_digest: bytes
    weights_digest: bytes
    epoch: int
    job_id: str
    round: int
    nonce: bytes
    layer_start: int
    layer_end: int
    input_digest: bytes
    output_digest: bytes
    signer: bytes
    signature: bytes

    def __post_init__(self) -> None:
        if type(self.version) is not int or self.version not in SUPPORTED_VERSIONS:
            raise UnknownSchemaVersion("receipt", self.version, SUPPORTED_VERSIONS)
        check_bytes("receipt.manifest_digest", self.manifest_digest, length=DIGEST_BYTES)
        check_bytes("receipt.weights_digest", self.weights_digest, length=DIGEST_BYTES)
        check_uint("receipt.epoch", self.epoch)
        check_job_id(self.job_id)
        check_uint("receipt.round", self.round)
        check_nonce(self.nonce)
        check_layers("receipt", self.layer_start, self.layer_end)
        check_bytes("receipt.input_digest", self.input_digest, length=DIGEST_BYTES)
        check_bytes("receipt.output_digest", self.output_digest, length=DIGEST_BYTES)
        check_bytes("receipt.signer", self.signer, length=PUBLIC_KEY_BYTES)
        check_bytes("receipt.signature", self.signature, length=SIGNATURE_BYTES)

    @property
    def layers(self) -> tuple[int, int]:
        """The half-open range [layer_start, layer_end)."""
        return (self.layer_start, self.layer_end)

    def signed_fields(self) -> list[object]:
        """The fields the signature covers, in their fixed order (the signature excluded)."""
        return [
            self.version,
            self.manifest_digest,
            self.weights_digest,
            self.epoch,
            self.job_id,
            self.round,
            self.nonce,
            self.layer_start,
            self.layer_end,
            self.input_digest,
            self.output_digest,
            self.signer,
        ]

    def signed_message(self) -> bytes:
        """Exactly the bytes the signer signed: domain tag + canonical signed fields."""
        return RECEIPT_DOMAIN + pack_canonical(self.signed_fields())

    def signature_ok(self) -> bool:
        """True iff `signature` is `signer`'s signature over `signed_message()`."""
        return verify_signature(self.signer, self.signed_message(), self.signature)


def sign_receipt(
    key: NodeKey,
    *,
    manifest_digest: bytes,
    weights_digest: bytes,
    epoch: int,
    job_id: str,
    round: int,
    nonce: bytes,
    layer_start: int,
    layer_end: int,
    input_digest: bytes,
    output_digest: bytes,
) -> Receipt:
    """The receipt `key`'s holder signs after computing layers [layer_start, layer_end).

    Error handling: MalformedError if any field breaks its type or length rule.
    """
    fields = dict(
        version=RECEIPT_VERSION,
        manifest_digest=manifest_digest,
        weights_digest=weights_digest,
        epoch=epoch,
        job_id=job_id,
        round=round,
        nonce=nonce,
        layer_start=layer_start,
        layer_end=layer_end,
        input_digest=input_digest,
        output_digest=output_digest,
        signer=key.public_bytes(),
    )
    unsigned = Receipt(**fields, signature=bytes(SIGNATURE_BYTES))  # validates the fields
    return Receipt(**fields, signature=key.sign(unsigned.signed_message()))


def encode_receipt(receipt: Receipt) -> bytes:
    """The receipt's canonical bytes (signed fields then signature), <= MAX_RECEIPT_BYTES."""
    return pack_canonical([*receipt.signed_fields(), receipt.signature])


def decode_receipt(data: bytes) -> Receipt:
    """Parse and strictly validate receipt bytes from a peer. Does not check the signature.

    Error handling: raises MalformedError (UnknownSchemaVersion for a version this code
    does not implement) and nothing else, whatever the bytes.
    """
    fields = unpack_canonical("receipt", data, max_bytes=MAX_RECEIPT_BYTES, num_fields=_NUM_FIELDS)
    version = fields[0]
    if type(version) is not int or version not in SUPPORTED_VERSIONS:
        raise UnknownSchemaVersion("receipt", version, SUPPORTED_VERSIONS)
    # The wire order is the dataclass field order; Receipt() validates each field's type.
    return Receipt(*fields)  # type: ignore[arg-type]
