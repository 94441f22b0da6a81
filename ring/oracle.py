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


def _orders(nodes: Sequence[NodeInfo], constraints: Constraints, limit: int) -> Iterator[tuple[NodeInfo, ...]]:
    """Every admissible ordered subset, depth first."""
    def extend(prefix: list[NodeInfo], subnets: set[str]) -> Iterator[tuple[NodeInfo, ...]]:
        if prefix:
            yield tuple(prefix)
        if len(prefix) == limit:
            return
        for node in nodes:
            if node in prefix or (constraints.one_per_subnet and node.subnet in subnets):
                continue
            if not prefix and constraints.trusted_ends and not node.trusted:
                continue
            prefix.append(node)
            yield from extend(prefix, subnets | {node.subnet})
            prefix.pop()

    for order in extend([], set()):
        if constraints.trusted_ends and not order[-1].trusted:
            continue
        if constraints.pinned is not None and constraints.pinned not in {n.peer for n in order}:
            continue
        yield order


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
    coord_chunk_s, _ = coordinator_sends(network, model, workload)
    best: Plan | None = None
    path_cache: dict[frozenset, tuple[float, tuple[NodeInfo, ...]]] = {}
    for order in _orders(nodes, constraints, limit):
        if enumerate_splits:
            caps = [max_layers(n, model, workload) for n in order]
            for sizes in _compositions(model.num_layers, len(order), caps):
                plan = evaluate(_stages(order, sizes), network, model, workload)
                if best is None or plan.total_s < best.total_s:
                    best = plan
            continue
        # Split depends on the set only, latency on the order only: keep each set's best order.
        latency = sum(network.link(a, b)[0] for a, b in zip(
            (network.coordinator, *(n.peer for n in order)), (*(n.peer for n in order), network.coordinator)))
        key = frozenset(n.peer for n in order)
        if key not in path_cache or latency < path_cache[key][0]:
            path_cache[key] = (latency, order)
    for _, order in path_cache.values():
        terms = [NodeTerms.of(n, model, workload) for n in order]
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
