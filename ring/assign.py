"""Which registered node serves which layers: the split used when forming a ring.

Pure: node registrations in, an ordered list of (peer id, LayerRange) out. Layers are
shared in proportion to measured decode speed (speeds within the measurement's noise of
each other count as one: `speed_bands`), limited by each node's memory, and the
order is deterministic (sorted peer ids) so the same pool always gives the same ring.
Used only when every node must be a stage (SwarmConfig.planner "all_nodes": tests of
multi-stage behaviour, demos); the default planner is ring.select_ring, which chooses
fewer stages whenever hops cost more than they save. It does not talk to nodes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ring.errors import AssignError
from shard.layers import LayerRange

# Measured speeds within this factor of each other are taken as one (speed_bands): three
# identical local-ring processes measuring at once on a loaded 2-core machine read decode
# 0.60-0.79 ms per layer (CPU time; wall time swung 0.51-1.47), and splitting by those
# figures cut 30 layers 7/13/10 among processes of one machine.
SPEED_TOLERANCE = 1.5


def speed_bands(seconds: Sequence[float], tolerance: float = SPEED_TOLERANCE) -> list[float]:
    """Each figure (seconds per unit of work, smaller is faster) replaced by its band's:
    from the fastest figure not yet in a band, a band holds every figure within
    `tolerance` times it, and all of them take the band's slowest (a node is never planned
    faster than it measured). Figures further apart than `tolerance` stay apart: a node 2x
    slower keeps its own figure. tolerance 1 leaves every figure as it is."""
    if tolerance < 1:
        raise ValueError(f"speed tolerance must be >= 1, got {tolerance}")
    out = list(seconds)
    order = sorted(range(len(out)), key=lambda i: out[i])
    start = 0
    while start < len(order):
        end = start
        while end < len(order) and out[order[end]] <= out[order[start]] * tolerance:
            end += 1
        slowest = out[order[end - 1]]
        for i in order[start:end]:
            out[i] = slowest
        start = end
    return out


@dataclass(frozen=True)
class Capacity:
    peer_id: str
    memory_bytes: int
    decode_s_per_layer: float


def split_by_capacity(nodes: Sequence[Capacity], num_layers: int, bytes_per_layer: int,
                      speed_tolerance: float = SPEED_TOLERANCE) -> list[tuple[str, LayerRange]]:
    """Give every node at least one layer, the rest in proportion to speed (1/decode time,
    banded by `speed_bands`), never more layers than a node's memory holds. Raises
    AssignError when impossible."""
    if not nodes:
        raise AssignError("no nodes registered")
    nodes = sorted(nodes, key=lambda n: n.peer_id)[:num_layers]
    cap = [max(0, n.memory_bytes // max(bytes_per_layer, 1)) for n in nodes]
    if sum(cap) < num_layers or min(cap) < 1:
        raise AssignError(f"{len(nodes)} nodes can hold {sum(cap)} of {num_layers} layers "
                          f"({bytes_per_layer} bytes each)")
    speed = [1.0 / max(s, 1e-9) for s in speed_bands([n.decode_s_per_layer for n in nodes], speed_tolerance)]
    total = sum(speed)
    # Largest-remainder apportionment of num_layers by speed, then clamp to memory and
    # hand the overflow to the nodes with spare room (fastest first).
    quota = [num_layers * s / total for s in speed]
    counts = [max(1, min(c, int(q))) for q, c in zip(quota, cap)]
    order = sorted(range(len(nodes)), key=lambda i: (-(quota[i] - int(quota[i])), -speed[i], nodes[i].peer_id))
    while sum(counts) < num_layers:
        for i in order:
            if sum(counts) < num_layers and counts[i] < cap[i]:
                counts[i] += 1
    while sum(counts) > num_layers:
        i = max((i for i in range(len(nodes)) if counts[i] > 1), key=lambda i: (counts[i] - quota[i], nodes[i].peer_id))
        counts[i] -= 1
    plan, start = [], 0
    for node, count in zip(nodes, counts):
        plan.append((node.peer_id, LayerRange(start, start + count)))
        start += count
    return plan
