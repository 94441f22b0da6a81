"""Whether a node takes an Assignment: signed by its coordinator, for this node, for its
model, and forward in epoch. Pure decisions (and the signature check), no I/O.

Epochs only move forward: an assignment older than the one held is a replay. Within the
epoch held, the ring is fixed once formed, so only an off-ring node's role may change
(the coordinator re-sends roles without a new epoch); an identical re-send is
acknowledged and changes nothing. The jobs a stage holds K/V for at once are what the
coordinator asks for, under the volunteer's own ceiling (open_jobs_cap). Does not load
layers, serve frames or talk to anyone.
"""

from __future__ import annotations

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from libp2p.peer.id import ID

from shard.errors import ShardError
from shard.stage_worker import WorkerConfig
from shard.wire.messages import ROLE_STAGE, Assignment

TAKE, ACKNOWLEDGE = "take", "acknowledge"


def public_key_of_peer(peer_id: str) -> bytes:
    """Raw Ed25519 public key embedded in an Ed25519 libp2p peer id."""
    key = ID.from_base58(peer_id).extract_public_key()
    if key is None:
        raise ShardError(f"peer id {peer_id} does not embed its public key")
    return key.to_bytes()


def verify_assignment(a: Assignment, coordinator_peer_id: str) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(public_key_of_peer(coordinator_peer_id)).verify(a.signature, a.signing_bytes())
    except (InvalidSignature, ValueError) as exc:
        raise ShardError(f"assignment for epoch {a.epoch} is not signed by the coordinator {coordinator_peer_id}") from exc


class AssignmentRefused(ShardError):
    """An assignment this node will not take; the message says which rule it broke."""


def decide(a: Assignment, me: str, digest: str, held: Assignment | None) -> str:
    """TAKE (assume it), ACKNOWLEDGE (the one held, re-sent: answer Ready, change nothing),
    or raise AssignmentRefused. `me`: this node's peer id; `digest`: its model's manifest
    digest; `held`: the assignment it last took (None before the first)."""
    if a.peer_id != me:
        raise AssignmentRefused(f"assignment for epoch {a.epoch} names peer {a.peer_id}, not this node {me}")
    if a.manifest_digest != digest:
        raise AssignmentRefused(f"assignment names model digest {a.manifest_digest[:12]}, this node holds {digest[:12]}")
    if held is None or a.epoch > held.epoch:
        return TAKE
    if a.epoch < held.epoch:
        raise AssignmentRefused(f"assignment for epoch {a.epoch} is older than epoch {held.epoch}, which this node "
                                "holds (a replay)")
    if a.signing_bytes() == held.signing_bytes():
        return ACKNOWLEDGE
    if a.role != ROLE_STAGE and held.role != ROLE_STAGE:
        return TAKE  # an off-ring role changed within the epoch
    raise AssignmentRefused(f"assignment for epoch {a.epoch} changes this node's place in an epoch it already "
                            "holds (a ring change takes a new epoch)")


def open_jobs_cap(own: int, assigned: int) -> int:
    """The most jobs a stage holds K/V for at once: the coordinator's `assigned` need
    (Assignment.max_open_jobs, derived from its gateway's concurrency) under `own`, the
    volunteer's --max-open-jobs, a ceiling where set; 0 on either side names none, and
    with neither WorkerConfig's default. The K/V budget (--max-memory-bytes) bounds the
    bytes whatever the count."""
    if own and assigned:
        return min(own, assigned)
    return own or assigned or WorkerConfig.max_open_jobs
