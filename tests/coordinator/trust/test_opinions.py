"""Choosing verifiers and settling their opinions (coordinator.trust.opinions, pure).

Guards: a verifier that agrees with the stage ends the audit (no extra cost on honest
rings); one verifier is never taken against the stage while a second can be asked; two
verifiers that disagree bring in a third; a liar is excluded only when outvoted; an
honest stage is never accused while honest verifiers outnumber liars among those asked;
the audited stage is never its own verifier and the draw is random among holders first;
past the verifier-role nodes an audit asks other members keeping the slice (issue 20).
"""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from coordinator.trust.opinions import Verdict, audit_order, need_another, pick, settle, settle_trusted, vouched
from ring import PeerId
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.wire.messages import Register

MAX = 3


def test_asking_stops_when_the_first_verifier_agrees():
    assert need_another([0], MAX)
    assert not need_another([0, 0], MAX)
    assert settle([0, 0]) == Verdict(False, (), True)


def test_a_verifier_against_the_stage_gets_a_second_opinion():
    assert need_another([0, 1], MAX)
    # The second agrees with the first: the stage is wrong, nobody lied.
    assert not need_another([0, 1, 1], MAX)
    assert settle([0, 1, 1]) == Verdict(True, (), True)


def test_verifiers_that_disagree_are_settled_by_a_third():
    assert need_another([0, 1, 0], MAX)  # the second sides with the stage
    assert settle([0, 1, 0, 0]) == Verdict(False, (1,), True)  # the first lied
    # A cheating stage whose lie a colluding second verifier repeats: two honest ones win.
    assert settle([0, 1, 0, 1]) == Verdict(True, (2,), True)
    assert not need_another([0, 1, 0, 0], MAX)


def test_with_no_third_verifier_the_stage_counts_as_an_opinion():
    """Only two verifiers exist: the second, siding with the stage, outvotes the first."""
    assert settle([0, 1, 0]) == Verdict(False, (1,), True)


def test_a_single_verifiers_word_stands_when_nobody_else_can_be_asked():
    assert settle([0, 1]) == Verdict(True, (), True)


def test_a_three_way_split_judges_the_stage_but_accuses_no_verifier():
    assert settle([0, 1, 2]) == Verdict(True, (), False)
    assert need_another([0, 1, 2], MAX)
    assert settle([0, 1, 2, 3]) == Verdict(True, (), False)


def opinion_ids(values: list[int]) -> list[int]:
    """Parties' opinions as the auditor numbers them: the index of the first party holding it."""
    first: dict[int, int] = {}
    return [first.setdefault(v, i) for i, v in enumerate(values)]


@given(st.lists(st.booleans(), min_size=MAX, max_size=MAX), st.booleans(), st.integers(0, 2**32))
def test_honest_majorities_are_never_overruled(liars, cheating, seed):
    """Ask verifiers in order until need_another says stop (or none is left). Honest ones
    compute the truth (value 0); liars each compute their own garbage, and a cheating
    stage claims value 1 (one liar may collude and claim 1 too). Whenever honest verifiers
    asked outnumber liars asked, the verdict on the stage is right and no honest verifier
    is accused."""
    rng = random.Random(seed)
    stage = 1 if cheating else 0
    values = [stage]
    for i, lies in enumerate(liars):
        if not need_another(opinion_ids(values), MAX):
            break
        values.append((1 if cheating and rng.random() < 0.5 else 10 + i) if lies else 0)
    ids = opinion_ids(values)
    verdict = settle(ids)
    asked = range(1, len(values))
    honest = [i for i in asked if not liars[i - 1]]
    if len(honest) > len(asked) - len(honest):
        assert verdict.stage_faulty == cheating
        assert not set(verdict.lying) & set(honest)


@given(st.lists(st.integers(0, 3), min_size=2, max_size=5))
def test_the_winner_is_a_held_opinion_and_liars_are_verifiers_outside_it(values):
    ids = opinion_ids(values)
    verdict = settle(ids)
    assert all(1 <= i < len(ids) for i in verdict.lying)
    if verdict.settled:
        counts = Counter(ids)
        held = [ids[i] for i in range(1, len(ids)) if i not in verdict.lying]
        winner = held[0] if held else ids[0]
        assert all(o == winner for o in held)
        assert verdict.stage_faulty == (ids[0] != winner)
        assert counts[winner] == max(counts.values())
    else:
        assert verdict.lying == ()


def test_pick_never_the_stage_prefers_holders_and_is_random_among_them():
    layers = LayerRange(0, 2)
    verifiers = {PeerId("a"): layers, PeerId("b"): layers, PeerId("c"): LayerRange(2, 4), PeerId("s"): layers,
                 PeerId("d"): None}
    drawn = Counter(pick(verifiers, layers, {PeerId("s")}, random.Random(i)) for i in range(200))
    assert set(drawn) == {"a", "b"} and min(drawn.values()) > 60
    # Holders used up: any other verifier (it loads the slice or says it cannot).
    assert pick(verifiers, layers, {PeerId("s"), PeerId("a"), PeerId("b")}, random.Random(0)) in {"c", "d"}
    assert pick(verifiers, layers, set(verifiers), random.Random(0)) is None
    assert pick({}, layers, set(), random.Random(0)) is None


def _member(peer: str, held: tuple[int, int] = (0, 0), stored: tuple[int, ...] = ()) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-4, upload_bytes_per_s=0.0,
                    download_bytes_per_s=0.0, held_start=held[0], held_end=held[1],
                    stored_files=tuple(layer_file(i) for i in stored))


def test_audits_ask_verifier_roles_first_then_any_member_keeping_the_slice():
    # Bug guarded (issue 20): on a layerless gateway whose ring has no verifier-role node
    # (every node a stage), every audit was skipped, so a stage that lied once off
    # probation was never checked again. Sound: each member differs from the next in one
    # property; the stage itself and faulty nodes keep the slice too and must not be asked.
    layers = LayerRange(1, 3)
    registers = {p: _member(p, held=(1, 3)) for p in ("stage", "faulty", "v", "newcomer", "m1", "m2")}
    registers["half"] = _member("half", held=(1, 2))  # keeps layer 1 only
    registers["stored"] = _member("stored", held=(3, 5), stored=(1, 2))  # the slice in its store
    verifiers = {PeerId("v"): None}
    excluded = {PeerId("stage"), PeerId("faulty")}
    orders = [audit_order(verifiers, registers, layers, excluded, lambda p: p == "newcomer", random.Random(i))
              for i in range(40)]
    for order in orders:
        assert order[0] == "v" and set(order[1:3]) == {"m1", "m2"} and order[3:] == ["stored", "newcomer"]
    assert {tuple(o[1:3]) for o in orders} == {("m1", "m2"), ("m2", "m1")}  # unpredictable among equals
    # No verifier role at all (the usual small swarm): the stages audit each other.
    stages = {p: _member(p, stored=(0, 1, 2, 3)) for p in ("a", "b", "c")}
    assert sorted(audit_order({}, stages, layers, {PeerId("b")}, lambda p: False, random.Random(0))) == ["a", "c"]
    assert audit_order({}, stages, layers, set(stages), lambda p: False, random.Random(0)) == []


def test_colluding_newcomers_cannot_outvote_a_trusted_verifier():
    # Bug guarded (issue 20): a lying stage (opinion 0) and its fresh friend (agreeing with
    # it) outvoting the one trusted verifier that disagreed, which settle alone would do
    # (two parties against one) and then blame the trusted node. Sound: the trusted
    # recomputation wins, the stage is faulty and the friend is named a liar.
    assert settle([0, 1, 0]) == Verdict(False, (1,), True)  # by numbers alone the trusted one loses
    assert settle_trusted([0, 1, 0], [False, True, False]) == Verdict(True, (2,), True)
    assert settle_trusted([0, 0, 1], [False, False, True]) == Verdict(True, (1,), True)
    # A trusted verifier agreeing with an honest stage outvotes a lying newcomer verifier.
    assert settle_trusted([0, 1, 0], [False, False, True]) == Verdict(False, (1,), True)
    # No trusted verifier: as settle (newcomers still catch each other's disagreement).
    assert settle_trusted([0, 1], [False, False]) == settle([0, 1]) == Verdict(True, (), True)


def test_only_a_trusted_verifier_agreeing_vouches_for_the_stage():
    # Bug guarded: a newcomer's agreement earning another newcomer credit (a sybil pair then
    # leaves probation having been checked only by each other).
    assert not vouched([0, 0], [False, False])
    assert vouched([0, 0], [False, True])
    assert not vouched([0, 1], [False, True])  # a trusted verifier against the stage
    assert vouched([0, 0, 1], [False, True, False]) and not vouched([0, 1, 0], [False, True, False])


@given(st.lists(st.tuples(st.integers(0, 2), st.booleans()), min_size=1, max_size=5))
def test_a_trusted_majority_decides_whatever_newcomers_say(parties):
    # Sound: over every small mix, whenever one opinion holds a strict majority of the
    # trusted verifiers and the stage is not in it, the stage is faulty; newcomers outside
    # the trusted winner are always among the liars.
    ids = [0] + [o for o, _ in parties]
    trusted = [False] + [t for _, t in parties]
    v = settle_trusted(ids, trusted)
    held = Counter(o for o, t in parties if t)
    if held:
        top, n = held.most_common(1)[0]
        if n > sum(held.values()) - n + (top != 0):  # the winner among stage + trusted verifiers
            assert v.settled and v.stage_faulty == (top != 0)
            assert set(v.lying) == {i for i in range(1, len(ids)) if ids[i] != top}
