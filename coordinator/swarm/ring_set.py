"""Several rings over one pool (issue 21): which rings exist after a membership change, pure.

A pool that holds more than one ring's worth of capacity serves more users as several
rings over disjoint nodes, each with its own epoch (epochs stay unique and increasing
across rings, so a node's "only newer epochs" rule holds whichever ring it moves to). In
ring id order:

1. A ring whose stages are all still eligible is kept as it is: same stages, same epoch,
   its jobs keep their K/V. A node joining therefore never re-forms a running ring; it
   forms a new ring beside them or takes a role.
2. A ring that lost a stage re-forms alone, over the nodes no kept ring uses, exactly as
   the single ring does (coordinator.swarm.formation.decide: its hot standby takes over,
   else re-selection keeps the survivors' slices). When the free nodes cannot make it,
   it is dropped (its jobs move to the other rings).
3. While there are fewer than `max_rings` (0: no limit), another ring is chosen by the
   topology selector over the nodes still free, if it leaves `ring_spares` nodes free for
   the roles (default: one hot standby per stage of the first ring). Where the selector's
   fastest ring would take a node without which a further ring could form, and none can
   with it, the fastest ring without one of its nodes is taken instead (`leave_room`): the
   pool's count of rings first, each ring's speed after. A node that holds the
   whole model alone is a one-stage ring of its own (what a "decode-only replica" was
   meant to be). A pool whose rings reach a stage through a relay keeps to one ring: the
   relay role is carried by formation.decide's single ring only (roles here are assigned
   by ring.assign_roles, which knows no relay).
4. The nodes left over get their roles around the first ring (the lowest id formed), on a
   fresh epoch so that a former stage takes its role. A hot standby keeps a slice warm,
   not a ring: every other ring with a stage on that same slice counts it as that stage's
   standby too (`plans`), so whichever ring loses that stage first, the standby takes it
   over (formation.standby_takeover) and the next decision re-assigns the roles.

While the pool holds one ring's worth (`single_ring`) the swarm forms formation.decide's
single ring, as with `max_rings` 1: a join may re-select it (after a drain), relays keep
their role.

Newcomers nothing trusted can check (`prefer_verifiable`, issue 20): a decision that
seats, in a ring it forms, a stage on probation whose slice neither the gateway nor a
trusted member keeps is taken only when that newcomer is needed: without them fewer rings
form (or a ring that forms without them seats other such newcomers). Capacity is what a
pool of several rings is for, and an unchecked ring still serves under
`--unverified-newcomers serve`; under `refuse` it would answer only 503s, so there it is
needed only when no ring forms without it. Kept rings stay as they are (a join never
restarts a running ring); one seating such a newcomer that a join made unneeded drains and
then re-forms without it (coordinator.swarm.ring_drain). Knows nothing of streams, keys or
jobs: the swarm carries the decision out, the engine routes requests over rings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coordinator.swarm import formation, seeding, topology
from coordinator.swarm.formation import Formation, ModelIdentity, NoRing, RingState, Snapshot, SwarmConfig
from ring import Network, PeerId, Plan, Role, RoleKind, assign_roles
from shard.layers import LayerRange
from shard.wire.messages import Assignment


@dataclass(frozen=True)
class Current:
    """One ring the swarm holds: `ring` None while it is broken or still forming."""

    ring: RingState | None
    plan: Plan | None
    network: Network | None = None


@dataclass(frozen=True)
class RingsDecision:
    members: frozenset[PeerId]
    kept: tuple[int, ...]  # ring ids left exactly as they are
    formed: tuple[tuple[int, Formation], ...]  # ring id -> a ring to form anew (its own epoch), id order
    dropped: tuple[tuple[int, str], ...]  # broken rings that cannot re-form now, and why
    primary: int  # the ring the roles are assigned around
    primary_plan: Plan  # its plan, roles re-assigned over the nodes left over
    primary_network: Network  # over its stages and the nodes left over
    roles: tuple[Assignment, ...]  # unsigned, one per member left over with a role
    epoch: int  # the last epoch this decision hands out
    plans: tuple[tuple[int, Plan], ...] = ()  # every ring kept or formed, id order, with its hot standbys

    def ring_ids(self) -> tuple[int, ...]:
        return tuple(sorted([*self.kept, *(rid for rid, _ in self.formed)]))


def peers_of(ring: RingState) -> frozenset[PeerId]:
    return frozenset(p for p, _ in ring.stages)


def decide_rings(snapshot: Snapshot, members: frozenset[PeerId], config: SwarmConfig, model: ModelIdentity,
                 current: Mapping[int, Current]) -> RingsDecision | NoRing:
    """The rings for `members` given the rings in force (see the module docstring).
    NoRing when no ring is kept and none can be formed."""
    free = set(members)
    kept = []
    for rid, cur in sorted(current.items()):
        if cur.ring is not None and peers_of(cur.ring) <= free:
            kept.append(rid)
            free -= peers_of(cur.ring)
    epoch, formed, dropped = snapshot.epoch, [], []
    for rid, cur in sorted(current.items()):
        if rid in kept:
            continue
        d = _form_one(snapshot, frozenset(free), config, model, cur.plan, epoch)
        if isinstance(d, NoRing):
            dropped.append((rid, d.reason))
            continue
        formed.append((rid, d))
        free -= {p for p, _ in d.stages}
        epoch = d.epoch
    no_ring_reason = dropped[-1][1] if dropped else "no ring formed"
    used = set(current)
    while (config.max_rings == 0 or len(kept) + len(formed) < config.max_rings) and free:
        d = _form_one(snapshot, frozenset(free), config, model, None, epoch)
        if isinstance(d, NoRing):
            no_ring_reason = d.reason
            break
        if config.max_rings == 0 or len(kept) + len(formed) + 1 < config.max_rings:
            spares = config.ring_spares if config.ring_spares is not None else len(
                _first_stages(current, kept, formed) if kept or formed else d.stages)
            d = leave_room(lambda pool: _form_one(snapshot, pool, config, model, None, epoch), frozenset(free), d, spares)
        if kept or formed:
            if d.assignments and _relayed(d.assignments) or any(
                    _relayed(current[rid].ring.assignments) for rid in kept) or any(_relayed(f.assignments) for _, f in formed):
                break
            spares = config.ring_spares if config.ring_spares is not None else len(_first_stages(current, kept, formed))
            if len(free) - len(d.stages) < spares:
                break
        rid = next(i for i in range(len(used) + 1) if i not in used)
        used.add(rid)
        formed.append((rid, d))
        free -= {p for p, _ in d.stages}
        epoch = d.epoch
    if not kept and not formed:
        return NoRing(members, no_ring_reason)
    primary = min([*kept, *(rid for rid, _ in formed)])
    by_id = dict(formed)
    plan = by_id[primary].plan if primary in by_id else current[primary].plan
    around = frozenset(free) | frozenset(plan.peers)
    network = _network_over(snapshot, around, config, model)
    plan = dataclasses.replace(plan, roles=assign_roles(plan, network, model.spec, config.topology.workload()))
    roles = ()
    if plan.roles:
        epoch += 1
        roles = formation.role_assignments(plan, snapshot, around, epoch, model)
    plans = tuple((rid, plan if rid == primary else shared_standbys(plan, by_id[rid].plan if rid in by_id else current[rid].plan))
                  for rid in sorted([*kept, *by_id]))
    return RingsDecision(members, tuple(kept), tuple(formed), tuple(dropped), primary, plan, network, roles, epoch, plans)


def prefer_verifiable(decide: Callable[[frozenset[PeerId]], RingsDecision | NoRing], members: frozenset[PeerId],
                      unverifiable: Callable[[tuple[tuple[PeerId, LayerRange], ...]], tuple[PeerId, ...]] | None,
                      for_capacity: bool = True
                      ) -> tuple[RingsDecision | NoRing, dict[int, tuple[PeerId, ...]], frozenset[PeerId]]:
    """Pure. `decide`'s rings for `members`, unless a ring it forms seats newcomers nothing
    trusted could check (`unverifiable`, as forming.prefer_verifiable) and the rings decided
    without them are as many (any number, without `for_capacity`: under
    `--unverified-newcomers refuse` such a ring would only answer 503), none seating such a
    newcomer: those (decided for all of `members`, so the swarm's loop waits for a change). Also: ring id -> the unverifiable
    newcomers the rings taken form with, and the newcomers kept off (both empty when none)."""
    decision = decide(members)
    bad = _unverifiable_by_ring(decision, unverifiable)
    if not bad:
        return decision, {}, frozenset()
    off = frozenset(p for peers in bad.values() for p in peers)
    alt = decide(members - off)
    if not isinstance(alt, NoRing) and (not for_capacity or len(alt.ring_ids()) >= len(decision.ring_ids())) and not (
            _unverifiable_by_ring(alt, unverifiable)):
        return dataclasses.replace(alt, members=members), {}, off
    return decision, bad, frozenset()


def _unverifiable_by_ring(decision: RingsDecision | NoRing, unverifiable) -> dict[int, tuple[PeerId, ...]]:
    if unverifiable is None or isinstance(decision, NoRing):
        return {}
    return {rid: bad for rid, f in decision.formed if (bad := unverifiable(f.stages))}


def shared_standbys(primary: Plan, other: Plan) -> Plan:
    """`other` with the primary's hot standbys as its own where they keep one of its stages'
    slices warm (rings over like nodes split alike); the other roles stay the primary's."""
    index = {s.layers: i for i, s in enumerate(other.stages)}
    roles = {}
    for peer, role in sorted(primary.roles.items()):
        layers = primary.stages[role.stage_index].layers if role.stage_index is not None else None
        if role.kind is RoleKind.HOT_STANDBY and layers in index:
            roles[peer] = Role(RoleKind.HOT_STANDBY, f"keeps {layers} warm, a slice the first ring's stage "
                                                     f"{role.stage_index} and this ring's stage {index[layers]} share",
                               index[layers])
    return dataclasses.replace(other, roles=roles)


def single_ring(decision: RingsDecision | NoRing, current: Mapping[int, Current]) -> bool:
    """Whether the pool holds one ring's worth: the decision keeps or forms ring 0 alone (or
    none) and the swarm holds no other ring. formation.decide's single ring then serves."""
    if any(rid != 0 for rid in current):
        return False
    return isinstance(decision, NoRing) or decision.ring_ids() == (0,)


def leave_room(form: Callable[[frozenset[PeerId]], Formation | NoRing], free: frozenset[PeerId], best: Formation,
               spares: int) -> Formation:
    """Pure. `best` (the selector's ring over `free`), unless it takes a node the next ring
    needs: when no ring forms over the nodes it leaves (with `spares` left over beside it)
    but one does once the ring is chosen without one of `best`'s nodes, that ring (the
    fastest predicted such). One whole-model node and two half-model nodes hold two rings,
    but the fastest single ring may seat the whole-model node beside a half-model one."""
    def another(ring: Formation) -> bool:
        rest = free - {p for p, _ in ring.stages}
        after = form(rest) if rest else None
        return after is not None and not isinstance(after, NoRing) and len(rest) - len(after.stages) >= spares
    if another(best):
        return best
    options = [d for peer in sorted({p for p, _ in best.stages})
               if not isinstance(d := form(free - {peer}), NoRing) and another(d)]
    return min(options, key=lambda d: (d.plan.total_s, tuple(p for p, _ in d.stages)), default=best)


def _form_one(snapshot: Snapshot, pool: frozenset[PeerId], config: SwarmConfig, model: ModelIdentity,
              plan: Plan | None, epoch: int) -> Formation | NoRing:
    """One ring over `pool` by formation.decide (starting from `plan` when it re-forms), on
    the next epoch after `epoch`, without roles (those are decided once, around the first)."""
    if not pool:
        return NoRing(pool, "no free node")
    d = formation.decide(dataclasses.replace(snapshot, plan=plan, ring=None, epoch=epoch), pool, config, model)
    return d if isinstance(d, NoRing) else dataclasses.replace(d, roles=())


def _relayed(assignments) -> bool:
    return any(a.relay_addrs for a in assignments)


def _first_stages(current: Mapping[int, Current], kept: list[int], formed: list[tuple[int, Formation]]):
    first = min([*kept, *(rid for rid, _ in formed)])
    by_id = dict(formed)
    return by_id[first].stages if first in by_id else current[first].ring.stages


def _network_over(snapshot: Snapshot, peers: frozenset[PeerId], config: SwarmConfig, model: ModelIdentity) -> Network:
    regs = {p: snapshot.registrations[p] for p in peers if p in snapshot.registrations}
    held = seeding.held_or_stored(regs, snapshot.held, model.spec.num_layers)
    return topology.build_network(snapshot.coordinator, regs, snapshot.links, held, config.topology, model.spec)
