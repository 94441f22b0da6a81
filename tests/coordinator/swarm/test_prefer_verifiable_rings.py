"""Several rings prefer newcomers something trusted can check (issue 20), pure:
coordinator.swarm.ring_set.prefer_verifiable over the real decide_rings.

"Needed" with several rings: an unverifiable newcomer is seated only when without it fewer
rings form (capacity is what several rings are for); a ring that forms as well without it
leaves it off, and the decision still stands for every member (the swarm's loop must not
decide again and again).
"""

from __future__ import annotations

from coordinator.swarm import ring_set
from coordinator.swarm.formation import NoRing, SwarmConfig
from coordinator.swarm.ring_set import Current, RingsDecision
from ring import PeerId
from tests.coordinator.swarm.test_ring_set import IDENTITY, _check, _formed, _reg, _snapshot


def _decider(snapshot, current=None, **config):
    return lambda pool: ring_set.decide_rings(snapshot, pool, SwarmConfig(**config), IDENTITY, current or {})


def _seated(d: RingsDecision) -> set[PeerId]:
    return {p for _, f in d.formed for p, _ in f.stages}


def _only(*newcomers):
    """An `unverifiable` check: these stages on probation nothing trusted could check."""
    return lambda stages: tuple(p for p, _ in stages if p in newcomers)


def test_an_unverifiable_newcomer_is_kept_off_when_both_rings_form_without_it():
    # Bug guarded: the multi-ring path seating a newcomer nothing trusted can check while
    # the pool forms its two rings as well without it (its rounds would go out unchecked).
    # Sound: the newcomer is one the plain decision seats, so only the preference keeps it off.
    snap, config = _snapshot([_reg(p) for p in "abcde"]), {"max_rings": 2, "ring_spares": 0}
    plain = _decider(snap, **config)(frozenset(snap.registrations))
    assert isinstance(plain, RingsDecision) and len(plain.formed) == 2
    x = sorted(_seated(plain))[0]
    got, seated, off = ring_set.prefer_verifiable(_decider(snap, **config), frozenset(snap.registrations), _only(x))
    assert isinstance(got, RingsDecision) and len(got.formed) == 2 and x not in _seated(got) and seated == {}
    assert off == {x}  # said, so the swarm watches for a member able to check it leaving probation
    assert got.members == frozenset(snap.registrations)  # decided for all: the loop waits for a change
    _check(got)


def test_an_unverifiable_newcomer_is_seated_when_a_ring_needs_it_and_named_per_ring():
    # Bug guarded: a pool that can form two rings only with the newcomer forming one (half
    # its capacity) or seating it silently. Sound: 4 half-model nodes make 2 rings, 3 make 1.
    snap, config = _snapshot([_reg(p) for p in "abcd"]), {"max_rings": 2, "ring_spares": 0}
    got, seated, off = ring_set.prefer_verifiable(_decider(snap, **config), frozenset(snap.registrations), _only("d"))
    assert isinstance(got, RingsDecision) and len(got.formed) == 2 and "d" in _seated(got)
    rid = next(rid for rid, f in got.formed if "d" in {p for p, _ in f.stages})
    assert seated == {rid: ("d",)} and off == frozenset()
    # Under --unverified-newcomers refuse its ring would only answer 503: one ring without it.
    got, seated, off = ring_set.prefer_verifiable(_decider(snap, **config), frozenset(snap.registrations), _only("d"),
                                                  for_capacity=False)
    assert isinstance(got, RingsDecision) and len(got.formed) == 1 and "d" not in _seated(got)
    assert seated == {} and off == {"d"}


def test_nothing_to_prefer_is_the_plain_decision():
    # Bug guarded: the preference deciding (and dropping nodes) when nobody is unverifiable,
    # or with no engine to ask. And a ring without x that seats another unchecked newcomer is
    # no better: the plain rings stand, both named.
    snap, config = _snapshot([_reg(p) for p in "abcde"]), {"max_rings": 2, "ring_spares": 0}
    members = frozenset(snap.registrations)
    plain = _decider(snap, **config)(members)
    for check in (None, _only()):
        got, seated, off = ring_set.prefer_verifiable(_decider(snap, **config), members, check)
        assert got == plain and seated == {} and off == frozenset()
    got, seated, off = ring_set.prefer_verifiable(_decider(snap, **config), members, _only(*"abcde"))
    assert got == plain and off == frozenset() and sorted(p for peers in seated.values() for p in peers) == sorted(_seated(plain))
    assert isinstance(ring_set.prefer_verifiable(_decider(snap, **config), frozenset(), _only("a"))[0], NoRing)


def test_a_kept_ring_keeps_its_newcomer():
    # Bug guarded: a running ring restarted to drop a newcomer a join made unnecessary (a
    # join never restarts a running ring, issue 21). Sound: the kept ring holds x.
    snap, config = _snapshot([_reg(p) for p in "abcd"]), {"max_rings": 3, "ring_spares": 0}
    first = _decider(snap, **config)(frozenset(snap.registrations))
    current: dict[int, Current] = _formed(first)
    x = sorted(_seated(first))[0]
    bigger = _snapshot([_reg(p) for p in "abcdefg"], epoch=first.epoch)
    got, seated, off = ring_set.prefer_verifiable(_decider(bigger, current, **config), frozenset(bigger.registrations),
                                                  _only(x))
    assert isinstance(got, RingsDecision) and set(got.kept) == set(current) and seated == {} and off == frozenset()
