"""Formation prefers rings whose newcomers something trusted can check (issue 20), pure.

coordinator.trust.opinions.unverifiable says which stages on probation neither the gateway
nor a trusted member keeping their slice could recompute; coordinator.swarm.forming's
prefer_verifiable forms without them when a ring still forms, and otherwise seats them
with a one-line note (GET /v1/ring's seated_unverified).
"""

from __future__ import annotations

from coordinator.swarm.formation import NoRing
from coordinator.swarm.forming import prefer_verifiable
from coordinator.trust.opinions import unverifiable
from shard.layers import LayerRange
from shard.manifest import layer_file
from shard.wire.messages import Register

A, B = LayerRange(0, 2), LayerRange(2, 4)


def _reg(peer: str, stored: tuple[int, ...]) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-4, upload_bytes_per_s=0.0,
                    download_bytes_per_s=0.0, held_start=0, held_end=0, stored_files=tuple(layer_file(i) for i in stored))


def test_a_newcomer_is_unverifiable_unless_the_gateway_or_a_trusted_member_keeps_its_slice():
    # Bug guarded: a newcomer counted as checkable because another newcomer (or a faulty
    # node, or itself) keeps its slice; or one the gateway can recompute counted as not.
    regs = {"old": _reg("old", (0, 1)), "new1": _reg("new1", (0, 1, 2, 3)), "new2": _reg("new2", (0, 1, 2, 3)),
            "bad": _reg("bad", (2, 3))}
    newcomer = lambda p: p != "old"  # noqa: E731 ("bad" too is on probation)
    never = lambda r: False  # noqa: E731 (a gateway holding no layer)
    stages = (("new1", A), ("new2", B))
    assert unverifiable(stages, newcomer, regs, set(), never) == ("new2",)  # "old" keeps A, nobody trusted keeps B
    assert unverifiable(stages, newcomer, regs, {"old"}, never) == ("new1", "new2")  # faulty vouches for nothing
    assert unverifiable(stages, {"new1", "new2"}.__contains__, regs, set(), never) == ()  # "bad" off probation keeps B
    assert unverifiable(stages, newcomer, regs, {"old"}, lambda r: r == B) == ("new1",)  # the gateway recomputes B
    assert unverifiable((("old", A),), newcomer, regs, set(), never) == ()  # off probation: nothing to check


def _decide(rings):
    """Formation as a table: the members offered -> the stages of the ring formed (or none)."""
    def decide(pool):
        stages = rings.get(pool)
        return NoRing(pool, "too few") if stages is None else type("F", (), {"stages": stages})()
    return decide


def test_a_ring_without_the_unverifiable_newcomer_is_preferred_when_one_forms():
    # Bug guarded: the unverifiable newcomer seated although a checkable ring formed
    # without it; or seated silently when none did.
    full, lean = (("t", A), ("x", B)), (("t", A), ("u", B))
    rings = {frozenset("txu"): full, frozenset("tu"): lean}
    check = lambda stages: tuple(p for p, _ in stages if p == "x")  # noqa: E731 (x: nothing trusted keeps its slice)
    got, note = prefer_verifiable(_decide(rings), frozenset("txu"), check)
    assert got.stages == lean and note is None
    # Without x no ring forms: x is seated, and the note names it.
    got, note = prefer_verifiable(_decide({frozenset("txu"): full}), frozenset("txu"), check)
    assert got.stages == full and "newcomer(s) x seated" in note and "\n" not in note
    # Nothing to prefer: no check, or a ring with nobody unverifiable.
    got, note = prefer_verifiable(_decide(rings), frozenset("txu"), None)
    assert got.stages == full and note is None
    got, note = prefer_verifiable(_decide({frozenset("tu"): lean}), frozenset("tu"), check)
    assert got.stages == lean and note is None
