"""Probation for newcomers: whose rounds are verified before their tokens are released.

Volunteers are strangers, and an audit after the job (coordinator.trust.audit) finds a
liar only once users already hold its tokens (the red team's lying newcomer had 2 and 14
wrong answers delivered). So a node with no history is on probation: every round of a
ring it serves in is recomputed by the coordinator before the round's tokens are
committed (coordinator.trust.shadow), until it has served `clean_rounds` rounds that all
matched; then only the default audit rate applies. A mismatch is blamed on the newest of
the ring's stages on probation (`blame`).

Credit needs a trusted witness: a round earns a newcomer credit only when the gateway
recomputed it (the shadow) or a trusted node's recomputation agreed (off probation, or a
key the operator lists: `shard-coord serve --trusted-nodes`, `ProbationPolicy.trusted`);
newcomers checking newcomers still catch a disagreement but vouch for nothing, so two
colluding fresh keys never leave probation on each other's word. The bootstrap of a swarm
of newcomers is therefore a gateway whose store holds the layers, or trusted keys.

Standing is kept per identity for the coordinator's lifetime, whether the node stays or
leaves, so rejoining under the same key resumes where it left off, and a fresh key starts
from nothing (coordinator.swarm.admission limits how often an address may register).
Pure: the book is a mapping in, a new mapping out. Knows nothing of frames or models.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ring import PeerId


@dataclass(frozen=True)
class ProbationPolicy:
    # A liar that behaves for this many verified rounds and then cheats is left to the
    # default audit rate (0.25 of its jobs: caught within 20 jobs at 99.6%). 64 rounds is
    # about 8 short requests of plain decoding; the price is the coordinator recomputing
    # every round of a ring with a newcomer meanwhile (about one stage's work).
    clean_rounds: int = 64
    # Keys the operator vouches for (its own machines): never on probation, and their
    # recomputations earn a newcomer credit (coordinator.trust.round_verifier).
    trusted: frozenset[PeerId] = frozenset()


Book = Mapping[PeerId, int]  # peer -> rounds it served that were verified and matched


def on_probation(book: Book, peer: PeerId, policy: ProbationPolicy = ProbationPolicy()) -> bool:
    return peer not in policy.trusted and book.get(peer, 0) < policy.clean_rounds


def probation_stages(book: Book, stages: Iterable[PeerId], policy: ProbationPolicy = ProbationPolicy()) -> tuple[PeerId, ...]:
    """The stages of a ring still on probation, in ring order."""
    return tuple(p for p in stages if on_probation(book, p, policy))


def credit(book: Book, stages: Iterable[PeerId], rounds: int = 1) -> dict[PeerId, int]:
    """Every stage of a ring whose round was verified and matched earns `rounds`."""
    out = dict(book)
    for p in stages:
        out[p] = out.get(p, 0) + rounds
    return out


@dataclass(frozen=True)
class Verdict:
    """What a mismatch on a ring means: `faulty` is excluded for good, `sit_out` for a
    while (it is the likeliest liar, but another newcomer as new as it may be the one)."""

    faulty: PeerId | None
    sit_out: tuple[PeerId, ...]


def blame(book: Book, on_probation_in_ring: Sequence[PeerId]) -> Verdict:
    """Whom a verified round that did not match blames, among the ring's stages on
    probation (stages past it are trusted): the one with the fewest clean rounds, then
    the latest in ring order. It alone with that few, it is faulty: it served no round that
    matched where the others did (a liar corrupts every round it computes, so it never
    earns one). Tied with another, it only sits out; the next mismatch, without it, finds
    the liar with fewer clean rounds than the rest."""
    if not on_probation_in_ring:
        return Verdict(None, ())
    order = {p: i for i, p in enumerate(on_probation_in_ring)}
    ranked = sorted(on_probation_in_ring, key=lambda p: (book.get(p, 0), -order[p]))
    first = ranked[0]
    if len(ranked) == 1 or book.get(first, 0) < book.get(ranked[1], 0):
        return Verdict(first, ())
    return Verdict(None, (first,))
