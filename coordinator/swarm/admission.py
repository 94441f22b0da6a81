"""Whether a node's Register is admitted, and the one line it is told when it is not.

Pure: the registration, whether its identity already has a live control stream, and the
ring's model in; None (admit) or a `Refused` out, whose reason names what to change. So
is the rate rule: how often one address and one key may register (`rate_refusal`);
`RegistrationRate` holds the swarm's history of them on trio's clock.
Knows nothing of streams or the registry (the swarm passes the facts in).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import trio

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


@dataclass(frozen=True)
class RegistrationLimits:
    """How often one address, and one identity key, may register (admitted registrations
    within `window_s`). A key that keeps rejoining keeps its standing anyway (probation is
    per key, coordinator.trust.probation); these bound how fast an address can mint fresh
    keys, each starting a probation the coordinator pays for, and how fast one key can
    churn the ring. Honest churn is far below: a node re-registers on reconnect, with
    backoff. Many volunteers behind one NAT share an address, hence the larger budget."""

    per_address: int = 30
    per_key: int = 10
    window_s: float = 600.0


def recent(times: Sequence[float], now_s: float, window_s: float) -> list[float]:
    return [t for t in times if now_s - t < window_s]


def rate_refusal(address: str | None, key: str, by_address: Mapping[str, Sequence[float]],
                 by_key: Mapping[str, Sequence[float]], now_s: float, limits: RegistrationLimits) -> Refused | None:
    """Why a registration from `address` under `key` at `now_s` is refused for its rate,
    or None. An address the transport could not tell is limited by key alone."""
    for what, name, history, limit in (("address", address, by_address, limits.per_address),
                                       ("identity", key, by_key, limits.per_key)):
        if name is None:
            continue
        times = recent(history.get(name, ()), now_s, limits.window_s)
        if len(times) >= limit:
            wait_s = limits.window_s - (now_s - min(times))
            return Refused(code="rate_limited", reason=(
                f"this {what} ({name}) registered {len(times)} times in the last {limits.window_s:g} s, the limit: "
                f"retry in {wait_s:.0f} s"))
    return None


@dataclass
class RegistrationRate:
    """The swarm's registration history (trio's clock), bounded: entries older than the
    window are dropped when touched, and at most `max_names` names are kept per table."""

    limits: RegistrationLimits = RegistrationLimits()
    max_names: int = 65536
    by_address: dict[str, list[float]] = field(default_factory=dict)
    by_key: dict[str, list[float]] = field(default_factory=dict)

    def admit(self, key: str, address: str | None) -> Refused | None:
        """Refused if over a limit; otherwise None, and the registration is counted."""
        now_s = trio.current_time()
        refused = rate_refusal(address, key, self.by_address, self.by_key, now_s, self.limits)
        if refused is not None:
            return refused
        for table, name in ((self.by_address, address), (self.by_key, key)):
            if name is None:
                continue
            table[name] = [*recent(table.pop(name, ()), now_s, self.limits.window_s), now_s]  # newest last
            while len(table) > self.max_names:
                table.pop(next(iter(table)))  # the name touched longest ago
        return None
