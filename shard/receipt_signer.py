"""The stage's ReceiptSigner: one signed receipt per processed frame, with its node key.

Binds the frame's identity (epoch, job, round, the coordinator's per-job nonce), what the
stage holds (manifest digest, the digest of its slice's weights, its layer range) and the
SHA-256 of the canonical bytes it received and sent (shard.wire.codec: the wire bytes
before the trailer, handed over as they are, never re-encoded). The same canonical bytes
go to the frame log so audits can later check them against the receipt.
It does not decide whether receipts are wanted, nor talk to anyone.
"""

from __future__ import annotations

from receipts import NodeKey, encode_receipt, sha256_digest, sign_receipt
from shard.frame_log import FrameLog
from shard.stage_worker import ReceiptSigner
from shard.store import ModelStore
from shard.layers import LayerRange
from shard.wire.messages import Assignment, Forward


def make_signer(seed: bytes, store: ModelStore, assignment: Assignment, frame_log: FrameLog | None = None) -> ReceiptSigner:
    """A signer for `assignment`'s slice. `seed`: the 32-byte Ed25519 identity seed (the
    libp2p host key, shard.identity.identity_signing_key), so signer == peer id."""
    key = NodeKey.from_private_bytes(seed)
    r = LayerRange(assignment.layer_start, assignment.layer_end)
    manifest_digest = bytes.fromhex(store.digest)
    weights_digest = bytes.fromhex(store.weights_digest(r))

    def sign(received: Forward, input_frame: bytes | memoryview, output_frame: bytes) -> bytes:
        """`input_frame`, `output_frame`: the canonical bytes received and about to be sent."""
        input_digest, output_digest = sha256_digest(input_frame), sha256_digest(output_frame)
        if frame_log is not None:
            frame_log.record(received.job_id, received.epoch, received.round, bytes(input_frame), output_frame)
        return encode_receipt(sign_receipt(
            key, manifest_digest=manifest_digest, weights_digest=weights_digest, epoch=received.epoch,
            job_id=received.job_id, round=received.round, nonce=received.nonce,
            layer_start=r.start, layer_end=r.end, input_digest=input_digest, output_digest=output_digest,
        ))

    return sign
