"""Formation's effects: sign what formation decided, send it, wait for Ready, commit rings.

The swarm's formation loop calls `form` when the eligible membership changed. While the
pool holds one ring's worth (or `max_rings` is 1) that is coordinator.swarm.formation.decide's
ring, as it always was; once it holds more, coordinator.swarm.ring_set's decision: rings
kept untouched, broken ones re-formed alone, new ones formed beside them, each committed
as soon as its own stages are Ready (one slow ring does not hold the others back). Roles
go to the nodes left over; every ring's plan names the standbys that keep its slices warm.
Knows no jobs: the engine hears of every ring change on the swarm's channel.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import Any

import trio

from coordinator.swarm import formation, ring_drain, ring_set
from coordinator.swarm.formation import Formation, NoRing, RingState
from shard.transport import TransportError
from shard.wire.codec import encode
from shard.wire.messages import Assignment
from ring import PeerId
from shard.layers import LayerRange

Swarm = Any  # coordinator.swarm.swarm.Swarm, which imports this module

log = logging.getLogger("shard.coordinator")


async def form(swarm: Swarm, members: frozenset[PeerId]) -> None:
    """Decide, then sign, send, wait for every stage's Ready and commit."""
    if swarm.config.max_rings != 1:
        current = swarm.current_rings()
        several, seated, kept_off = ring_set.prefer_verifiable(lambda pool: ring_set.decide_rings(
            swarm.snapshot(), pool, swarm.config, swarm.identity, current), members, swarm.unverifiable,
            swarm.seat_for_capacity())
        if not ring_set.single_ring(several, current):
            swarm.trust_matters = bool(seated or kept_off)
            swarm.seated_unverified = "; ".join(
                f"ring {rid}: newcomer(s) {', '.join(p[-6:] for p in peers)} seated though neither the gateway nor a "
                f"trusted node can recompute their slices: fewer rings form without them" for rid, peers in seated.items()) or None
            if swarm.seated_unverified:
                log.warning("%s", swarm.seated_unverified)
            await form_rings(swarm, members, several)
            reasons = {}
            if swarm._formed_for == members and not isinstance(several, NoRing):  # every ring formed: any unneeded?
                reasons = ring_drain.to_drain(lambda pool, rings: ring_set.decide_rings(
                    swarm.snapshot(), pool, swarm.config, swarm.identity, rings), members, swarm.current_rings(),
                    len(several.ring_ids()), swarm.unverifiable, swarm.seat_for_capacity())
            swarm.trust_matters |= bool(reasons)  # a member leaving probation may end the drain
            await drain_rings(swarm, members, reasons)
            return
    swarm.draining = {}
    decision, swarm.seated_unverified = prefer_verifiable(
        lambda pool: formation.decide(swarm.snapshot(), pool, swarm.config, swarm.identity), members, swarm.unverifiable)
    if swarm.seated_unverified:
        log.warning("%s", swarm.seated_unverified)
    swarm.trust_matters = bool(swarm.seated_unverified) or not isinstance(decision, NoRing) and decision.members != members
    if not isinstance(decision, NoRing) and decision.members != members:  # formed without unverifiable newcomers:
        decision = dataclasses.replace(decision, members=members)  # decided for all, so the loop waits for a change
    if isinstance(decision, NoRing):
        log.warning("cannot form a ring from %d nodes: %s", len(members), decision.reason)
        swarm._formed_for = members
        swarm._set_ring(None)
        return
    plan = decision.plan
    log.info("plan for %d nodes: %s", len(members), plan.describe())
    for peer, role in sorted(plan.roles.items()):
        log.info("node %s off the ring as %s: %s", peer, role.kind.value, role.reason)
    if not decision.new_ring:
        # Same ring: keep the epoch (and every job's KV); only roles may have changed.
        _adopt(swarm, decision)
        swarm.drain_until = None
        await send_roles(swarm, decision.roles)
        return
    if swarm.ring is not None and ring_set.peers_of(swarm.ring) <= members and not await drain(swarm, members):
        return  # membership changed while the ring drained: the formation loop decides again
    swarm._set_ring(None)
    swarm.epoch = epoch = decision.epoch
    assignments = [sign(swarm, a) for a in decision.assignments]
    log.info("forming ring epoch %d: %s", epoch, ", ".join(f"{p[-6:]}{r}" for p, r in decision.stages))
    try:
        for a in assignments:
            await send_assignment(swarm, a)
        await send_roles(swarm, decision.roles)
        with trio.fail_after(swarm.config.ready_timeout_s + 2 * plan.move_s):  # stages fetch their moves first
            while not _ready(swarm, assignments, epoch):
                if any(a.peer_id not in swarm.members for a in assignments):
                    return  # someone left meanwhile; the formation loop tries again
                await swarm._changed.wait()
    except (TransportError, trio.TooSlowError) as exc:
        log.warning("ring epoch %d failed to form: %s", epoch, exc)
        return
    if epoch == swarm.epoch:
        _adopt(swarm, decision)
        swarm.traversals.clear()
        swarm._set_ring(RingState(epoch, decision.stages, tuple(assignments)))
        swarm.drain_until = None
        log.info("ring epoch %d ready", epoch)


def prefer_verifiable(decide: Callable[[frozenset[PeerId]], Formation | NoRing], members: frozenset[PeerId],
                      unverifiable: Callable[[tuple[tuple[PeerId, LayerRange], ...]], tuple[PeerId, ...]] | None
                      ) -> tuple[Formation | NoRing, str | None]:
    """Pure. The ring `decide` forms from `members`, unless it seats newcomers nothing
    trusted could check (`unverifiable`, coordinator.trust.opinions.unverifiable: set by the
    engine) and a ring forms without them whose probation stages can all be checked: that
    one. Else the first, with a one-line note naming whom it seats unverified (GET /v1/ring)."""
    decision = decide(members)
    if unverifiable is None or isinstance(decision, NoRing) or not (bad := unverifiable(decision.stages)):
        return decision, None
    alt = decide(members - frozenset(bad))
    if not isinstance(alt, NoRing) and not unverifiable(alt.stages):
        return alt, None
    return decision, (f"newcomer(s) {', '.join(p[-6:] for p in bad)} seated though neither the gateway nor a trusted "
                      f"node can recompute their slices: no ring formed without them")


async def drain(swarm: Swarm, members: frozenset[PeerId]) -> bool:
    """The ring in force is whole but a join makes formation choose another: wait until its
    running jobs finish, so none re-prefills on the new ring, but at most `drain_s` from the
    first wait (then they resume there). New requests still go to the ring in force. False
    when the eligible membership changed meanwhile (the loop decides again, same deadline)."""
    epoch = swarm.ring.epoch
    if swarm.drain_until is None:
        swarm.drain_until = trio.current_time() + swarm.config.drain_s
        if swarm.busy(epoch):
            log.info("ring epoch %d drains its %d running jobs (at most %.0f s) before it re-forms",
                     epoch, swarm.busy(epoch), swarm.config.drain_s)
    while swarm.busy(epoch) and trio.current_time() < swarm.drain_until:
        if swarm._eligible() != members:
            return False
        with trio.move_on_after(0.2):
            await swarm._changed.wait()
    return True


async def drain_rings(swarm: Swarm, members: frozenset[PeerId], reasons: dict[int, str]) -> None:
    """Replica rings that seat newcomers no longer needed (`reasons`, coordinator.swarm.
    ring_drain) drain: they take no new jobs (`swarm.draining`, read by the router) and their
    running jobs finish there; once a ring holds none, or `drain_s` after its drain began
    (its jobs then resume on the other rings), it breaks and the formation loop re-forms it
    without them. A ring whose newcomers became checkable meanwhile stops draining. Returns
    when none drains, or when the eligible membership changed (the loop decides again; a
    drain it confirms keeps its deadline)."""
    now = trio.current_time()
    draining = {}
    for rid, reason in reasons.items():
        ring, was = swarm.rings[rid], swarm.draining.get(rid)
        draining[rid] = was if was is not None and was.epoch == ring.epoch else ring_drain.Drain(
            ring.epoch, reason, now + swarm.config.drain_s)
        if draining[rid] is not was:
            log.info("ring %d epoch %d drains (%d running jobs, at most %.0f s): %s", rid, ring.epoch,
                     swarm.busy(ring.epoch), swarm.config.drain_s, reason)
    swarm.draining = draining
    while swarm.draining:
        for rid, d in list(swarm.draining.items()):
            ring = swarm.rings.get(rid)
            if ring is None or ring.epoch != d.epoch or swarm.unverifiable is None or not swarm.unverifiable(ring.stages):
                del swarm.draining[rid]  # broke meanwhile, or its newcomers can be checked now
            elif not swarm.busy(d.epoch) or trio.current_time() >= d.until_s:
                log.info("ring %d epoch %d drained (%d jobs left to resume elsewhere): it re-forms", rid, d.epoch,
                         swarm.busy(d.epoch))
                del swarm.draining[rid]
                swarm._set_ring(None, rid)
                swarm._formed_for = None  # the loop decides again: the ring re-forms, its newcomers left out
        if swarm._eligible() != members:
            return
        if swarm.draining:
            with trio.move_on_after(0.2):  # jobs closing notify nobody: look again
                await swarm._changed.wait()


async def form_rings(swarm: Swarm, members: frozenset[PeerId], decision: ring_set.RingsDecision | NoRing) -> None:
    """Several rings (coordinator.swarm.ring_set): carry out one decision."""
    if isinstance(decision, NoRing):
        log.warning("cannot form a ring from %d nodes: %s", len(members), decision.reason)
        swarm._formed_for = members
        for rid in list(swarm.rings):
            swarm._set_ring(None, rid)
        return
    for rid, reason in decision.dropped:
        log.warning("ring %d cannot re-form from the free nodes (%s): its jobs move to the other rings", rid, reason)
        swarm._set_ring(None, rid)
        swarm.ring_plans.pop(rid, None)
    swarm.epoch = decision.epoch
    swarm.plan, swarm.network = decision.primary_plan, decision.primary_network
    pending: dict[int, tuple[Formation, list[Assignment]]] = {}
    plans = dict(decision.plans)  # each with the standbys that keep its slices warm
    for rid, f in decision.formed:
        swarm._set_ring(None, rid)  # a broken ring's jobs move (or wait) while it re-forms
        swarm.ring_plans[rid] = (plans[rid], f.network if rid != decision.primary else decision.primary_network)
        pending[rid] = (f, [sign(swarm, a) for a in f.assignments])
        log.info("forming ring %d epoch %d (%s): %s", rid, f.epoch, f.plan.describe(),
                 ", ".join(f"{p[-6:]}{r}" for p, r in f.stages))
    for rid in decision.kept:
        network = decision.primary_network if rid == decision.primary else swarm.ring_plans[rid][1]
        swarm.ring_plans[rid] = (plans[rid], network)
    for peer, role in sorted(decision.primary_plan.roles.items()):
        log.info("node %s off every ring as %s: %s", peer, role.kind.value, role.reason)
    try:
        for _, signed in pending.values():
            for a in signed:
                await send_assignment(swarm, a)
        await send_roles(swarm, decision.roles)
        move_s = max((f.plan.move_s for f, _ in pending.values()), default=0.0)
        with trio.fail_after(swarm.config.ready_timeout_s + 2 * move_s):
            while pending:
                for rid, (f, signed) in list(pending.items()):
                    if _ready(swarm, signed, f.epoch):
                        del pending[rid]
                        swarm._set_ring(RingState(f.epoch, f.stages, tuple(signed), rid), rid)
                        log.info("ring %d epoch %d ready", rid, f.epoch)
                if not pending:
                    break
                if any(a.peer_id not in swarm.members for _, signed in pending.values() for a in signed):
                    return  # someone left meanwhile; the formation loop tries again
                await swarm._changed.wait()
    except (TransportError, trio.TooSlowError) as exc:
        log.warning("rings %s failed to form: %s", sorted(pending), exc)
        return
    swarm._formed_for = members


def _ready(swarm: Swarm, assignments: list[Assignment], epoch: int) -> bool:
    return all(a.peer_id in swarm.members and swarm.members[a.peer_id].ready_epoch >= epoch for a in assignments)


def _adopt(swarm: Swarm, decision: Formation) -> None:
    swarm._formed_for, swarm.plan, swarm.network = decision.members, decision.plan, decision.network
    swarm.ring_plans[0] = (decision.plan, decision.network)


def sign(swarm: Swarm, a: Assignment) -> Assignment:
    return dataclasses.replace(a, signature=swarm._key.sign(a.signing_bytes()))


async def send_assignment(swarm: Swarm, a: Assignment) -> None:
    member = swarm.members.get(PeerId(a.peer_id))
    if member is None:
        raise TransportError(f"{a.peer_id} left before its assignment", a.peer_id)
    member.assignment = a
    async with member.lock:
        await member.control.send_frame(encode(a))


async def send_roles(swarm: Swarm, roles: tuple[Assignment, ...]) -> None:
    """Send every member off the rings its role, unless it already has that one. A node
    that cannot be reached just misses its role."""
    for a in roles:
        member = swarm.members.get(PeerId(a.peer_id))
        if formation.same_assignment(member.assignment if member is not None else None, a):
            continue
        try:
            await send_assignment(swarm, sign(swarm, a))
        except TransportError as exc:
            log.info("could not send %s its role: %s", a.peer_id, exc)
