"""Which running replica rings drain (coordinator/swarm/ring_drain.py), pure, over the real
decide_rings: a ring that seats a newcomer nothing trusted can check drains once the pool
forms as many rings without it; a ring seating none never drains. Then the drain itself
(coordinator.swarm.forming.drain_rings) on a real Swarm and trio's mock clock.

The pool: two trusted half-model nodes a, b and a whole-model newcomer x, `max_rings` 2,
no spares. Without x one ring forms, so x is seated for capacity as a ring of its own
(test_prefer_verifiable_rings); c and d joining make it unneeded.
"""

from __future__ import annotations

import trio
import trio.testing

from coordinator.swarm import forming, ring_drain, ring_set
from coordinator.swarm.formation import RingState, SwarmConfig
from coordinator.swarm.ring_set import RingsDecision
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.swarm.swarm import Swarm
from ring import PeerId
from shard.layers import LayerRange
from tests.coordinator.swarm.test_prefer_verifiable_rings import _only
from tests.coordinator.swarm.test_ring_set import IDENTITY, WHOLE, _formed, _reg, _snapshot

CONFIG = SwarmConfig(max_rings=2, ring_spares=0)


def _decide(snapshot):
    return lambda pool, current: ring_set.decide_rings(snapshot, pool, CONFIG, IDENTITY, current)


def _running():
    """The rings a, b and x run on, x's ring seated for capacity (what prefer_verifiable took)."""
    snap = _snapshot([_reg("a"), _reg("b"), _reg("x", WHOLE)])
    first, seated, _ = ring_set.prefer_verifiable(lambda pool: _decide(snap)(pool, {}), frozenset(snap.registrations),
                                                  _only("x"))
    assert isinstance(first, RingsDecision) and len(first.formed) == 2
    (x_ring,) = seated
    return first, _formed(first), x_ring


def test_a_ring_seating_a_newcomer_the_join_made_unneeded_drains_and_no_other_does():
    # Bug guarded: decide_rings keeps the running ring that seats x after c and d joined, so
    # answers keep crossing a stage nothing trusted checks though two rings form without it.
    # Sound: the decision carried out keeps both rings (2), and without x the trusted four
    # make 2 as well; the ring of a and b seats no newcomer and is not named.
    first, current, x_ring = _running()
    bigger = _snapshot([_reg(p) for p in "abcd"] + [_reg("x", WHOLE)], epoch=first.epoch)
    members = frozenset(bigger.registrations)
    carried = ring_set.prefer_verifiable(lambda pool: _decide(bigger)(pool, current), members, _only("x"))[0]
    assert isinstance(carried, RingsDecision) and set(carried.kept) == set(current)  # a join restarts nothing
    got = ring_drain.to_drain(_decide(bigger), members, current, len(carried.ring_ids()), _only("x"))
    assert list(got) == [x_ring] and "newcomer(s) x" in got[x_ring] and "2 ring(s) form without them" in got[x_ring]


def test_a_newcomer_still_needed_for_capacity_keeps_its_ring_serving():
    # Bug guarded: draining the ring that makes the second ring possible (half the capacity
    # lost for a newcomer that is still needed). Sound: without x only a and b, one ring.
    first, current, x_ring = _running()
    snap = _snapshot([_reg("a"), _reg("b"), _reg("x", WHOLE)], epoch=first.epoch)
    members = frozenset(snap.registrations)
    assert ring_drain.to_drain(_decide(snap), members, current, 2, _only("x")) == {}
    # Under --unverified-newcomers refuse its ring would only answer 503s: one checked ring is enough.
    assert list(ring_drain.to_drain(_decide(snap), members, current, 2, _only("x"), for_capacity=False)) == [x_ring]


def test_nothing_unverifiable_drains_nothing():
    # Bug guarded: rings drained (and re-formed) when no newcomer is unchecked, or when the
    # rings without x would seat another unchecked newcomer (c): no better than x's ring.
    first, current, _ = _running()
    bigger = _snapshot([_reg(p) for p in "abcd"] + [_reg("x", WHOLE)], epoch=first.epoch)
    members = frozenset(bigger.registrations)
    for check in (None, _only(), _only("c", "x"), _only("d", "x")):
        assert ring_drain.to_drain(_decide(bigger), members, current, 2, check) == {}, check


def _swarm_with_rings(store, drain_s: float) -> Swarm:
    """A real Swarm holding ring 0 (trusted a) and ring 1 (newcomer x), no node connected."""
    swarm = Swarm(store, bytes(32), SwarmConfig(max_rings=2, drain_s=drain_s, speed_probe=ProbeConfig(enabled=False)))
    swarm._set_ring(RingState(3, ((PeerId("a"), LayerRange(0, 5)),), (), 0), 0)
    swarm._set_ring(RingState(4, ((PeerId("x"), LayerRange(0, 5)),), (), 1), 1)
    swarm._formed_for = frozenset()
    return swarm


def test_a_drain_ends_when_its_jobs_finish_or_at_its_deadline_and_only_its_ring_breaks(tiny_llama_store):
    # Bug guarded: a drain that waits forever on a job that never ends (the ring keeps its
    # unchecked newcomer), or breaks the ring before its jobs finished, or breaks the other
    # ring. Sound: the mock clock shows exactly when the ring broke.
    async def main():
        swarm = _swarm_with_rings(tiny_llama_store, drain_s=60)
        jobs = {4: 1}
        swarm.busy = lambda epoch: jobs.get(epoch, 0)
        swarm.unverifiable = _only("x")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forming.drain_rings, swarm, frozenset(), {1: "why"})
            await trio.sleep(10)
            assert swarm.draining[1] == ring_drain.Drain(4, "why", 60.0) and 1 in swarm.rings  # still its job's
            jobs[4] = 0
        assert 9.9 < trio.current_time() < 11 and set(swarm.rings) == {0} and swarm._formed_for is None
        assert swarm.draining == {}
        swarm = _swarm_with_rings(tiny_llama_store, drain_s=5)
        swarm.busy = lambda epoch: 1  # a job that never ends: it will resume on ring 0
        swarm.unverifiable = _only("x")
        start = trio.current_time()
        await forming.drain_rings(swarm, frozenset(), {1: "why"})
        assert 5 <= trio.current_time() - start < 5.5 and set(swarm.rings) == {0} and swarm._formed_for is None

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_a_drain_stops_when_its_newcomer_becomes_checkable(tiny_llama_store):
    # Bug guarded: a ring broken (its jobs moved) for a newcomer that a member leaving
    # probation made checkable meanwhile. Sound: its job never ends, so only that stops it.
    async def main():
        swarm = _swarm_with_rings(tiny_llama_store, drain_s=60)
        swarm.busy = lambda epoch: 1
        unchecked = {"x"}
        swarm.unverifiable = lambda stages: tuple(p for p, _ in stages if p in unchecked)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(forming.drain_rings, swarm, frozenset(), {1: "why"})
            await trio.sleep(3)
            assert 1 in swarm.draining
            unchecked.clear()
        assert trio.current_time() < 4 and set(swarm.rings) == {0, 1} and swarm.draining == {}
        assert swarm.rings[1].epoch == 4 and swarm._formed_for == frozenset()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
