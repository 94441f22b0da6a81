"""Which registered nodes sit out of rings, and until when: unreachable or stalling ones.

Pure: a table of `Strike`s in, a new table out. A node its predecessor cannot dial (or
whose stream fails under it: the predecessor's `successor_unreachable` JobError, or the
coordinator failing to dial its head) sits out of rings for a backoff that doubles with
each strike (10 s, 20 s, ... capped at 5 min), then is tried again; a link report in which
some peer measured a round trip to it re-admits it at once (it can be dialled after all).
Its strikes are kept, so a node that keeps failing is tried ever less often. A node that
leaves keeps its strikes for when it comes back under the same identity.

A stage that accepts frames but lets a round miss its deadline (coordinator.jobs.deadline)
is struck the same way as `stalled`: the round fails, the job resumes on a ring without it.
Nothing the coordinator sees says which stage held a missed round (the result never comes),
so `stall_suspect` picks one from evidence: the stage with the fewest rounds served, then
the one present in the most missed rounds. A node that stalls joins with none served and
is in every ring that misses, so it is found first, or after honest ones have each sat out
once. A link report never re-admits a stalled node (it answers pings, not frames), and
`StallPolicy.exclude_after` strikes exclude it for an hour.
The functions are pure (times passed in, in seconds); `Exclusions` holds the swarm's table
on trio's clock. Knows nothing of streams or formation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import trio

from coordinator.swarm.formation import RingState
from ring import PeerId
from shard.wire.messages import JobError

log = logging.getLogger("shard.coordinator")


@dataclass(frozen=True)
class BackoffPolicy:
    first_s: float = 10.0  # one failed dial is often a blip: try again soon
    max_s: float = 300.0  # the probe refresh interval: past it a node is tried at least this often

    def sit_out_s(self, strikes: int) -> float:
        return min(self.first_s * 2 ** max(strikes - 1, 0), self.max_s)


@dataclass(frozen=True)
class StallPolicy:
    first_s: float = 10.0  # an honest stage may be blamed for another's stall: back soon
    exclude_after: int = 3  # blamed this often, it is not an accident
    excluded_s: float = 3600.0

    def sit_out_s(self, strikes: int) -> float:
        return self.excluded_s if strikes >= self.exclude_after else self.first_s * 2 ** max(strikes - 1, 0)


@dataclass(frozen=True)
class Strike:
    strikes: int  # times found unreachable (or stalling)
    until_s: float  # sits out of rings until then (monotonic seconds); <= now: tried again
    reason: str  # the last failure, as reported
    kind: str = "unreachable"  # or "stalled": a link report does not re-admit it


Table = Mapping[PeerId, Strike]


def strike(table: Table, peer: PeerId, now_s: float, reason: str, policy: BackoffPolicy | StallPolicy = BackoffPolicy(),
           kind: str = "unreachable") -> dict[PeerId, Strike]:
    """`peer` was found unreachable (or stalling) at `now_s`: it sits out for its next
    backoff. A strike while it already sits out (reports of the same failure from several
    jobs) adds nothing. Strikes of both kinds count together."""
    old = table.get(peer)
    if old is not None and old.until_s > now_s:
        return dict(table)
    strikes = (old.strikes if old is not None else 0) + 1
    return {**table, peer: Strike(strikes, now_s + policy.sit_out_s(strikes), reason, kind)}


def readmit(table: Table, peers: Iterable[PeerId], now_s: float, kind: str = "unreachable") -> dict[PeerId, Strike]:
    """`peers` were reached (a measured round trip): each may join rings from `now_s`,
    unless it sits out for stalling (reachable is what it already was). `kind`
    "disputed": a dispute settled against their partner (coordinator.trust.disputes)."""
    out = dict(table)
    for peer in peers:
        if peer in out and out[peer].until_s > now_s and out[peer].kind == kind:
            out[peer] = dataclasses.replace(out[peer], until_s=now_s)
    return out


def sitting_out(table: Table, now_s: float) -> dict[PeerId, str]:
    """Peers excluded from rings at `now_s`, with why (as formation.eligible takes them)."""
    return {p: f"{s.kind}: {s.reason}" for p, s in table.items() if s.until_s > now_s}


def stall_suspect(stages: Sequence[PeerId], served: Mapping[PeerId, int], missed: Mapping[PeerId, int]) -> PeerId:
    """Which stage of a ring whose round missed its deadline sits out: the fewest rounds
    served (a newcomer before a stage with a history), then the most missed rounds it was
    part of (the staller is in every ring that misses; an honest stage only in some), then
    the latest in ring order. Deterministic, so every job blames the same stage."""
    order = {p: i for i, p in enumerate(stages)}
    return min(stages, key=lambda p: (served.get(p, 0), -missed.get(p, 0), -order[p]))


def next_return_s(table: Table, now_s: float) -> float | None:
    """When the next excluded peer may be tried again (None: nobody sits out)."""
    times = [s.until_s for s in table.values() if s.until_s > now_s]
    return min(times) if times else None


def blamed(error: JobError, reporter: PeerId, ring: RingState | None) -> PeerId | None:
    """Whom a stage's JobError says is unreachable: for `successor_unreachable` on the ring
    in force, the reporter's successor; None for any other error, another epoch, or the
    tail (its successor is the coordinator, which it just reached to report)."""
    if error.code != "successor_unreachable" or ring is None or error.epoch != ring.epoch:
        return None
    stages = [p for p, _ in ring.stages]
    return stages[stages.index(reporter) + 1] if reporter in stages[:-1] else None


@dataclass
class Exclusions:
    """The swarm's table, on trio's clock, with the log line for each new exclusion."""

    policy: BackoffPolicy = BackoffPolicy()
    stall_policy: StallPolicy = StallPolicy()
    table: dict[PeerId, Strike] = dataclasses.field(default_factory=dict)

    def strike(self, peer: PeerId, reason: str, kind: str = "unreachable") -> bool:
        """Exclude `peer` for its next backoff (`kind` "stalled": its next stall backoff);
        False if it already sits out."""
        now_s = trio.current_time()
        policy = self.stall_policy if kind == "stalled" else self.policy
        before, self.table = self.table, strike(self.table, peer, now_s, reason[:200], policy, kind)
        if self.table == before:
            return False
        s = self.table[peer]
        log.warning("node %s is %s (%s): out of rings for %.0f s (strike %d)", peer, kind, reason,
                    s.until_s - now_s, s.strikes)
        return True

    def readmit(self, peers: Iterable[PeerId], kind: str = "unreachable") -> None:
        self.table = readmit(self.table, peers, trio.current_time(), kind)

    def sitting_out(self) -> dict[PeerId, str]:
        return sitting_out(self.table, trio.current_time())

    def next_return_s(self) -> float:
        """trio time at which the next excluded peer may be tried again (inf: nobody sits out)."""
        at = next_return_s(self.table, trio.current_time())
        return math.inf if at is None else at
