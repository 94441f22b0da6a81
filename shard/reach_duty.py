"""A node's part in reaching peers across NATs, as its signed Assignment says.

- `relay_for` (the relay role, or a stage with upload to spare): relay for those hosts
  behind NATs (shard.relay's hop service, under its limits), accepting their reservations only.
- `relay_addrs`: a node nobody can dial reserves a slot on the relay-role node named there,
  and its predecessor is told to reach it through that node first. The relay gets its own
  assignment in the same formation, sent right after the stages', so the reservation is
  retried for `RESERVE_WITHIN_S`; a relay that never grants one leaves the node reachable
  as before, through the coordinator's relay (its registered circuit address).
- Dialling a successor at the first of its listed addresses that answers, and the HopPath
  a sender reports for its ring stream (the path, and the relay it crosses).
Knows nothing of stages, frames or how the coordinator chose the relay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio

from shard.errors import TransportError
from shard.transport import FramedStream, Host
from shard.wire.messages import Assignment, HopPath
from shard.wire.roles import ROLE_RELAY

log = logging.getLogger("shard.node")

# Long enough for the relay to take its role (sent a moment after the stages' assignments,
# it needs no weights), short enough that a relay gone meanwhile delays Ready little.
RESERVE_WITHIN_S = 10.0
RESERVE_RETRY_S = 0.25


async def take_duty(host: Host, a: Assignment, reserve_within_s: float = RESERVE_WITHIN_S) -> None:
    """What `a` asks of this host's reachability: relay for `a.relay_for`, and reserve on the
    first of `a.relay_addrs` that grants a slot. Error handling: never raises for a relay
    that cannot be reached; it is logged and the node stays reachable through the coordinator."""
    if a.role == ROLE_RELAY or a.relay_for:
        host.reach.enable_hop(a.relay_for)
    if a.relay_addrs:
        await reserve_on(host, a.relay_addrs, reserve_within_s)


async def reserve_on(host: Host, addrs: tuple[str, ...], within_s: float) -> bool:
    """Connect to the relay at one of `addrs` (its addresses, each …/p2p/<relay>) and
    reserve a slot, trying each in turn until `within_s` passes (the relay may not relay
    yet); whether a slot was granted."""
    deadline = trio.current_time() + within_s
    while True:
        for addr in addrs:
            try:
                await host.connect(addr)
                await host.reach.reserve(addr)
                return True
            except TransportError as exc:
                error = exc
        if trio.current_time() + RESERVE_RETRY_S > deadline:
            log.warning("no slot on the relay at %s within %.0f s (%s): reachable through the coordinator only",
                        addrs[0], within_s, error)
            return False
        await trio.sleep(RESERVE_RETRY_S)


async def dial_first(host: Host, addrs: Iterable[str]) -> None:
    """Connect to a peer at the first of `addrs` that answers (a circuit through its relay
    first, when the coordinator listed one). Error handling: failures are logged; opening
    the stream afterwards raises if none worked and no connection exists."""
    for addr in addrs:
        try:
            await host.connect(addr)
            return
        except TransportError as exc:
            log.info("could not dial successor at %s: %s", addr, exc)


def hop_path(host: Host, stream: FramedStream, successor: str) -> HopPath:
    """What a sender reports of its ring stream to `successor`: the path and, relayed, the relay."""
    return HopPath(peer_id=host.peer_id, successor=successor, path=host.path_of(stream), via=host.via_of(stream))

