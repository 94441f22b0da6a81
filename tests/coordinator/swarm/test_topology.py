"""Ring inputs built from registrations and probe reports (coordinator/swarm/topology.py), pure."""

from __future__ import annotations

import pytest

from coordinator.swarm import topology
from coordinator.swarm.topology import TopologyConfig, Traversal, TraversalLog
from ring import select_ring
from shard.layers import LayerRange
from shard.wire.messages import Register

COORD = "coord"


def _reg(peer: str, *, up: float = 12.5e6, addrs=("/ip4/127.0.0.1/tcp/1",), memory: int = 1 << 30,
         rtt_ms: dict | None = None) -> Register:
    return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=memory,
                    decode_s_per_layer=1e-3, prefill_s_per_layer_token=1e-5, upload_bytes_per_s=up,
                    download_bytes_per_s=5 * up, rtt_ms=rtt_ms or {}, listen_addrs=addrs)


def test_model_spec_charges_the_wire_dtype_and_fp32_kv(tiny_llama_store):
    # Bug guarded: activation bytes taken from the store dtype instead of the wire dtype
    # (fp8 would look 4x as costly as it is). Sound: wire_bytes_per_token's own figures.
    cfg = tiny_llama_store.config
    f32 = topology.model_spec(tiny_llama_store, "f32")
    fp8 = topology.model_spec(tiny_llama_store, "f8_e4m3fn")
    assert f32.activation_bytes_per_token == 4 * cfg.hidden_size
    assert fp8.activation_bytes_per_token == cfg.hidden_size + 4
    assert f32.num_layers == tiny_llama_store.num_layers
    assert f32.bytes_per_layer * f32.num_layers <= tiny_llama_store.layer_bytes(LayerRange(0, f32.num_layers))
    assert f32.kv_bytes_per_token_layer == 2 * cfg.num_kv_heads * cfg.head_dim * 4


def test_model_spec_counts_every_expert_of_an_moe_layer(tiny_model_factory, tiny_store_factory):
    # Bug guarded: the selector seating MoE layers as if they held only the k experts a
    # token runs (or none), so nodes are handed more layers than fit. Sound: a tiny
    # Mixtral's 4 experts of 3 (128 x 64) f32 matrices each are 393216 bytes per layer,
    # which the planner's bytes per layer must cover.
    store = tiny_store_factory(tiny_model_factory("mixtral", num_local_experts=4, num_experts_per_tok=2))
    spec = topology.model_spec(store, "f32")
    cfg = store.config
    assert spec.bytes_per_layer >= cfg.num_experts * 3 * cfg.hidden_size * cfg.expert_intermediate_size * 4 == 393216


@pytest.mark.parametrize("addrs, expected", [
    (("/ip4/1.1.1.7/tcp/4001",), "1.1.1.0/24"),
    (("/ip4/127.0.0.1/tcp/1", "/ip4/198.51.100.9/tcp/2"), "peer:p"),  # documentation range is not global
    (("/ip4/8.8.4.4/tcp/1",), "8.8.4.0/24"),
    (("/ip6/2001:4860::1/tcp/1",), "2001:4860::/48"),
    (("/ip4/192.168.1.5/tcp/1", "/dns4/example.org/tcp/1"), "peer:p"),
])
def test_subnet_of_groups_public_addresses_only(addrs, expected):
    # Bug guarded: every loopback/home-LAN node landing in one "subnet", which would let
    # one_per_subnet forbid any local ring of more than one stage.
    assert topology.subnet_of("p", addrs) == expected


def test_record_rtts_halves_round_trips_so_a_cycle_sums_exactly():
    # Bug guarded: charging a whole round trip per hop (doubling every ring's latency) or
    # dropping the coordinator's own emulated leg. Sound: with sender-side latencies L,
    # probe rtt(a, b) = L_a + L_b; a ring's one-way total is L_coord + sum(L_stage).
    lat = {"a": 0.010, "b": 0.030, "c": 0.005}
    coord_s = 0.020
    links: dict = {}
    for x in lat:
        # a node's Pong comes back unemulated on the control stream: rtt = L_x only
        links = topology.record_rtts(links, x, {COORD: lat[x] * 1e3}, COORD, coord_s)
    links = topology.record_rtts(links, "a", {"b": (lat["a"] + lat["b"]) * 1e3, "c": (lat["a"] + lat["c"]) * 1e3}, COORD)
    links = topology.record_rtts(links, "b", {"c": (lat["b"] + lat["c"]) * 1e3, "b": 99.0}, COORD)
    path = [COORD, "a", "b", "c", COORD]
    total = sum(links[(x, y)] for x, y in zip(path, path[1:]))
    assert total == pytest.approx(coord_s + sum(lat.values()))
    assert ("b", "b") not in links
    assert all(p != "b" for pair in topology.forget_peer(links, "b") for p in pair)


def test_build_network_marks_unmeasured_links_and_selects_around_a_slow_uplink():
    # Bug guarded: registrations not reaching the selector (uplinks ignored) or unknown
    # links passed off as measured. Sound: the slow node's uplink makes any ring with it
    # strictly slower, so the exact search must leave it out when memory allows.
    cfg = TopologyConfig(prompt_tokens=2048, output_tokens=16, prefill_chunk_tokens=256)
    regs = {p: _reg(p, rtt_ms={COORD: 10.0}) for p in ("a", "b", "c")}
    regs["c"] = _reg("c", up=50e3, rtt_ms={COORD: 10.0})
    links: dict = {}
    for p, r in regs.items():
        links = topology.record_rtts(links, p, r.rtt_ms, COORD)
    links = topology.record_rtts(links, "a", {"b": 10.0}, COORD)
    network = topology.build_network(COORD, regs, links, {"a": LayerRange(0, 2)}, cfg)
    assert network.link("a", "b") == (0.005, False)
    assert network.link("a", "c")[1] is True  # never probed: estimated via the coordinator
    assert network.node("a").held == LayerRange(0, 2) and network.node("b").held is None
    from ring import ModelSpec

    model = ModelSpec("m", 4, 1 << 20, 1024, 2048)
    plan = select_ring(network, model, cfg.workload())
    assert "c" not in plan.peers and "c" in plan.roles


def test_predictions_and_traversal_summary():
    # Bug guarded: a decode round predicted as a prefill (or the reverse), and summaries
    # mixing the two. Sound: medians of hand-made samples; predictions from ring.evaluate.
    cfg = TopologyConfig()
    regs = {"a": _reg("a", rtt_ms={COORD: 20.0})}
    links = topology.record_rtts({}, "a", {COORD: 20.0}, COORD)
    network = topology.build_network(COORD, regs, links, {}, cfg)
    from ring import ModelSpec, evaluate
    from ring.plan import Stage

    model = ModelSpec("m", 4, 1 << 20, 1024, 2048)
    plan = evaluate([Stage("a", LayerRange(0, 4))], network, model, cfg.workload())
    decode = topology.predict(plan, network, model, cfg, Traversal(1, False, 1, 1, 0.05, (0.004,)))
    prefill = topology.predict(plan, network, model, cfg, Traversal(1, True, 2, 512, 0.2, (0.01,)))
    assert decode.traversal_s == pytest.approx(0.020 + 2048 / 12.5e6 + 4 / 12.5e6 + 4 * 1e-3)
    assert decode.compute_s == (pytest.approx(4e-3),)
    assert prefill.traversal_s > decode.traversal_s and prefill.compute_s == (pytest.approx(4 * 1e-5 * 256),)
    log = TraversalLog(window=3)
    for s in (0.05, 0.07, 0.06, 0.08):
        log.add(Traversal(1, False, 1, 1, s, (0.004,)), decode)
    log.add(Traversal(1, True, 2, 512, 0.2, (0.01,)), prefill)
    summary = log.summary()
    assert summary["decode"]["rounds"] == 2 and summary["decode"]["measured_traversal_s"] == pytest.approx(0.07)
    assert summary["prefill"]["rounds"] == 1 and "measured_transport_s" not in summary["prefill"]
    assert summary["decode"]["measured_transport_s"] == pytest.approx(0.07 - 0.004)


def test_remembered_predictions_equal_fresh_ones_per_plan_and_shape():
    # Bug guarded: a remembered prediction served for another round shape (a prefill's for a
    # decode round, 2 frames' for 4) or for a re-formed ring's new plan. Sound: each answer
    # is compared with topology.predict itself.
    cfg = TopologyConfig()
    regs = {"a": _reg("a", rtt_ms={COORD: 20.0})}
    from ring import ModelSpec, evaluate
    from ring.plan import Stage

    model = ModelSpec("m", 4, 1 << 20, 1024, 2048)
    planned = []
    for rtt in (20.0, 80.0):
        network = topology.build_network(COORD, regs, topology.record_rtts({}, "a", {COORD: rtt}, COORD), {}, cfg)
        planned.append((evaluate([Stage("a", LayerRange(0, 4))], network, model, cfg.workload()), network))
    memo = topology.Predictions(size=3)
    shapes = [Traversal(1, False, 1, 1, 0.05, ()), Traversal(1, False, 1, 5, 0.05, ()),
              Traversal(1, True, 2, 512, 0.2, ()), Traversal(1, True, 4, 512, 0.2, ())]
    for _ in range(2):
        for p in planned:
            for t in shapes:
                assert memo.predict(p, model, cfg, t) == topology.predict(*p, model, cfg, t)
    assert len(memo._memo) <= 3
    assert memo.predict(planned[0], model, cfg, shapes[0]) is memo.predict(planned[0], model, cfg, shapes[0])
