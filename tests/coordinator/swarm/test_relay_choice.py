"""Relay-role nodes chosen for stages nobody can dial (coordinator/swarm/relay_choice.py).

Bugs guarded: the relay role was never given (the gateway relayed every hop, its uplink
shared by all of them); a relay chosen for the head (whose frames come from the
coordinator over its own connection); a NATed, slow or standby node made a relay; the
plan's hop still costed through the gateway after a relay was chosen; a stage not told
where to reserve, or its predecessor not told to dial it through its relay; a relay that
moves on noise (each move re-forms the ring). Sound: latencies are hand-made, so each
expected figure is the sum written next to it.
"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.swarm import formation, relay_choice, topology
from coordinator.swarm.formation import ModelIdentity, RingState, Snapshot, SwarmConfig
from coordinator.swarm.topology import TopologyConfig
from ring import ModelSpec, PeerId, Role, RoleKind, Stage, evaluate
from shard.layers import LayerRange
from shard.wire.messages import Register

COORD = PeerId("coord")
MODEL = ModelSpec("m", num_layers=4, bytes_per_layer=1 << 20, kv_bytes_per_token_layer=1024,
                  activation_bytes_per_token=256)
CFG = TopologyConfig(prompt_tokens=64, output_tokens=16, prefill_chunk_tokens=64)
ROUND_BYTES = topology.round_bytes(CFG, MODEL)  # 5 tokens x 256 B


def _reg(peer: str, natted: bool = False, up: float = 12.5e6) -> Register:
    own = f"/ip4/198.51.100.{len(peer) + 10}/tcp/5000/p2p/{peer}"
    addrs = (f"/ip4/203.0.113.7/tcp/4001/p2p/{COORD}/p2p-circuit/p2p/{peer}", own) if natted else (own,)
    return Register(peer_id=peer, model="m", manifest_digest="digest", device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=up,
                    download_bytes_per_s=5 * up, listen_addrs=addrs)


def _links(pairs: dict[tuple[str, str], float]) -> dict:
    return {**pairs, **{(b, a): s for (a, b), s in pairs.items()}}


def _plan(regs: dict, links: dict, stages: list[tuple[str, int, int]], roles: dict | None = None):
    network = topology.build_network(COORD, regs, links, {}, CFG, MODEL)
    plan = evaluate([Stage(PeerId(p), LayerRange(a, b)) for p, a, b in stages], network, MODEL, CFG.workload())
    return dataclasses.replace(plan, roles=roles or {}), network


# a (public head) -> n (NATed); r, s spares. The gateway is 40 ms from n; r is 2 ms from both.
REGS = {"a": _reg("a"), "n": _reg("n", natted=True), "r": _reg("r"), "s": _reg("s")}
LINKS = _links({("a", COORD): 0.010, ("n", COORD): 0.040, ("r", COORD): 0.010, ("s", COORD): 0.010,
                ("a", "r"): 0.002, ("r", "n"): 0.002, ("a", "s"): 0.003, ("s", "n"): 0.003, ("a", "n"): 0.050})
STAGES = [("a", 0, 2), ("n", 2, 4)]


def test_a_dialable_spare_near_both_ends_relays_for_the_natted_stage_and_the_hop_is_costed_through_it():
    plan, network = _plan(REGS, LINKS, STAGES)
    assert network.link("a", "n")[0] == pytest.approx(0.010 + 0.040 + ROUND_BYTES / CFG.coordinator_upload_bytes_per_s)
    relays = relay_choice.choose_relays(plan, REGS, LINKS, COORD, CFG, ROUND_BYTES)
    assert relays == {"n": "r"}  # r: 2 + 2 ms legs; s: 3 + 3 ms; the gateway: 10 + 40 ms
    replanned, renet = relay_choice.through(plan, network, relays, REGS, LINKS, CFG, MODEL, CFG.workload())
    assert renet.link("a", "n")[0] == pytest.approx(0.002 + 0.002 + ROUND_BYTES / 12.5e6)
    hop = next(h for h in replanned.hops if (h.src, h.dst) == ("a", "n"))
    assert hop.latency_s == pytest.approx(0.004 + ROUND_BYTES / 12.5e6)
    assert replanned.total_s < plan.total_s
    assert replanned.roles["r"].kind is RoleKind.RELAY and "n" in replanned.roles["r"].reason
    assert "s" not in replanned.roles


def test_the_head_needs_no_relay_and_the_gateway_keeps_a_hop_it_serves_much_better():
    plan, _ = _plan(REGS, LINKS, [("n", 0, 2), ("a", 2, 4)])
    assert relay_choice.choose_relays(plan, REGS, LINKS, COORD, CFG, ROUND_BYTES) == {}  # n is the head
    far = {**LINKS, **_links({("a", "r"): 0.060, ("a", "s"): 0.060})}  # both spares 62+ ms against the gateway's 50
    plan, _ = _plan(REGS, far, STAGES)
    assert relay_choice.choose_relays(plan, REGS, far, COORD, CFG, ROUND_BYTES) == {}
    close = {**LINKS, **_links({("a", "r"): 0.052, ("a", "s"): 0.052})}  # 54 ms: within the 5 ms margin
    assert relay_choice.choose_relays(plan, REGS, close, COORD, CFG, ROUND_BYTES) == {"n": "r"}


def test_natted_slow_standby_and_on_ring_nodes_are_no_relays():
    regs = {**REGS, "r": _reg("r", natted=True), "s": _reg("s", up=0.5e6)}
    plan, _ = _plan(regs, LINKS, STAGES)
    assert relay_choice.choose_relays(plan, regs, LINKS, COORD, CFG, ROUND_BYTES) == {}
    plan, _ = _plan(REGS, LINKS, STAGES, roles={PeerId("r"): Role(RoleKind.HOT_STANDBY, "x", 1),
                                                PeerId("s"): Role(RoleKind.HOT_STANDBY, "x", 0)})
    assert relay_choice.choose_relays(plan, REGS, LINKS, COORD, CFG, ROUND_BYTES) == {}
    links = {**LINKS, **_links({("r", "s"): 0.003})}
    three, _ = _plan(REGS, links, [("a", 0, 1), ("r", 1, 2), ("n", 2, 4)])
    assert relay_choice.choose_relays(three, REGS, links, COORD, CFG, ROUND_BYTES) == {"n": "s"}  # r is a stage


def test_a_relay_in_force_stays_within_the_margin_and_shared_relays_split_their_upload():
    plan, _ = _plan(REGS, LINKS, STAGES)
    assert relay_choice.choose_relays(plan, REGS, LINKS, COORD, CFG, ROUND_BYTES, in_force={"n": "s"}) == {"n": "s"}
    moved = {**LINKS, **_links({("a", "s"): 0.020})}  # s now 23 ms against r's 4: it moves
    assert relay_choice.choose_relays(plan, REGS, moved, COORD, CFG, ROUND_BYTES, in_force={"n": "s"}) == {"n": "r"}
    # Two NATed stages behind one slow relay: the second pays for both circuits on its upload.
    regs = {**REGS, "m": _reg("m", natted=True), "r": _reg("r", up=2e6), "s": _reg("s", up=2e6)}
    links = {**LINKS, **_links({("n", "r"): 0.002, ("r", "m"): 0.002, ("n", "s"): 0.003, ("s", "m"): 0.003,
                                ("m", COORD): 0.040})}
    plan, _ = _plan(regs, links, [("a", 0, 1), ("n", 1, 2), ("m", 2, 4)])
    # n: r (4 ms + 0.64 ms); m: r would cost 4 + 1.28 ms, s 6 + 0.64 ms: r again
    assert relay_choice.choose_relays(plan, regs, links, COORD, CFG, ROUND_BYTES) == {"n": "r", "m": "r"}


def test_addresses_name_the_relay_for_the_stage_and_its_predecessor():
    assert relay_choice.relay_addrs(PeerId("r"), REGS) == REGS["r"].listen_addrs
    assert relay_choice.relay_addrs(None, REGS) == () and relay_choice.relay_addrs(PeerId("gone"), REGS) == ()
    addrs = relay_choice.successor_addrs(PeerId("n"), PeerId("r"), REGS, 16)
    assert addrs == (f"{REGS['r'].listen_addrs[0]}/p2p-circuit/p2p/n", *REGS["n"].listen_addrs)
    assert relay_choice.successor_addrs(PeerId("n"), None, REGS, 16) == REGS["n"].listen_addrs


def test_formation_names_the_relay_in_the_assignments_and_keeps_the_ring_while_it_stays():
    # Sound: the ring is forced (a and n can each hold 2 of 4 layers, r and s none; n's own
    # dial to a is 80 ms, so n as the head costs 40 + 80 + 10 ms against 10 + 50 + 40), so
    # only the relay decision is under test.
    cfg = SwarmConfig(topology=CFG)
    memory = 2 * MODEL.layer_bytes_with_kv(CFG.workload().context_tokens, 0) + 1
    regs = {p: dataclasses.replace(r, memory_bytes=memory if p in ("a", "n") else 1) for p, r in REGS.items()}
    identity = ModelIdentity(MODEL, "digest", "f32", None)
    snap = Snapshot(COORD, regs, {**LINKS, **_links({("a", "n"): 0.080})}, {}, {}, epoch=3)
    f = formation.decide(snap, frozenset(regs), cfg, identity)
    assert [p for p, _ in f.stages] == ["a", "n"], f
    head, natted = f.assignments
    assert natted.relay_addrs == regs["r"].listen_addrs and head.relay_addrs == ()
    assert head.successor_addrs[0] == f"{regs['r'].listen_addrs[0]}/p2p-circuit/p2p/n"
    assert {a.peer_id: (a.role, a.relay_for) for a in f.roles}["r"] == ("relay", ("n",))
    assert [a.relay_for for a in f.assignments] == [(), ()]
    ring = RingState(f.epoch, f.stages, f.assignments)
    again = formation.decide(dataclasses.replace(snap, ring=ring, plan=f.plan, epoch=f.epoch), frozenset(regs), cfg,
                             identity)
    assert not again.new_ring and again.epoch == f.epoch  # the same relay: no new epoch


def test_a_stage_relays_when_no_spare_can_and_pays_one_more_share_of_its_upload():
    # a -> n (NATed) -> b, no spares: b, a stage but not one of the hop's ends, relays for n
    # (2 + 2 ms against the gateway's 10 + 40). With a spare as near, the spare wins: the
    # stage's upload also carries its own activations.
    regs = {p: r for p, r in REGS.items() if p in ("a", "n")} | {"b": _reg("b")}
    links = _links({("a", COORD): 0.010, ("n", COORD): 0.040, ("b", COORD): 0.010, ("a", "b"): 0.002,
                    ("b", "n"): 0.002, ("a", "n"): 0.050})
    plan, network = _plan(regs, links, [("a", 0, 1), ("n", 1, 2), ("b", 2, 4)])
    relays = relay_choice.choose_relays(plan, regs, links, COORD, CFG, ROUND_BYTES)
    assert relays == {"n": "b"}
    replanned, _ = relay_choice.through(plan, network, relays, regs, links, CFG, MODEL, CFG.workload())
    assert "b" not in replanned.roles  # a stage keeps its stage; relay_for tells it to relay
    assert relay_choice.relay_for(PeerId("b"), relays) == ("n",) and relay_choice.relay_for(PeerId("a"), relays) == ()
    slow = {**regs, "b": _reg("b", up=1.25e6), "s": _reg("s", up=1.25e6)}  # a round's 1280 B: ~1 ms a share
    both = {**links, **_links({("a", "s"): 0.002, ("s", "n"): 0.002, ("s", COORD): 0.010})}
    plan, _ = _plan(slow, both, [("a", 0, 1), ("n", 1, 2), ("b", 2, 4)])
    assert relay_choice.choose_relays(plan, slow, both, COORD, CFG, ROUND_BYTES) == {"n": "s"}
