"""A restarted coordinator re-forms the warm ring with every node on the slice it holds
(coordinator/swarm/formation.py: warm_plan, rejoining, held_ring; issue 19).

Bugs guarded: a hot standby holding the same slice as a stage, with the lower peer id,
was seated in the stage's place (the stage left idle, the standby logging a new slice);
a ring formed as soon as a standby and the other stages had re-registered, before the
stage itself was back; the restarted coordinator gave the spare no role, so the next
re-selection could make it load another slice. Sound: the registrations say who held
what as a stage (Register.held_role), and each decision is read off the plan returned.
"""

from __future__ import annotations

import dataclasses

from coordinator.swarm import formation
from coordinator.swarm.formation import ModelIdentity, Snapshot, SwarmConfig
from ring import ModelSpec, PeerId, RoleKind
from shard.layers import LayerRange
from shard.wire.messages import Register

COORD = PeerId("coord")
MODEL = ModelSpec("m", num_layers=4, bytes_per_layer=1 << 20, kv_bytes_per_token_layer=1024,
                  activation_bytes_per_token=256)
CONFIG = SwarmConfig()
MEMORY = 2 * MODEL.layer_bytes_with_kv(CONFIG.topology.workload().context_tokens, 0) + 1  # half the model each


def _reg(peer: str, held: tuple[int, int], role: str) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="digest", device="cpu", memory_bytes=MEMORY,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=12.5e6,
                    download_bytes_per_s=62.5e6, listen_addrs=(f"/ip4/127.0.0.1/tcp/{len(peer)}",),
                    held_epoch=7, held_start=held[0], held_end=held[1], held_role=role)


# "a" is the standby of stage 0 and has the lowest peer id; "s0" and "s1" were the stages.
REGS = {PeerId("a"): _reg("a", (0, 2), "hot_standby"), PeerId("s0"): _reg("s0", (0, 2), "stage"),
        PeerId("s1"): _reg("s1", (2, 4), "stage")}


def _snapshot(regs) -> Snapshot:
    held = {p: LayerRange(r.held_start, r.held_end) for p, r in regs.items()}
    return Snapshot(COORD, regs, {}, held, {}, epoch=7)


def test_the_stage_keeps_its_slice_and_the_standby_its_role_after_a_restart():
    snap = _snapshot(REGS)
    f = formation.decide(snap, frozenset(REGS), CONFIG, ModelIdentity(MODEL, "digest", "f32", None))
    assert f.stages == (("s0", LayerRange(0, 2)), ("s1", LayerRange(2, 4))), f.stages
    role = f.plan.roles["a"]
    assert role.kind is RoleKind.HOT_STANDBY and role.stage_index == 0  # the slice it holds: no reload
    assert [(a.peer_id, a.role, a.layer_start, a.layer_end) for a in f.roles] == [("a", "hot_standby", 0, 2)]


def test_a_restarted_coordinator_waits_for_the_stages_not_for_a_standby_standing_in():
    early = {p: r for p, r in REGS.items() if p != "s0"}  # the standby and stage 1 are back first
    assert formation.rejoining(_snapshot(early), frozenset(early), MODEL)
    assert not formation.rejoining(_snapshot(REGS), frozenset(REGS), MODEL)
    # Once the wait is over (the swarm forms anyway), the standby's warm slice fills the gap.
    plan = formation.warm_plan(_snapshot(early).held, frozenset(early),
                               formation.topology.build_network(COORD, early, {}, {}, CONFIG.topology, MODEL), MODEL,
                               CONFIG.topology.workload(), formation.stage_holders(early))
    assert [s.peer for s in plan.stages] == ["a", "s1"]


def test_held_ring_prefers_the_named_holder_then_the_lower_peer_id():
    held = {PeerId("a"): LayerRange(0, 2), PeerId("b"): LayerRange(0, 2), PeerId("c"): LayerRange(2, 4)}
    members = frozenset(held)
    assert [p for p, _ in formation.held_ring(held, members, 4)] == ["a", "c"]
    assert [p for p, _ in formation.held_ring(held, members, 4, {PeerId("b")})] == ["b", "c"]
    assert formation.held_ring({p: r for p, r in held.items() if p != "c"}, members, 4) is None
    roles = {p: dataclasses.replace(r, held_role="") for p, r in REGS.items()}
    assert formation.stage_holders(roles) == frozenset() and formation.stage_holders(REGS) == {"s0", "s1"}
