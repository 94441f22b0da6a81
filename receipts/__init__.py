"""Signed receipts proving every layer of a model ran for a request.

Pure: schema, canonical bytes, digests, Ed25519 keys, sign and verify, spot-check
comparison. Knows nothing of networking, torch, rings or HTTP.

    digests.py    SHA-256 of wire bytes and of token ids
    keys.py       NodeKey (Ed25519, the libp2p identity key) and verify_signature
    schema.py     canonical msgpack field lists and the field rules peers must meet
    receipt.py    Receipt: one stage's signed claim for one frame; encode/decode
    chain.py      verify_chain: one round's receipts cover [0, num_layers) in custody order
    bundle.py     Bundle: a job's rounds + assignments signed by the coordinator; JSON form
    store.py      BundleStore: append-only, crash-safe directory of bundles
    spotcheck.py  compare_outputs: claimed vs recomputed floats within a Tolerance
    evidence.py   EvidenceRecord: a signed spot-check result embedding the stage's receipt
    errors.py     ReceiptError tree; VerificationError subclasses name the failed check
    cli.py        shard-receipts verify
"""

from receipts.bundle import (
    Bundle,
    RoundRecord,
    StageAssignment,
    bundle_failures,
    decode_bundle,
    encode_bundle,
    sign_bundle,
    verify_bundle,
)
from receipts.chain import Assignment, verify_chain
from receipts.digests import DIGEST_BYTES, sha256_digest, token_digest
from receipts.errors import *  # noqa: F403  (the exception tree is part of the API)
from receipts.evidence import EvidenceRecord, decode_evidence, encode_evidence, sign_evidence, verify_evidence
from receipts.keys import NodeKey, verify_signature
from receipts.receipt import MAX_RECEIPT_BYTES, Receipt, decode_receipt, encode_receipt, sign_receipt
from receipts.spotcheck import SpotCheck, Tolerance, compare_outputs
from receipts.store import BundleStore
