"""Which reachable node relays for which stage nobody can dial: the relay role.

Pure: a chosen plan, the registrations, the measured links and the topology config in;
{relayed stage: relay-role node} out, with the plan re-costed through those relays and
each relay's role. A stage needs a relay when nobody can dial it (it registered with a
circuit address first, shard.relay) and a node sends to it: not the head, which the
coordinator reaches over the connection the head opened.

Candidates are members that can be dialled (no circuit first), are no hot standby (a
standby's job is to take its stage over at once) and have at least
`min_upload_bytes_per_s`: spares off the ring, and stages other than the hop's own two
ends (a stage's upload also carries its own activations, one more share of it). Each
relayed stage, in ring order, takes the candidate whose relayed hop costs least as
topology.relayed_links costs it: both legs plus one decode round's bytes on the relay's
upload, shared with the stages it already relays for. The
gateway keeps the hop only when its own relayed hop is cheaper by more than
`gateway_margin_s`: its uplink also carries every user's token ids and every other
relayed hop, and a volunteer that relays takes that off it. Chosen after the ring is
(the selector prices relayed hops through the gateway, the safe side: a chosen relay is
never dearer by more than the margin). A spare that relays gets the relay role; a stage
relays beside its stage work. Each learns whom it relays for from its Assignment
(`relay_for`). Knows nothing of streams or of how relaying is done (shard.reach_duty).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from coordinator.swarm import topology
from coordinator.swarm.topology import TopologyConfig
from ring import LatencyMatrix, ModelSpec, Network, PeerId, Plan, RingError, RoleKind, evaluate
from ring.plan import Role
from shard.relay import circuit_addr
from shard.wire.messages import Register


@dataclass(frozen=True)
class RelayPolicy:
    # A relay forwards a decode round's activations for each stage it serves on its own
    # uplink; below 10 Mbit/s that alone would rival the compute of a small stage.
    min_upload_bytes_per_s: float = 1.25e6
    # How much cheaper (one-way seconds) the gateway's relayed hop must be to keep it.
    gateway_margin_s: float = 0.005
    max_relay_addrs: int = 4  # of the relay's addresses, those a stage reserves on / a sender dials


def needs_relay(plan: Plan, registrations: Mapping[PeerId, Register]) -> list[PeerId]:
    """Stages after the head, in ring order, that nobody can dial."""
    return [s.peer for s in plan.stages[1:] if topology.relay_of(registrations[s.peer].listen_addrs) is not None]


def choose_relays(plan: Plan, registrations: Mapping[PeerId, Register], links: Mapping[tuple[PeerId, PeerId], float],
                  coordinator: PeerId, config: TopologyConfig, round_bytes: int,
                  in_force: Mapping[PeerId, PeerId] | None = None,
                  policy: RelayPolicy = RelayPolicy()) -> dict[PeerId, PeerId]:
    """{stage: relay node} for the plan's relayed stages a volunteer serves better
    than the gateway (see the module docstring); a stage left out keeps the gateway.
    The relay `in_force` for a stage stays while it is a candidate within the margin of
    the best (re-measured links must not move relays, and so re-form the ring, for noise);
    other ties go to the lower peer id. `registrations`: the members only."""
    on_ring = set(plan.peers)
    standbys = {p for p, r in plan.roles.items() if r.kind is RoleKind.HOT_STANDBY}
    candidates = sorted(p for p, reg in registrations.items()
                        if p not in standbys and reg.upload_bytes_per_s >= policy.min_upload_bytes_per_s
                        and topology.relay_of(reg.listen_addrs) is None and reg.listen_addrs)
    order = [s.peer for s in plan.stages]
    chosen: dict[PeerId, PeerId] = {}
    load: Counter[PeerId] = Counter({p: 1 for p in on_ring})  # a stage's own activations share its upload

    def hop_s(src: PeerId, relay: PeerId, dst: PeerId, upload: float) -> float | None:
        legs = links.get((src, relay)), links.get((relay, dst))
        if None in legs:
            return None
        return legs[0] + legs[1] + round_bytes * (load[relay] + 1) / max(upload, 1.0)

    for dst in needs_relay(plan, registrations):
        src = order[order.index(dst) - 1]
        costs = sorted((s, p) for p in candidates if p not in (src, dst)
                       and (s := hop_s(src, p, dst, registrations[p].upload_bytes_per_s)) is not None)
        if not costs:
            continue
        gateway = hop_s(src, coordinator, dst, config.coordinator_upload_bytes_per_s)
        best_s, best = costs[0]
        kept = (in_force or {}).get(dst)
        best_s, best = next(((c, p) for c, p in costs if p == kept and c <= best_s + policy.gateway_margin_s),
                            (best_s, best))
        if gateway is not None and gateway + policy.gateway_margin_s < best_s:
            continue
        chosen[dst] = best
        load[best] += 1
    return chosen


def through(plan: Plan, network: Network, relays: Mapping[PeerId, PeerId], registrations: Mapping[PeerId, Register],
            links: Mapping[tuple[PeerId, PeerId], float], config: TopologyConfig, model: ModelSpec,
            workload) -> tuple[Plan, Network]:
    """`plan` and `network` re-costed with each relayed stage reached through its chosen
    relay, and the relay role given to each relay off the ring (replacing any other role
    it had; the plan's cost shares a relay's upload among the stages it relays for). The
    plan unchanged when no relay was chosen or the re-costed ring does not fit."""
    if not relays:
        return plan, network
    costed = topology.relayed_links(links, registrations, network.coordinator, config,
                                    topology.round_bytes(config, model), relays)
    present = {n.peer for n in network.nodes} | {network.coordinator}
    measured = {k: s for k, s in costed.items() if k[0] in present and k[1] in present}
    network = dataclasses.replace(network, latency=LatencyMatrix(measured, network.latency.unknown_s))
    served = {relay: relay_for(relay, relays) for relay in set(relays.values()) if relay not in plan.peers}
    roles = {p: r for p, r in plan.roles.items() if p not in served}
    for relay, stages in served.items():
        mbit = registrations[relay].upload_bytes_per_s * 8e-6
        roles[relay] = Role(RoleKind.RELAY, f"dialable, uplink {mbit:.0f} Mbit/s: relays for "
                                            f"{', '.join(s[-6:] for s in stages)} behind NATs")
    try:
        return evaluate(dataclasses.replace(plan, roles=roles), network, model, workload), network
    except RingError:
        return plan, network


def relay_for(peer: PeerId, relays: Mapping[PeerId, PeerId] | None) -> tuple[PeerId, ...]:
    """The stages `peer` relays for, in peer order (an Assignment's relay_for)."""
    return tuple(sorted(stage for stage, relay in (relays or {}).items() if relay == peer))


def relay_addrs(relay: PeerId | None, registrations: Mapping[PeerId, Register],
                policy: RelayPolicy = RelayPolicy()) -> tuple[str, ...]:
    """Where a stage reserves on its relay (the relay's own addresses; none: the gateway's)."""
    if relay is None or relay not in registrations:
        return ()
    return tuple(a for a in registrations[relay].listen_addrs if "/p2p/" in a)[: policy.max_relay_addrs]


def successor_addrs(successor: PeerId, relay: PeerId | None, registrations: Mapping[PeerId, Register],
                    max_addrs: int, policy: RelayPolicy = RelayPolicy()) -> tuple[str, ...]:
    """Where a stage dials its successor: through the successor's chosen relay first, then
    the successor's own addresses (its circuit through the gateway among them)."""
    via = tuple(circuit_addr(a, successor) for a in relay_addrs(relay, registrations, policy))
    return (via + tuple(registrations[successor].listen_addrs))[:max_addrs]


def in_force(assignments) -> dict[PeerId, PeerId]:
    """{stage: relay} as a ring's stage Assignments name them (their relay_addrs)."""
    out = {}
    for a in assignments:
        _, p2p, relay = (a.relay_addrs[0] if a.relay_addrs else "").rpartition("/p2p/")
        if p2p and relay:
            out[PeerId(a.peer_id)] = PeerId(relay)
    return out


def place(plan: Plan, network: Network, registrations: Mapping[PeerId, Register],
          links: Mapping[tuple[PeerId, PeerId], float], config: TopologyConfig, model: ModelSpec,
          assignments_in_force=(), policy: RelayPolicy = RelayPolicy()) -> tuple[Plan, Network, dict[PeerId, PeerId]]:
    """choose_relays, then `through`: the plan and network re-costed, and the relays."""
    relays = choose_relays(plan, registrations, links, network.coordinator, config, topology.round_bytes(config, model),
                           in_force(assignments_in_force), policy)
    return (*through(plan, network, relays, registrations, links, config, model, config.workload()), relays)
