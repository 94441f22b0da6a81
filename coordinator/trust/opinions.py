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
word counts as the auditor's own replay used to; probation's checks among newcomers alone
do not take that word, they record a dispute instead: coordinator.trust.disputes). Everyone outside a sole winner is
wrong: the stage is faulty, a verifier lied. If opinions still tie, the stage is faulty
unless it holds one of them, and no verifier is accused (nothing says which one lied).
Why this catches a lying verifier: it disagrees with an honest stage, the second
(honest) verifier sides with the stage, and two parties beat one; a cheating stage with
a lying verifier that covers for it is outvoted once two honest verifiers were asked.

Trust (`settle_trusted`, `vouched`; probation's checks): where a verifier is trusted (off
probation, or a key the operator lists), only the stage and the trusted verifiers vote, and
a newcomer verifier outside their winner is wrong too: two colluding fresh keys (the stage
and its friend) cannot outvote a trusted recomputation. Only a trusted verifier agreeing
with the stage vouches for it (earns it credit); newcomers agreeing prove nothing.

Choosing (`pick`): a verifier-role node other than the audited stage and not excluded,
drawn at random per audit (the auditor's rng is unpredictable to nodes), among those
that keep exactly the audited slice warm first, then any other verifier (which loads the
slice from its store, or answers that it cannot). Past the verifier-role nodes, and for
probation's checks (coordinator.trust.round_verifier), `candidates`: any other member, not
excluded, whose node keeps every layer of the slice (loaded or in its store), in an order
that favours nodes off probation and nodes with the slice already loaded; in a ring where
every node is a stage (no verifier role), the stages verify each other's slices.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from coordinator.swarm.speed_probe import keeps
from ring import PeerId
from shard.layers import LayerRange
from shard.wire.messages import Register
from shard.wire.roles import ROLE_SPOT_CHECK_VERIFIER


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


def settle_trusted(opinions: Sequence[int], trusted: Sequence[bool]) -> Verdict:
    """`settle` where `trusted[i]` says party i (a verifier, i >= 1; party 0 is ignored) is
    trusted: with any trusted verifier, the stage and the trusted verifiers alone decide,
    and every verifier outside their winning opinion is lying; with none, as `settle`."""
    voters = [0] + [i for i in range(1, len(opinions)) if trusted[i]]
    if len(voters) == 1:
        return settle(opinions)
    sub = settle([opinions[i] for i in voters])
    if not sub.settled:
        return Verdict(sub.stage_faulty, (), False)
    winner = opinions[0] if not sub.stage_faulty else next(
        opinions[voters[j]] for j in range(1, len(voters)) if j not in sub.lying)
    return Verdict(sub.stage_faulty, tuple(i for i in range(1, len(opinions)) if opinions[i] != winner), True)


def vouched(opinions: Sequence[int], trusted: Sequence[bool]) -> bool:
    """Whether a trusted verifier (i >= 1) holds the stage's opinion: only then does a
    passed check earn the stage credit."""
    return any(trusted[i] and opinions[i] == opinions[0] for i in range(1, len(opinions)))


def verifier_slices(members: Mapping[PeerId, Any]) -> dict[PeerId, LayerRange | None]:
    """Members (the swarm's) whose latest role is spot-check verifier -> the slice each keeps
    warm (one still loading it answers all the same: it recomputes from its store)."""
    out = {}
    for peer, m in members.items():
        a = m.assignment
        if a is not None and a.role == ROLE_SPOT_CHECK_VERIFIER:
            out[peer] = LayerRange(a.layer_start, a.layer_end) if a.layer_end > a.layer_start else None
    return out


def pick(verifiers: Mapping[PeerId, LayerRange | None], layers: LayerRange, excluded: set[PeerId],
         rng: random.Random) -> PeerId | None:
    """A verifier to ask next: random among those holding exactly `layers`, else random
    among the rest; None when every one is excluded (the audited stage, faulty ones,
    those already asked). `verifiers`: verifier-role node -> the slice it keeps warm."""
    left = sorted(p for p in verifiers if p not in excluded)  # sorted: the draw depends on rng alone
    holders = [p for p in left if verifiers[p] == layers]
    pool = holders or left
    return rng.choice(pool) if pool else None


def keeps_slice(reg: Register, layers: LayerRange) -> bool:
    return all(keeps(reg, i) for i in layers)


def candidates(registers: Mapping[PeerId, Register], layers: LayerRange, excluded: set[PeerId],
               on_probation: Callable[[PeerId], bool], verifying: Mapping[PeerId, LayerRange] = {},
               rng: random.Random | None = None) -> list[PeerId]:
    """The members to ask, in order: those keeping every layer of `layers`, not in
    `excluded` (the stage itself, faulty nodes, those asked already); off probation first
    (a newcomer vouching for a newcomer is the weaker word), then those holding exactly
    `layers` loaded (no load before the replay), then the one that last verified `layers`
    (`verifying`: verifier -> the slice it last verified: its verify slice is still
    loaded), then those verifying no other slice, then by peer id (deterministic), or in a
    random order drawn from `rng` when given (audits: which member answers is then
    unpredictable to the nodes, so a liar cannot count on a friend answering for it)."""
    found = sorted(p for p, reg in registers.items() if p not in excluded and keeps_slice(reg, layers))
    warm = {p for p in found if (registers[p].held_start, registers[p].held_end) == (layers.start, layers.end)}
    draw = {p: (rng.random() if rng is not None else 0.0) for p in found}
    return sorted(found, key=lambda p: (on_probation(p), p not in warm, verifying.get(p) != layers,
                                        p in verifying, draw[p], p))


def unverifiable(stages: Sequence[tuple[PeerId, LayerRange]], on_probation: Callable[[PeerId], bool],
                 registers: Mapping[PeerId, Register], excluded: set[PeerId],
                 gateway_can: Callable[[LayerRange], bool]) -> tuple[PeerId, ...]:
    """The stages on probation nothing trusted could check: the gateway cannot recompute
    their slice (`gateway_can`) and no trusted member (off probation, not `excluded`, not
    the stage) keeps every layer of it. Formation seats them only when no ring forms
    without them (coordinator.swarm.forming.prefer_verifiable)."""
    return tuple(p for p, layers in stages if on_probation(p) and not gateway_can(layers) and not any(
        q != p and q not in excluded and not on_probation(q) and keeps_slice(reg, layers) for q, reg in registers.items()))


def audit_order(verifiers: Mapping[PeerId, LayerRange | None], registers: Mapping[PeerId, Register],
                layers: LayerRange, excluded: set[PeerId], on_probation: Callable[[PeerId], bool],
                rng: random.Random) -> list[PeerId]:
    """Whom an audit asks to recompute `layers`, in order: the verifier-role nodes as `pick`
    draws them, then the other members keeping the slice (`candidates`, off probation
    first, random among equals). Never one in `excluded` (the audited stage, faulty
    nodes, those asked already)."""
    order, left = [], set(excluded)
    while (peer := pick(verifiers, layers, left, rng)) is not None:
        order.append(peer)
        left.add(peer)
    return order + candidates(registers, layers, left, on_probation, rng=rng)
