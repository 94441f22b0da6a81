"""An honest ring for receipt tests: deterministic keys, ranges, digests and chains."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from receipts import Assignment, NodeKey, Receipt, sha256_digest, sign_receipt

MANIFEST = sha256_digest(b"manifest of the test model")
NONCE = bytes(range(16))
JOB = "job-1"


def key(i: int) -> NodeKey:
    """A fixed key per index, so failures reproduce."""
    return NodeKey.from_private_bytes(sha256_digest(b"test key %d" % i))


def split(num_layers: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(num_layers, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (i < extra)
        out.append((start, end))
        start = end
    return out


@dataclass
class Ring:
    num_layers: int = 30
    stages: int = 4
    epoch: int = 7
    job_id: str = JOB
    nonce: bytes = NONCE
    manifest_digest: bytes = MANIFEST
    ranges: list[tuple[int, int]] | None = None  # default: an even split
    key_offset: int = 0

    def __post_init__(self) -> None:
        if self.ranges is None:
            self.ranges = split(self.num_layers, self.stages)
        self.stages = len(self.ranges)
        self.keys = [key(self.key_offset + i) for i in range(self.stages)]

    def weights(self, i: int) -> bytes:
        return sha256_digest(b"weights", bytes(self.ranges[i][0]))

    def assignments(self) -> dict[bytes, Assignment]:
        return {k.public_bytes(): Assignment(*self.ranges[i], self.weights(i)) for i, k in enumerate(self.keys)}

    def sent(self, round: int) -> bytes:
        return sha256_digest(b"frame sent to the head", round.to_bytes(8, "little"))

    def run(self, round: int = 0) -> list[Receipt]:
        """Each stage hashes its input to make its output, and signs a receipt."""
        receipts, data = [], self.sent(round)
        for i, k in enumerate(self.keys):
            out = sha256_digest(b"stage output", data)
            receipts.append(
                sign_receipt(
                    k,
                    manifest_digest=self.manifest_digest,
                    weights_digest=self.weights(i),
                    epoch=self.epoch,
                    job_id=self.job_id,
                    round=round,
                    nonce=self.nonce,
                    layer_start=self.ranges[i][0],
                    layer_end=self.ranges[i][1],
                    input_digest=data,
                    output_digest=out,
                )
            )
            data = out
        return receipts

    def received(self, round: int = 0) -> bytes:
        return self.run(round)[-1].output_digest

    def check_kwargs(self, round: int = 0) -> dict:
        """verify_chain's keyword arguments for this ring's round, from the trusted side."""
        return dict(
            manifest_digest=self.manifest_digest,
            num_layers=self.num_layers,
            epoch=self.epoch,
            job_id=self.job_id,
            round=round,
            nonce=self.nonce,
            sent_digest=self.sent(round),
            received_digest=self.received(round),
            assignments=self.assignments(),
        )


def resign(r: Receipt, k: NodeKey, **changes) -> Receipt:
    """`r` with `changes`, validly signed by `k` (an attacker or a confused stage)."""
    fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
    fields.update(changes)
    for drop in ("version", "signer", "signature"):
        fields.pop(drop)
    return sign_receipt(k, **fields)
