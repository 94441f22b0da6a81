"""The cost model: hand-checked numbers and the invariants the search relies on."""

import pytest

from ring import (InvalidInputError, LatencyMatrix, ModelSpec, Network, NodeInfo, PeerId, Stage, UnknownPeerError,
                  Workload, evaluate)
from ring.cost import NodeTerms, coordinator_sends
from shard.layers import LayerRange

C, A, B = PeerId("c"), PeerId("a"), PeerId("b")
MODEL = ModelSpec("m", 4, bytes_per_layer=100, kv_bytes_per_token_layer=1, activation_bytes_per_token=1000)


def _net(up_a=1e6, up_b=1e6, memory=10_000):
    nodes = (NodeInfo(A, memory, 0.01, 0.001, up_a, 1e7, "x"), NodeInfo(B, memory, 0.01, 0.001, up_b, 1e7, "y"))
    lat = LatencyMatrix({(C, A): 0.01, (A, B): 0.02, (B, C): 0.03, (A, C): 0.5})
    return Network(C, nodes, lat, coordinator_upload_bytes_per_s=4e6)


def test_two_stage_numbers_by_hand():
    # Bug guarded: hop costs charged to the receiver's uplink, or the pipeline makespan
    # charging every chunk the full traversal. Sound: every term recomputed by hand.
    workload = Workload(prompt_tokens=1000, output_tokens=11, prefill_chunk_tokens=500, round_tokens=2,
                        expected_tokens_per_traversal=2.0)
    plan = evaluate([Stage(A, LayerRange(0, 1)), Stage(B, LayerRange(1, 4))], _net(up_b=2e6), MODEL, workload)
    latency = 0.01 + 0.02 + 0.03
    coord_chunk, a_compute, a_send = 500 * 4 / 4e6, 1 * 0.001 * 500, 500 * 1000 / 1e6
    b_compute, b_send = 3 * 0.001 * 500, 500 * 1000 / 2e6
    resources = [coord_chunk, a_compute, a_send, b_compute, b_send]
    assert plan.ttft_s == pytest.approx(latency + sum(resources) + 1 * max(resources))
    step = latency + 2 * 4 / 4e6 + 2 * 1000 / 1e6 + 2 * 1000 / 2e6 + 4 * 0.01 * 2
    assert plan.decode_step_s == pytest.approx(step)
    assert plan.total_s == pytest.approx(plan.ttft_s + 5 * step)
    assert [h.src for h in plan.hops] == [C, A, B] and plan.hops[2].chunk_send_s == pytest.approx(b_send)
    assert plan.bottleneck_s == pytest.approx(max(resources))


def test_node_terms_regroup_evaluate_exactly():
    # Bug guarded: the search optimising a different objective than evaluate reports.
    workload = Workload(3000, 50, prefill_chunk_tokens=512)
    net = _net(up_a=3e5)
    plan = evaluate([Stage(B, LayerRange(0, 3)), Stage(A, LayerRange(3, 4))], net, MODEL, workload)
    tb, ta = NodeTerms.of(net.node(B), MODEL, workload), NodeTerms.of(net.node(A), MODEL, workload)
    coord_chunk, coord_round = coordinator_sends(net, MODEL, workload)
    rounds = workload.decode_traversals
    latency = sum(h.latency_s for h in plan.hops)
    regrouped = ((1 + rounds) * latency + coord_chunk + rounds * coord_round + tb.fixed_s + ta.fixed_s
                 + 3 * tb.per_layer_s + ta.per_layer_s
                 + (workload.num_chunks - 1) * max(coord_chunk, tb.chunk_send_s, ta.chunk_send_s,
                                                   3 * tb.chunk_per_layer_s, ta.chunk_per_layer_s))
    assert plan.total_s == pytest.approx(regrouped, rel=1e-12)


def test_unknown_links_are_estimated_and_marked():
    # Bug guarded: a missing measurement silently read as 0 s. Sound: B->A is absent and
    # its reverse is known; C->B is absent and goes through the coordinator's own links.
    net = _net()
    assert net.link(A, B) == (0.02, False)
    assert net.link(B, A) == (0.02, True)
    assert net.link(C, B) == (0.03, True)  # reverse of B->C
    lonely = LatencyMatrix({}, unknown_s=0.2)
    assert lonely.get(A, B, via=C) == (0.2, True)
    plan = evaluate([Stage(B, LayerRange(0, 4))], net, MODEL, Workload(10, 2))
    assert plan.hops[0].latency_estimated and not plan.hops[1].latency_estimated


@pytest.mark.parametrize("stages, message", [
    ([Stage(A, LayerRange(0, 2))], "ends at 2, model has 4"),
    ([Stage(A, LayerRange(0, 2)), Stage(B, LayerRange(3, 4))], "b starts at 3, expected 2"),
    ([Stage(A, LayerRange(0, 2)), Stage(A, LayerRange(2, 4))], "a peer appears twice"),
])
def test_bad_rings_are_rejected_with_exact_text(stages, message):
    with pytest.raises(InvalidInputError) as err:
        evaluate(stages, _net(), MODEL, Workload(10, 2))
    assert err.value.value == message


def test_memory_and_unknown_peers_rejected():
    with pytest.raises(InvalidInputError, match="cannot hold 4 layers"):
        evaluate([Stage(A, LayerRange(0, 4))], _net(memory=300), MODEL, Workload(10, 2))
    with pytest.raises(UnknownPeerError):
        evaluate([Stage(PeerId("zz"), LayerRange(0, 4))], _net(), MODEL, Workload(10, 2))


def test_a_node_holding_smaller_layers_seats_more_and_the_ring_needs_fewer_stages():
    """Guards the quantised node's report (Register.bytes_per_layer): the memory check and
    the search count its own bytes per layer, so 4x smaller layers fit 4x as many, and a
    ring that needed two stages of f32 layers fits in one quantised node."""
    from dataclasses import replace

    from ring import select_ring
    from ring.cost import max_layers

    work = Workload(10, 2)
    per_layer = MODEL.layer_bytes_with_kv(work.context_tokens)  # 100 weights + 12 KV
    f32 = NodeInfo(A, 2 * per_layer, 0.01, 0.001, 1e6, 1e7, "x")
    quantised = replace(f32, bytes_per_layer=25)  # 25 + 12 per layer: 6 fit, the model's 4 cap it
    assert max_layers(f32, MODEL, work) == 2 and max_layers(quantised, MODEL, work) == 4
    lat = LatencyMatrix({(C, A): 0.01, (A, B): 0.01, (B, C): 0.01, (A, C): 0.01})
    pool = (f32, replace(f32, peer=B, subnet="y"))
    assert len(select_ring(Network(C, pool, lat, 4e6), MODEL, work).stages) == 2
    pool = (quantised, replace(f32, peer=B, subnet="y"))
    plan = select_ring(Network(C, pool, lat, 4e6), MODEL, work)
    assert [(s.peer, len(s.layers)) for s in plan.stages] == [(A, 4)]
    with pytest.raises(InvalidInputError):
        replace(f32, bytes_per_layer=-1)


def test_the_head_stage_seats_its_layers_beside_the_embedding():
    """Guards ModelSpec.head_bytes: the head stage holds the token embedding as well as its
    layers, so its node seats fewer of them there, and a node with no room for the
    embedding is never the head. Before, one node with memory for every layer (but not the
    embedding too) was planned as a one-stage ring, and the selector took the nearest path's
    head whether or not the embedding fitted there."""
    from dataclasses import replace

    from ring import InvalidInputError, Stage, evaluate, select_ring
    from ring.cost import max_layers
    from shard.layers import LayerRange

    work = Workload(10, 2)
    per_layer = MODEL.layer_bytes_with_kv(work.context_tokens)
    model = replace(MODEL, head_bytes=per_layer + 1)  # a layer's worth and a byte
    big = NodeInfo(A, MODEL.num_layers * per_layer, 0.01, 0.001, 1e6, 1e7, "x")  # every layer, not the embedding too
    small = NodeInfo(B, 2 * per_layer, 0.01, 0.001, 1e6, 1e7, "y")  # two layers, no room for the embedding too
    assert max_layers(big, model, work) == 4 and max_layers(big, model, work, head=True) == 2
    assert max_layers(small, model, work, head=True) == 0
    # The shortest path over both starts at the small node (C -> B -> A -> C).
    lat = LatencyMatrix({(C, B): 0.001, (B, A): 0.001, (A, C): 0.001, (C, A): 0.001, (A, B): 0.05, (B, C): 0.05})
    network = Network(C, (big, small), lat)
    alone = select_ring(network, MODEL, work)
    assert [(s.peer, len(s.layers)) for s in alone.stages] == [(A, 4)]  # no embedding counted: one stage
    plan = select_ring(network, model, work)
    assert [(s.peer, len(s.layers)) for s in plan.stages] == [(A, 2), (B, 2)]
    with pytest.raises(InvalidInputError, match="token embedding"):
        evaluate([Stage(A, LayerRange(0, 4))], network, model, work)
