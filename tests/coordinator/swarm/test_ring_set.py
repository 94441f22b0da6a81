"""Several rings over one pool (coordinator/swarm/ring_set.py): pure, no streams, no keys."""

from __future__ import annotations

import dataclasses

from coordinator.swarm import ring_set
from coordinator.swarm.formation import ModelIdentity, NoRing, RingState, Snapshot, SwarmConfig
from coordinator.swarm.ring_set import Current, RingsDecision
from ring import ModelSpec, PeerId, RoleKind
from shard.wire.messages import Register
from shard.wire.roles import ROLE_STAGE

COORD = PeerId("coord")
MODEL = ModelSpec("m", num_layers=4, bytes_per_layer=1 << 20, kv_bytes_per_token_layer=1024,
                  activation_bytes_per_token=256)
IDENTITY = ModelIdentity(MODEL, "digest", "f32", None)
LAYER = MODEL.layer_bytes_with_kv(SwarmConfig().topology.workload().context_tokens)
HALF, WHOLE = 2 * LAYER + LAYER // 2, 4 * LAYER + LAYER // 2  # memory for 2 layers / the whole model


def _reg(peer: str, memory: int = HALF) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="digest", device="cpu", memory_bytes=memory,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=12.5e6,
                    download_bytes_per_s=6.25e7, listen_addrs=(f"/ip4/127.0.0.1/tcp/{len(peer)}", f"/dns/{peer}"))


def _snapshot(regs: list[Register], epoch: int = 0) -> Snapshot:
    return Snapshot(COORD, {PeerId(r.peer_id): r for r in regs}, {}, {}, {}, epoch=epoch)


def _decide(snapshot: Snapshot, current=None, members=None, **config) -> RingsDecision | NoRing:
    members = frozenset(members if members is not None else snapshot.registrations)
    return ring_set.decide_rings(snapshot, members, SwarmConfig(**config), IDENTITY, current or {})


def _formed(decision: RingsDecision, kept: dict[int, Current] | None = None) -> dict[int, Current]:
    """The rings a swarm holds once every ring of `decision` acknowledged."""
    out = {rid: (kept or {})[rid] for rid in decision.kept}
    for rid, f in decision.formed:
        plan = decision.primary_plan if rid == decision.primary else f.plan
        out[rid] = Current(RingState(f.epoch, f.stages, f.assignments, rid), plan, f.network)
    return out


def _check(decision: RingsDecision) -> None:
    """Disjoint rings, each a whole chain [0, L) with its own unique epoch; roles off every ring."""
    seen: set[str] = set()
    epochs = [f.epoch for _, f in decision.formed]
    assert len(set(epochs)) == len(epochs) and all(e <= decision.epoch for e in epochs)
    for _, f in decision.formed:
        peers = {p for p, _ in f.stages}
        assert not peers & seen
        seen |= peers
        assert f.stages[0][1].start == 0 and f.stages[-1][1].end == MODEL.num_layers
        assert all(a.role == ROLE_STAGE and a.epoch == f.epoch for a in f.assignments)
    assert not {a.peer_id for a in decision.roles} & seen


def test_one_ring_by_default_and_roles_for_the_rest():
    # Bug guarded: a default that changes the single ring every deployment runs today.
    d = _decide(_snapshot([_reg(p) for p in "abcdef"], epoch=3))
    assert isinstance(d, RingsDecision) and [rid for rid, _ in d.formed] == [0] and d.kept == ()
    _check(d)
    assert d.formed[0][1].epoch == 4 and len(d.formed[0][1].stages) == 2
    assert len(d.roles) == 4 and all(a.epoch == d.epoch == 5 for a in d.roles)


def test_six_half_model_nodes_make_two_rings_and_keep_two_spares():
    # The pool: 6 nodes, each holding half the model. Three rings would fit, but
    # the first ring keeps one hot standby per stage, so two form.
    d = _decide(_snapshot([_reg(p) for p in "abcdef"], epoch=3), max_rings=4)
    assert isinstance(d, RingsDecision)
    _check(d)
    assert [rid for rid, _ in d.formed] == [0, 1] and [f.epoch for _, f in d.formed] == [4, 5]
    assert all(len(f.stages) == 2 for _, f in d.formed)
    kinds = sorted(a.role for a in d.roles)
    assert kinds == [RoleKind.HOT_STANDBY.value] * 2 and d.epoch == 6
    # With no spares asked for, the third ring forms too.
    d3 = _decide(_snapshot([_reg(p) for p in "abcdef"]), max_rings=4, ring_spares=0)
    assert isinstance(d3, RingsDecision) and len(d3.formed) == 3 and d3.roles == ()
    _check(d3)


def test_a_whole_model_node_is_a_one_stage_ring():
    d = _decide(_snapshot([_reg("a"), _reg("b"), _reg("w", WHOLE), _reg("x"), _reg("y")]), max_rings=3, ring_spares=0)
    assert isinstance(d, RingsDecision)
    _check(d)
    stage_sets = sorted(tuple(p for p, _ in f.stages) for _, f in d.formed)
    assert ("w",) in stage_sets and len(d.formed) == 3


def test_max_rings_bounds_the_count():
    d = _decide(_snapshot([_reg(p) for p in "abcdefgh"]), max_rings=2, ring_spares=0)
    assert isinstance(d, RingsDecision) and len(d.formed) == 2 and len(d.roles) == 4


def test_a_joining_node_keeps_every_running_ring_and_a_new_ring_forms_beside_them():
    # Bug guarded: a join re-forming a running ring (every job re-prefills). Sound: the
    # second decision runs on the first one's outcome with two more nodes.
    snap = _snapshot([_reg(p) for p in "abcd"], epoch=1)
    first = _decide(snap, max_rings=4)
    assert isinstance(first, RingsDecision) and len(first.formed) == 1  # 4 nodes: one ring and its 2 standbys
    rings = _formed(first)
    grown = dataclasses.replace(_snapshot([_reg(p) for p in "abcdefg"]), epoch=first.epoch)
    second = _decide(grown, rings, max_rings=4)
    assert isinstance(second, RingsDecision)
    _check(second)
    assert second.kept == (0,) and [rid for rid, _ in second.formed] == [1]
    assert second.formed[0][1].epoch == first.epoch + 1  # newer than anything handed out
    assert not {p for p, _ in second.formed[0][1].stages} & ring_set.peers_of(rings[0].ring)
    # Nothing changed: every ring kept, nothing formed.
    third = _decide(dataclasses.replace(grown, epoch=second.epoch), _formed(second, rings), max_rings=4)
    assert isinstance(third, RingsDecision) and third.kept == (0, 1) and third.formed == ()


def test_a_ring_that_breaks_re_forms_alone():
    snap = _snapshot([_reg(p) for p in "abcdef"], epoch=0)
    first = _decide(snap, max_rings=4)
    rings = _formed(first)
    victim = rings[1].ring.stages[0][0]
    members = set(snap.registrations) - {victim}
    d = _decide(dataclasses.replace(snap, epoch=first.epoch), rings, members=members, max_rings=4)
    assert isinstance(d, RingsDecision)
    _check(d)
    assert d.kept == (0,) and [rid for rid, _ in d.formed] == [1] and d.dropped == ()
    survivor = rings[1].ring.stages[1][0]
    assert survivor in {p for p, _ in d.formed[0][1].stages}  # re-selection keeps the survivor's slice
    assert d.formed[0][1].epoch == first.epoch + 1


def test_a_broken_ring_without_free_nodes_is_dropped_and_the_others_serve():
    snap = _snapshot([_reg(p) for p in "abcd"], epoch=0)
    first = _decide(snap, max_rings=2, ring_spares=0)
    assert isinstance(first, RingsDecision) and len(first.formed) == 2
    rings = _formed(first)
    victim = rings[0].ring.stages[0][0]
    d = _decide(dataclasses.replace(snap, epoch=first.epoch), rings, members=set(snap.registrations) - {victim},
                max_rings=2, ring_spares=0)
    assert isinstance(d, RingsDecision) and d.kept == (1,) and d.formed == () and [r for r, _ in d.dropped] == [0]
    assert d.primary == 1
    # Nothing at all: NoRing with a reason.
    none = _decide(_snapshot([_reg("a", 0)]), max_rings=2)
    assert isinstance(none, NoRing) and none.reason
