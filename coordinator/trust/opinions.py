"""Who recomputes an audited stage, and how disagreeing recomputations are settled.

Pure. An audit holds a stage's logged outputs (party 0) against recomputations by
verifier nodes (parties 1, 2, ... in the order asked). Each party falls into an opinion:
the parties whose outputs agree within the stage's tolerance (coordinator.trust.compare).

Asking (`need_another`): a first verifier that agrees with the stage ends the audit. One
that disagrees is never taken on its own word while another can be asked: a second
opinion follows, and when the verifiers then disagree with each other a third settles
it, up to `max_opinions` verifiers.

Settling (`settle`): the opinion held by the most parties wins, ties broken by the most
verifiers in it (so one verifier against the stage, with nobody else to ask, wins: its
word counts as the auditor's own replay used to). Everyone outside a sole winner is
wrong: the stage is faulty, a verifier lied. If opinions still tie, the stage is faulty
unless it holds one of them, and no verifier is accused (nothing says which one lied).
Why this catches a lying verifier: it disagrees with an honest stage, the second
(honest) verifier sides with the stage, and two parties beat one; a cheating stage with
a lying verifier that covers for it is outvoted once two honest verifiers were asked.

Choosing (`pick`): a verifier-role node other than the audited stage and not excluded,
drawn at random per audit (the auditor's rng is unpredictable to nodes), among those
that keep exactly the audited slice warm first, then any other verifier (which loads the
slice from its store, or answers that it cannot).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ring import PeerId
from shard.layers import LayerRange


@dataclass(frozen=True)
class Verdict:
    stage_faulty: bool
    lying: tuple[int, ...]  # parties (>= 1: verifiers, in asked order) outside the winning opinion
    settled: bool  # one opinion won; False: a tie no further verifier could break


def need_another(opinions: Sequence[int], max_opinions: int) -> bool:
    """Whether to ask one more verifier, given each party's opinion id (party 0 the stage)."""
    verifiers = opinions[1:]
    if not verifiers:
        return True
    if len(verifiers) >= max_opinions or all(o == opinions[0] for o in verifiers):
        return False
    return len(verifiers) < 2 or len(set(verifiers)) > 1


def settle(opinions: Sequence[int]) -> Verdict:
    """The verdict on the parties' opinion ids (party 0 the stage, at least one verifier)."""
    held = Counter(opinions)
    by_verifiers = Counter(opinions[1:])
    rank = {o: (held[o], by_verifiers[o]) for o in held}
    best = max(rank.values())
    top = [o for o, r in rank.items() if r == best]
    if len(top) == 1:
        winner = top[0]
        return Verdict(opinions[0] != winner, tuple(i for i, o in enumerate(opinions) if i and o != winner), True)
    return Verdict(opinions[0] not in top, (), False)


def pick(verifiers: Mapping[PeerId, LayerRange | None], layers: LayerRange, excluded: set[PeerId],
         rng: random.Random) -> PeerId | None:
    """A verifier to ask next: random among those holding exactly `layers`, else random
    among the rest; None when every one is excluded (the audited stage, faulty ones,
    those already asked). `verifiers`: verifier-role node -> the slice it keeps warm."""
    left = sorted(p for p in verifiers if p not in excluded)  # sorted: the draw depends on rng alone
    holders = [p for p in left if verifiers[p] == layers]
    pool = holders or left
    return rng.choice(pool) if pool else None
