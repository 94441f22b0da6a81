"""The exhaustive oracle: every ordered subset of the pool, checked by brute force.

Independent of `select_ring`'s search (no Held-Karp, no bounds, no prefilter): it walks
every ordering of every admissible subset, and splits layers either with ring.alloc or,
with `enumerate_splits=True`, by trying every composition through `ring.evaluate` (which
shares nothing with the search but the cost model). Exponential: for tests and the
simulation's small pools only. Knows nothing of roles or churn.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Sequence

from ring.alloc import allocate
from ring.cost import NodeTerms, coordinator_sends, evaluate, max_layers
from ring.errors import InfeasibleError
from ring.network import Network, NodeInfo
from ring.plan import Plan, Stage
from ring.search import Constraints
from ring.spec import ModelSpec, Workload
from shard.layers import LayerRange


def _orders(nodes: Sequence[NodeInfo], network: Network, constraints: Constraints,
            limit: int) -> Iterator[tuple[float, tuple[int, ...]]]:
    """Every admissible ordering of every subset as (path latency, node indices), depth first."""
    n, coord = len(nodes), network.coordinator
    lat = [[network.link(a.peer, b.peer)[0] for b in nodes] for a in nodes]
    lat_in = [network.link(coord, a.peer)[0] for a in nodes]
    lat_out = [network.link(a.peer, coord)[0] for a in nodes]
    pinned = next((i for i, a in enumerate(nodes) if a.peer == constraints.pinned), None)
    trusted = [not constraints.trusted_ends or a.trusted for a in nodes]
    prefix: list[int] = []

    def extend(latency: float, used: set[int], subnets: set[str]) -> Iterator[tuple[float, tuple[int, ...]]]:
        last = prefix[-1]
        if trusted[last] and (pinned is None or pinned in used):
            yield latency + lat_out[last], tuple(prefix)
        if len(prefix) == limit:
            return
        for i in range(n):
            if i in used or (constraints.one_per_subnet and nodes[i].subnet in subnets):
                continue
            prefix.append(i)
            yield from extend(latency + lat[last][i], used | {i}, subnets | {nodes[i].subnet})
            prefix.pop()

    for first in range(n):
        if trusted[first]:
            prefix.append(first)
            yield from extend(lat_in[first], {first}, {nodes[first].subnet})
            prefix.pop()


def _compositions(total: int, parts: int, caps: Sequence[int]) -> Iterator[tuple[int, ...]]:
    for cuts in itertools.combinations(range(1, total), parts - 1):
        sizes = tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))
        if all(s <= c for s, c in zip(sizes, caps)):
            yield sizes


def oracle_ring(network: Network, model: ModelSpec, workload: Workload,
                constraints: Constraints = Constraints(), enumerate_splits: bool = False) -> Plan:
    """The plan with the lowest predicted total time over every admissible ring."""
    nodes = sorted((n for n in network.nodes if max_layers(n, model, workload) >= 1), key=lambda n: n.peer)
    limit = min(model.num_layers, constraints.max_stages or model.num_layers)
    if constraints.pinned is not None and constraints.pinned not in {n.peer for n in nodes}:
        raise InfeasibleError(f"pinned node {constraints.pinned} cannot hold one layer", len(network.nodes))
    coord_chunk_s, _ = coordinator_sends(network, model, workload)
    best: Plan | None = None
    path_cache: dict[tuple[frozenset[int], int], tuple[float, tuple[int, ...]]] = {}
    for latency, indices in _orders(nodes, network, constraints, limit):
        order = tuple(nodes[i] for i in indices)
        if enumerate_splits:
            caps = [max_layers(n, model, workload, head=i == 0) for i, n in enumerate(order)]
            for sizes in _compositions(model.num_layers, len(order), caps):
                plan = evaluate(_stages(order, sizes), network, model, workload)
                if best is None or plan.total_s < best.total_s:
                    best = plan
            continue
        # The split depends on the set and its head only (the head holds the embedding too),
        # latency on the order only: keep the best order of each set and head.
        key = (frozenset(indices), indices[0])
        if key not in path_cache or latency < path_cache[key][0]:
            path_cache[key] = (latency, indices)
    for _, indices in path_cache.values():
        order = tuple(nodes[i] for i in indices)
        terms = [NodeTerms.of(n, model, workload) for n in order]
        terms[0] = terms[0].as_head()
        alloc = allocate(terms, model.num_layers, workload.num_chunks - 1, coord_chunk_s)
        if alloc is None:
            continue
        plan = evaluate(_stages(order, alloc.layers), network, model, workload)
        if best is None or plan.total_s < best.total_s:
            best = plan
    if best is None:
        raise InfeasibleError("exhaustive search found no admissible ring", len(network.nodes))
    return best


def _stages(order: Sequence[NodeInfo], sizes: Sequence[int]) -> list[Stage]:
    stages, start = [], 0
    for node, size in zip(order, sizes):
        stages.append(Stage(node.peer, LayerRange(start, start + size)))
        start += size
    return stages
