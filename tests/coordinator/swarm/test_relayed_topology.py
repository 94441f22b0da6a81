"""Hops into nodes reached through a relay, as the cost model sees them (issue 19).

Bugs guarded: a relayed hop costed as a direct one (the selector then seats a NATed node
where every frame to it crosses the relay's uplink twice as far), the relay's upload not
shared by the hops through it, two NATed nodes counted as one subnet because their
circuits name the same relay's address. Sound: latencies are hand-made, so each expected
figure is the sum written next to it; the selector's choice is checked on a network
where only the order of otherwise identical nodes differs.
"""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.swarm import topology
from coordinator.swarm.topology import TopologyConfig
from ring import ModelSpec, select_ring
from shard.wire.messages import Register

COORD = "coord"
RELAYED = "/ip4/203.0.113.7/tcp/4001/p2p/coord/p2p-circuit/p2p/{}"


def _reg(peer: str, relayed: bool = False, up: float = 12.5e6) -> Register:
    addrs = (RELAYED.format(peer), "/ip4/192.168.1.2/tcp/5000") if relayed else ("/ip4/198.51.100.9/tcp/5000",)
    return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=1 << 30,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=up,
                    download_bytes_per_s=5 * up, listen_addrs=addrs)


def _links(pairs: dict[tuple[str, str], float]) -> dict:
    return {**pairs, **{(b, a): s for (a, b), s in pairs.items()}}


def test_relay_of_reads_the_circuit_a_node_advertises_first():
    assert topology.relay_of((RELAYED.format("n"), "/ip4/10.0.0.2/tcp/1")) == "coord"
    assert topology.relay_of(("/ip4/10.0.0.2/tcp/1", RELAYED.format("n"))) is None  # dialable first
    assert topology.relay_of(()) is None and topology.relay_of(("/ip4/10.0.0.2/tcp/1",)) is None
    assert topology.relay_of(("/p2p-circuit/p2p/n",)) is None  # a circuit naming no relay


def test_a_hop_into_a_relayed_node_costs_both_legs_and_the_shared_relay_upload():
    cfg = TopologyConfig(coordinator_upload_bytes_per_s=1e6)
    regs = {"a": _reg("a"), "n": _reg("n", relayed=True), "m": _reg("m", relayed=True)}
    links = _links({("a", COORD): 0.010, ("n", COORD): 0.020, ("m", COORD): 0.030, ("a", "n"): 0.001})
    out = topology.relayed_links(links, regs, COORD, cfg, round_bytes=5000)
    # two circuits share the coordinator's 1 MB/s: 5000 B * 2 / 1e6 = 10 ms each
    assert out[("a", "n")] == pytest.approx(0.010 + 0.020 + 0.010)  # the probe's 1 ms was not the relay's path
    assert out[("m", "n")] == pytest.approx(0.030 + 0.020 + 0.010)
    assert out[("n", "m")] == pytest.approx(0.020 + 0.030 + 0.010)
    assert out[(COORD, "n")] == 0.020 and out[("n", "a")] == 0.001  # its own connection; its own dial
    assert topology.relayed_links(links, {"a": _reg("a")}, COORD, cfg, 5000) == links


def test_relayed_nodes_are_not_one_subnet_because_they_share_a_relay():
    assert topology.subnet_of("n", _reg("n", relayed=True).listen_addrs) == "peer:n"
    assert topology.subnet_of("m", _reg("m", relayed=True).listen_addrs) == "peer:m"


def test_the_selector_seats_a_relayed_node_where_no_frame_crosses_the_relay():
    # Three identical nodes, each able to hold 3 of the 8 layers, so the ring needs all
    # three; n is behind a NAT, far from the coordinator (50 ms) and near a and b (1 ms,
    # as their probes measured it once hole-punched). As the head, n gets its frames from
    # the coordinator over its own connection and dials its successor itself: no hop is
    # relayed (71 ms around). In the middle, a's frames cross the relay: 10 + 50 ms legs
    # plus the relay's upload (81+ ms around). Costed as direct, the middle looks best
    # (22 ms around), which is what the selector picks for an n that can be dialled.
    cfg = TopologyConfig(prompt_tokens=64, output_tokens=32, prefill_chunk_tokens=64)
    model = ModelSpec("m", 8, 1 << 20, 1024, 2048)
    memory = 3 * model.layer_bytes_with_kv(cfg.workload().context_tokens, 0) + 1
    regs = {p: dataclasses.replace(_reg(p, relayed=(p == "n")), memory_bytes=memory) for p in ("a", "b", "n")}
    links = _links({(x, y): 0.010 for x in (*regs, COORD) for y in (*regs, COORD) if x < y})
    links.update(_links({(COORD, "n"): 0.050, ("a", "n"): 0.001, ("b", "n"): 0.001}))
    dialable = {**regs, "n": dataclasses.replace(regs["a"], peer_id="n")}
    plain = select_ring(topology.build_network(COORD, dialable, links, {}, cfg, model), model, cfg.workload())
    network = topology.build_network(COORD, regs, links, {}, cfg, model)
    plan = select_ring(network, model, cfg.workload())
    assert set(plan.peers) == {"a", "b", "n"} and plan.peers[0] == "n", plan.peers
    assert plain.peers[1] == "n", plain.peers
    assert [h.src for h in plan.hops if h.dst == "n"] == [COORD]
    assert network.link("a", "n")[0] == pytest.approx(0.010 + 0.050 + 5 * 2048 / cfg.coordinator_upload_bytes_per_s)


def test_a_hop_through_a_node_relay_costs_that_relays_legs_and_upload_not_the_coordinators():
    # A NATed node n advertising a circuit through the reachable node r first: a hop into
    # n is a's leg to r, r's leg to n, and a round on r's 2 MB/s upload, which only n's
    # circuit uses (m's is through the coordinator's 1 MB/s, shared with nobody). r itself
    # reaches n over n's own connection. The coordinator's legs to n are not the path.
    cfg = TopologyConfig(coordinator_upload_bytes_per_s=1e6)
    through_r = dataclasses.replace(_reg("n"), listen_addrs=("/ip4/198.51.100.5/tcp/5000/p2p/r/p2p-circuit/p2p/n",))
    regs = {"a": _reg("a"), "r": _reg("r", up=2e6), "n": through_r, "m": _reg("m", relayed=True)}
    links = _links({("a", "r"): 0.004, ("r", "n"): 0.006, ("a", COORD): 0.010, ("n", COORD): 0.020,
                    ("m", COORD): 0.030, ("r", COORD): 0.002, ("a", "n"): 0.001})
    assert topology.relay_of(through_r.listen_addrs) == "r"
    out = topology.relayed_links(links, regs, COORD, cfg, round_bytes=5000)
    assert out[("a", "n")] == pytest.approx(0.004 + 0.006 + 5000 / 2e6)
    assert out[("r", "n")] == 0.006  # the relay's own connection
    assert out[("a", "m")] == pytest.approx(0.010 + 0.030 + 5000 / 1e6)  # m's relay is the coordinator
    assert ("m", "n") not in out  # no leg m -> r measured: left to the latency estimate


def test_trusted_ends_seat_a_natted_node_in_the_middle_and_the_flag_parses():
    # Issue 19's "public head and tail, NATed middle": with the ends kept on trusted nodes
    # (they see token ids and final states), the NATed node can only be the middle stage,
    # and the hop into it is costed through the relay. Sound: the same network without
    # trusted peers seats n at the head (the test above), so the constraint is what moved it.
    from coordinator.swarm.formation import SwarmConfig
    from shard.options import add_options, config_from_args
    import argparse

    cfg = TopologyConfig(prompt_tokens=64, output_tokens=32, prefill_chunk_tokens=64, trusted_peers=("a", "b"))
    model = ModelSpec("m", 8, 1 << 20, 1024, 2048)
    memory = 3 * model.layer_bytes_with_kv(cfg.workload().context_tokens, 0) + 1
    regs = {p: dataclasses.replace(_reg(p, relayed=(p == "n")), memory_bytes=memory) for p in ("a", "b", "n")}
    links = _links({(x, y): 0.010 for x in (*regs, COORD) for y in (*regs, COORD) if x < y})
    network = topology.build_network(COORD, regs, links, {}, cfg, model)
    assert {n.peer for n in network.nodes if n.trusted} == {"a", "b"}
    from coordinator.swarm import formation
    snapshot = formation.Snapshot(COORD, regs, links, {}, {})
    decided = formation.decide(snapshot, frozenset(regs), SwarmConfig(topology=cfg),
                               formation.ModelIdentity(model, "d", "f32", None))
    assert [p for p, _ in decided.stages][1] == "n" and {p for p, _ in decided.stages} == {"a", "b", "n"}, decided
    parser = argparse.ArgumentParser()
    add_options(parser, SwarmConfig)
    parsed = config_from_args(SwarmConfig, parser.parse_args(["--trusted-peers", "a, b,"]))
    assert parsed.topology.trusted_peers == ("a", "b") and SwarmConfig().topology.trusted_peers == ()
