"""Measured speeds within the measurement's noise count as one (ring.assign.speed_bands),
in the capacity split a local ring uses and in the selector's network (issue 21)."""

from __future__ import annotations

import pytest

from coordinator.swarm import topology
from coordinator.swarm.topology import TopologyConfig
from ring import Capacity, speed_bands, split_by_capacity
from shard.wire.messages import Register

GB = 1 << 30


def _counts(decode_s: list[float], layers: int = 30, **kw) -> list[int]:
    nodes = [Capacity(f"n{i}", GB, s) for i, s in enumerate(decode_s)]
    return [len(r) for _, r in split_by_capacity(nodes, layers, 1 << 20, **kw)]


def test_noise_between_identical_nodes_splits_evenly():
    # Bug guarded: three processes of one machine, measuring at once, read 1.3x apart and
    # the split followed the noise (a demo cut 7/13/10). Sound: the figures measured for
    # identical local-ring nodes at load 8 (ms per layer); the old rule (tolerance 1) gives
    # the fastest-reading node more layers, the banded one 10 each.
    noisy = [0.79e-3, 0.60e-3, 0.68e-3]
    assert _counts(noisy, speed_tolerance=1.0) == [9, 11, 10]
    assert _counts(noisy) == [10, 10, 10]


def test_genuinely_different_nodes_keep_their_shares():
    # Bug guarded: banding that evens out real differences. Sound: a node 2x slower than
    # another (beyond the 1.5x tolerance) gets half its layers, as before; a node 4x
    # faster than two equal ones gets 4/6 of the model.
    assert _counts([1e-3, 2e-3]) == [20, 10]
    assert _counts([1e-3, 4e-3, 4e-3]) == [20, 5, 5]


def test_bands_take_their_slowest_and_start_at_the_fastest():
    # Sound: bands are measured from their fastest figure, not chained (1.0, 1.4, 1.9
    # would chain into one band 1.9x wide), and take the slowest figure (never planned
    # faster than measured); order of the input is kept.
    assert speed_bands([1.9, 1.0, 1.4], 1.5) == [1.9, 1.4, 1.4]
    assert speed_bands([3.0, 1.0, 2.0], 1.5) == [3.0, 1.0, 3.0]  # 1.0 alone; 2.0 and 3.0 within 1.5x
    assert speed_bands([1.0, 1.5, 1.5], 1.5) == [1.5, 1.5, 1.5]
    assert speed_bands([1.0, 1.2], 1.0) == [1.0, 1.2]
    assert speed_bands([]) == []
    with pytest.raises(ValueError, match="tolerance"):
        speed_bands([1.0], 0.5)


def test_selector_network_bands_decode_and_prefill_separately():
    # Bug guarded: the selector's network seating noise as speed (more layers on the node
    # that happened to measure fastest). Sound: decode figures 1.3x apart become one,
    # prefill figures 3x apart stay apart; TopologyConfig(speed_tolerance=1) keeps all.
    def reg(peer: str, decode_s: float, prefill_s: float) -> Register:
        return Register(peer_id=peer, model="m", manifest_digest="d", device="cpu", memory_bytes=GB,
                        decode_s_per_layer=decode_s, prefill_s_per_layer_token=prefill_s, upload_bytes_per_s=12.5e6,
                        download_bytes_per_s=50e6, rtt_ms={}, listen_addrs=("/ip4/127.0.0.1/tcp/1",))

    regs = {"a": reg("a", 0.6e-3, 50e-6), "b": reg("b", 0.78e-3, 150e-6)}
    net = topology.build_network("coord", regs, {}, {}, TopologyConfig())
    assert net.node("a").decode_s_per_layer_token == net.node("b").decode_s_per_layer_token == 0.78e-3
    assert (net.node("a").prefill_s_per_layer_token, net.node("b").prefill_s_per_layer_token) == (50e-6, 150e-6)
    raw = topology.build_network("coord", regs, {}, {}, TopologyConfig(speed_tolerance=1.0))
    assert raw.node("a").decode_s_per_layer_token == 0.6e-3
