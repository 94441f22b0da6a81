"""Synthetic pools for simulation and tests: hardware, uplinks and latencies drawn from
stated distributions (sources in docs/topology.md), seeded and reproducible.

Knows nothing of selection; it only produces `Network`s as the coordinator would see them.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from ring.network import LatencyMatrix, Network, NodeInfo, PeerId
from ring.spec import ModelSpec

MBIT = 1e6 / 8  # bytes per second in one Mbit/s
GB = 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_bytes: float
    memory_bytes_per_s: float  # decode is bound by reading the weights once per round
    flops_per_s: float  # effective fp16 throughput during prefill (about half of peak)


# Memory and bandwidth from vendor datasheets; effective FLOP/s taken as ~50% of dense fp16 peak.
HARDWARE = {
    "H100": Hardware("H100", 80 * GB, 3350 * GB, 400e12),
    "A100": Hardware("A100", 80 * GB, 2039 * GB, 150e12),
    "L4": Hardware("L4", 24 * GB, 300 * GB, 60e12),
    "RTX4090": Hardware("RTX4090", 24 * GB, 1008 * GB, 80e12),
    "RTX3090": Hardware("RTX3090", 24 * GB, 936 * GB, 35e12),
    "A6000": Hardware("A6000", 48 * GB, 768 * GB, 75e12),
    "RTX4070": Hardware("RTX4070", 12 * GB, 504 * GB, 29e12),
    "RTX3060": Hardware("RTX3060", 12 * GB, 360 * GB, 13e12),
    "RTX3070": Hardware("RTX3070", 8 * GB, 448 * GB, 20e12),
    "CPU": Hardware("CPU", 16 * GB, 40 * GB, 0.5e12),
}

# Approximate one-way latencies between region centres, seconds (half of typical RTTs).
REGIONS = ("us-east", "us-west", "eu-west", "eu-central", "asia-east")
_REGION_RTT_MS = {
    ("us-east", "us-west"): 65, ("us-east", "eu-west"): 75, ("us-east", "eu-central"): 90,
    ("us-east", "asia-east"): 180, ("us-west", "eu-west"): 140, ("us-west", "eu-central"): 150,
    ("us-west", "asia-east"): 110, ("eu-west", "eu-central"): 20, ("eu-west", "asia-east"): 220,
    ("eu-central", "asia-east"): 200,
}


def region_one_way_s(a: str, b: str) -> float:
    rtt_ms = 2.0 if a == b else _REGION_RTT_MS.get((a, b), _REGION_RTT_MS.get((b, a)))
    return rtt_ms / 2e3


@dataclass(frozen=True)
class PoolKind:
    """A population of volunteers: hardware mix, uplink and last-mile distributions."""

    name: str
    hardware: tuple[tuple[str, float], ...]  # (HARDWARE key, weight)
    fiber_share: float  # symmetric 300-1000 Mbit/s
    upload_median_mbit: float  # log-normal body for everyone else
    upload_sigma: float
    upload_range_mbit: tuple[float, float]
    last_mile_s: tuple[float, float]  # one-way access latency, uniform range
    trusted_share: float
    shared_subnet_share: float  # nodes behind the same /24 as an earlier node
    donated_share: tuple[float, float]  # share of device memory a volunteer lends, uniform range


KINDS = {
    "datacenter": PoolKind("datacenter", (("H100", 1), ("A100", 2), ("L4", 2)), 1.0, 10_000, 0.0,
                           (1_000, 25_000), (0.0002, 0.001), 1.0, 0.0, (0.9, 0.9)),
    "prosumer": PoolKind("prosumer", (("RTX4090", 3), ("RTX3090", 3), ("A6000", 1)), 0.3, 100, 0.8,
                         (20, 1_000), (0.002, 0.008), 0.2, 0.05, (0.4, 0.9)),
    "residential": PoolKind("residential", (("RTX3060", 3), ("RTX4070", 2), ("RTX3070", 2), ("RTX3090", 1),
                                            ("CPU", 1)), 0.15, 15, 0.9, (1, 100), (0.005, 0.020), 0.1, 0.1, (0.3, 0.8)),
}
MIXES = {"datacenter": {"datacenter": 1.0}, "prosumer": {"prosumer": 1.0}, "residential": {"residential": 1.0},
         "volunteer": {"datacenter": 0.05, "prosumer": 0.25, "residential": 0.70}}


def node_speeds(hardware: Hardware, model: ModelSpec) -> tuple[float, float]:
    """(decode, prefill) seconds per layer per token for this model on this hardware."""
    params = model.bytes_per_layer / 2  # fp16 weights
    decode_s = model.bytes_per_layer / hardware.memory_bytes_per_s + 20e-6  # + kernel launches
    prefill_s = 2 * params / hardware.flops_per_s
    return decode_s, prefill_s


def generate_pool(mix: str, size: int, model: ModelSpec, seed: int, full_matrix_max: int = 64,
                  peers_measured: int = 24) -> Network:
    """A pool of `size` nodes from the named mix; the coordinator sits in eu-west.

    Pools up to `full_matrix_max` nodes have every link measured; larger ones measure the
    coordinator and `peers_measured` random peers each, the rest is estimated.
    """
    rng = random.Random(f"{mix}/{size}/{model.name}/{seed}")
    kinds = sorted(MIXES[mix].items())
    nodes, regions, last_mile = [], {}, {}
    coordinator = PeerId("coordinator")
    regions[coordinator], last_mile[coordinator] = "eu-west", 0.0005
    subnets: list[str] = []
    for i in range(size):
        kind = KINDS[rng.choices([k for k, _ in kinds], [w for _, w in kinds])[0]]
        hardware = HARDWARE[rng.choices([h for h, _ in kind.hardware], [w for _, w in kind.hardware])[0]]
        if rng.random() < kind.fiber_share:
            up_mbit = rng.uniform(300, 1000) if kind.name != "datacenter" else kind.upload_median_mbit
            down_mbit = max(up_mbit, 1000)
        else:
            low, high = kind.upload_range_mbit
            up_mbit = min(high, max(low, rng.lognormvariate(math.log(kind.upload_median_mbit), kind.upload_sigma)))
            down_mbit = min(1000, up_mbit * rng.uniform(5, 15))  # cable/DSL are asymmetric
        if subnets and rng.random() < kind.shared_subnet_share:
            subnet = rng.choice(subnets)
        else:
            subnet = f"10.{i // 256}.{i % 256}.0/24"
            subnets.append(subnet)
        peer = PeerId(f"n{i:04d}")
        decode_s, prefill_s = node_speeds(hardware, model)
        memory_bytes = int(hardware.memory_bytes * rng.uniform(*kind.donated_share))
        nodes.append(NodeInfo(peer, memory_bytes, decode_s, prefill_s,
                              up_mbit * MBIT, down_mbit * MBIT, subnet, rng.random() < kind.trusted_share))
        regions[peer] = rng.choice(REGIONS)
        last_mile[peer] = rng.uniform(*kind.last_mile_s)
    peers = [coordinator] + [n.peer for n in nodes]

    def one_way(a: PeerId, b: PeerId) -> float:
        return (region_one_way_s(regions[a], regions[b]) + last_mile[a] + last_mile[b]) * rng.uniform(0.95, 1.05)

    measured: dict[tuple[PeerId, PeerId], float] = {}
    for peer in peers[1:]:
        measured[(coordinator, peer)] = one_way(coordinator, peer)
        measured[(peer, coordinator)] = one_way(peer, coordinator)
    if size <= full_matrix_max:
        pairs = [(a, b) for a in peers[1:] for b in peers[1:] if a != b]
    else:
        pairs = [(a, b) for a in peers[1:] for b in rng.sample(peers[1:], peers_measured) if a != b]
    for a, b in pairs:
        measured[(a, b)] = one_way(a, b)
    return Network(coordinator, tuple(nodes), LatencyMatrix(measured), coordinator_upload_bytes_per_s=100 * MBIT)


SMOLLM2_135M = ModelSpec.llama_like("SmolLM2-135M", num_layers=30, hidden=576, kv_heads=3, head_dim=64,
                                    params_per_layer=3_540_000)
LLAMA_8B = ModelSpec.llama_like("Llama-8B", num_layers=32, hidden=4096, kv_heads=8, head_dim=128,
                                params_per_layer=218_100_000)
