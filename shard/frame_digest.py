"""The bytes a receipt's input and output digests are taken over, defined once.

A frame's *canonical bytes* are its wire bytes up to the trailer
(`shard.wire.codec.encode_body`): every field that says what was computed (ids,
positions, commit, activations in the wire dtype, aux features) and nothing that each
stage appends as the frame travels (receipts, compute_s ride in the trailer). So stage
i's output digest equals stage i+1's input digest even though stage i+1 received the
frame with one more receipt and timing on it, and the chain holds with fp8 on the wire
(the fp8 bytes and their scales are what is hashed). Stages and the coordinator hash the
bytes they actually sent and received (decode_frame gives the prefix length); the
functions here re-derive them from a message, which the deterministic codec makes equal.

Used by the stage's signer, its frame log, the coordinator's chain check and audits. It
does not know keys, receipts or which side of the ring it runs on.
"""

from __future__ import annotations

from receipts import sha256_digest
from shard.wire.codec import encode_body
from shard.wire.messages import Forward, Result


def canonical_frame(msg: Forward | Result) -> bytes:
    """The frame body of `msg` without its trailer (receipts, compute_s). `msg` was
    decoded from the wire or is about to be sent (checked then), so the codec's rules are
    not re-run here: layout, and so the bytes, are the same either way."""
    return encode_body(msg, check=False)


def frame_digest(msg: Forward | Result) -> bytes:
    """SHA-256 (32 bytes) of canonical_frame(msg)."""
    return sha256_digest(canonical_frame(msg))
