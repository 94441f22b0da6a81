"""Whether a node's Register is admitted, and the one line it is told when it is not.

Pure: the registration, whether its identity already has a live control stream, and the
ring's model in; None (admit) or a `Refused` out, whose reason names what to change.
Knows nothing of streams or the registry (the swarm passes the facts in).
"""

from __future__ import annotations

from shard.wire.messages import Refused, Register


def refusal(msg: Register, *, identity_in_use: bool, model_name: str, model_digest: str) -> Refused | None:
    """Why `msg` is refused, or None. A model whose manifest digest differs is named with
    both digests and the --model the ring serves; an identity that another running node
    already registered is refused rather than displacing it (two nodes sharing one key
    would otherwise take turns receiving each other's frames)."""
    if msg.manifest_digest != model_digest:
        return Refused(code="model_mismatch", reason=(
            f"this node holds model {msg.model!r} with digest {msg.manifest_digest}, but the ring serves "
            f"{model_name!r} with digest {model_digest}: rejoin with --model {model_name}"))
    if identity_in_use:
        return Refused(code="duplicate_identity", reason=(
            f"peer id {msg.peer_id} is already registered by another running node: two nodes share one "
            "identity key file; give each node its own --key-path (without --key-path each gets its own)"))
    return None
