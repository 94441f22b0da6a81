"""Disagreements among newcomers that no trusted party or majority settles (issue 20).

Pure. On a gateway holding no layers and with no trusted key, a newcomer stage may be
checked by one newcomer verifier alone. `settle` would take that verifier's word (one
against one, the verifier wins), so a lying newcomer verifier could frame an honest
newcomer stage. Instead (`lone_word`): where no trusted verifier took part and no opinion
is held by at least two parties and by more than any other (one against one, or every
party on its own), nobody is judged. The disagreeing parties are in dispute: the round is
held back, each sits out of rings for a while (coordinator.swarm.unreachable, kind
"disputed") and nobody earns credit. Where a trusted verifier took part, or two parties
agree against one, `opinions.settle_trusted` decides as ever.

Who lied (`liars`): a liar disputes with every honest node it meets, an honest node only
with liars. So a node in dispute with two or more distinct partners within `WINDOW_S`,
none of whom disputed with anyone else, is the liar. Two honest nodes never dispute with
each other (they agree within tolerance), so an honest node is named only if two liars
that never met an honest node other than it dispute with it, and each liar then has
that honest node as its only partner and names nobody else.

The book is a tuple of `Dispute`s in, a new tuple out; times are passed in (seconds).
Knows nothing of frames, swarms or probation's book.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ring import PeerId

# How long a dispute counts towards finding the liar: the stall exclusion's hour
# (coordinator.swarm.unreachable.StallPolicy.excluded_s). A liar meets a second partner
# as soon as a ring seats it again after its sit-out (tens of seconds).
WINDOW_S = 3600.0


@dataclass(frozen=True)
class Dispute:
    a: PeerId
    b: PeerId
    at_s: float  # when (monotonic seconds)
    what: str  # which check: "layers [s, e) of <stage> on round r of job j"


Book = tuple[Dispute, ...]


def lone_word(opinions: Sequence[int], trusted: Sequence[bool]) -> bool:
    """Whether settling `opinions` (party 0 the stage; as opinions.settle_trusted takes
    them) would rest on an untrusted party's word alone: no trusted verifier took part,
    the parties disagree, and no opinion has at least two parties and more than any other."""
    if any(trusted[1:]):
        return False
    counts = sorted(Counter(opinions).values(), reverse=True)
    if len(counts) == 1:
        return False
    return counts[0] < 2 or counts[0] == counts[1]


def disputing(opinions: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """The pairs of parties (i < j) whose opinions differ: each pair is one dispute."""
    n = len(opinions)
    return tuple((i, j) for i in range(n) for j in range(i + 1, n) if opinions[i] != opinions[j])


def record(book: Book, a: PeerId, b: PeerId, now_s: float, what: str, window_s: float = WINDOW_S) -> Book:
    """`book` with a dispute between `a` and `b` at `now_s`, those older than `window_s` dropped."""
    return tuple(d for d in book if now_s - d.at_s < window_s) + (Dispute(a, b, now_s, what),)


def partners(book: Book, peer: PeerId) -> set[PeerId]:
    return {d.b if d.a == peer else d.a for d in book if peer in (d.a, d.b)}


def liars(book: Book) -> tuple[PeerId, ...]:
    """The nodes in dispute with at least two distinct partners, each of whom disputed
    with nobody else, sorted."""
    peers = {p for d in book for p in (d.a, d.b)}
    return tuple(sorted(p for p in peers if len(found := partners(book, p)) >= 2
                        and all(partners(book, q) == {p} for q in found)))


def settled(book: Book, liar: PeerId) -> Book:
    """`book` without `liar`'s disputes (it is excluded; its partners are cleared)."""
    return tuple(d for d in book if liar not in (d.a, d.b))


def open_disputes(book: Book, now_s: float, window_s: float = WINDOW_S) -> list[dict]:
    """For /v1/ring: each dispute still in the window, oldest first."""
    return [{"nodes": [d.a, d.b], "check": d.what, "age_s": round(now_s - d.at_s, 1)}
            for d in book if now_s - d.at_s < window_s]
