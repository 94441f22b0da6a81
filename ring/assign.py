"""Which registered node serves which layers: the split used when forming a ring.

Pure: node registrations in, an ordered list of (peer id, LayerRange) out. Layers are
shared in proportion to measured decode speed, limited by each node's memory, and the
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


@dataclass(frozen=True)
class Capacity:
    peer_id: str
    memory_bytes: int
    decode_s_per_layer: float


def split_by_capacity(nodes: Sequence[Capacity], num_layers: int, bytes_per_layer: int) -> list[tuple[str, LayerRange]]:
    """Give every node at least one layer, the rest in proportion to speed (1/decode time),
    never more layers than a node's memory holds. Raises AssignError when impossible."""
    if not nodes:
        raise AssignError("no nodes registered")
    nodes = sorted(nodes, key=lambda n: n.peer_id)[:num_layers]
    cap = [max(0, n.memory_bytes // max(bytes_per_layer, 1)) for n in nodes]
    if sum(cap) < num_layers or min(cap) < 1:
        raise AssignError(f"{len(nodes)} nodes can hold {sum(cap)} of {num_layers} layers "
                          f"({bytes_per_layer} bytes each)")
    speed = [1.0 / max(n.decode_s_per_layer, 1e-9) for n in nodes]
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
