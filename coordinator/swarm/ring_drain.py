"""Which running replica rings drain because the newcomer they seat is no longer needed (issue 20), pure.

A replica ring seats a newcomer nothing trusted can check (coordinator.trust.opinions.
unverifiable) only "for capacity": fewer rings formed without it (ring_set.prefer_verifiable).
A later join can make it unneeded, but decide_rings keeps a running ring as it is (a join
never restarts one), so the same rule is applied here to the rings in force: decide again
with the rings that seat such newcomers re-formed and those newcomers left out; when that
makes at least as many rings as the decision carried out (any number, without
`for_capacity`: under `--unverified-newcomers refuse` such a ring only answers 503s), none
seating such a newcomer, those rings drain. A draining ring takes no new job (the router),
its running jobs finish there, and once it holds none, or at `drain_s`, it breaks and the
swarm re-forms it, the newcomer left out (coordinator.swarm.forming.drain_rings). A ring
that seats no such newcomer never drains. One extra decide, and only while a ring in
force seats such a newcomer. Knows no jobs, streams or clocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from coordinator.swarm.formation import NoRing
from coordinator.swarm.ring_set import Current, RingsDecision
from ring import PeerId
from shard.layers import LayerRange

Decide = Callable[[frozenset[PeerId], Mapping[int, Current]], RingsDecision | NoRing]
Unverifiable = Callable[[tuple[tuple[PeerId, LayerRange], ...]], tuple[PeerId, ...]]


@dataclass(frozen=True)
class Drain:
    """One ring draining: `epoch` is the ring's own (a ring re-formed since is not draining)."""

    epoch: int
    reason: str  # GET /v1/ring's `draining`
    until_s: float  # trio clock: after this its remaining jobs resume on the other rings


def to_drain(decide: Decide, members: frozenset[PeerId], current: Mapping[int, Current], rings_now: int,
             unverifiable: Unverifiable | None, for_capacity: bool = True) -> dict[int, str]:
    """Ring id -> why it drains, for the formed rings in `current` that seat newcomers
    `unverifiable` names, when `decide` (ring_set.decide_rings over a pool and the rings in
    force) gives at least `rings_now` rings (the decision carried out) with those rings
    re-formed and their newcomers left out, none seating such a newcomer. Empty otherwise.
    All such rings drain together or none: their newcomers are left out together, as
    ring_set.prefer_verifiable leaves them out."""
    if unverifiable is None:
        return {}
    seating = {rid: bad for rid, cur in sorted(current.items()) if cur.ring is not None and (bad := unverifiable(cur.ring.stages))}
    if not seating:
        return {}
    off = frozenset(p for bad in seating.values() for p in bad)
    reformed = {rid: dataclasses.replace(cur, ring=None) if rid in seating else cur for rid, cur in current.items()}
    alt = decide(members - off, reformed)
    if isinstance(alt, NoRing) or for_capacity and len(alt.ring_ids()) < rings_now:
        return {}
    if any(unverifiable(f.stages) for _, f in alt.formed):  # kept rings seat none: those that did re-form
        return {}
    return {rid: f"seats newcomer(s) {', '.join(p[-6:] for p in bad)} that nothing trusted can check, and "
                 f"{len(alt.ring_ids())} ring(s) form without them: takes no new jobs, re-forms without them once "
                 f"its running jobs finish" for rid, bad in seating.items()}
