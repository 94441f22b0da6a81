"""`select_ring`: the ring (nodes, order, layer split) that minimises predicted request time.

Small pools are searched exactly: one Held-Karp pass gives the lowest-latency order of
every subset of candidates at once (order only affects latency, see ring.cost), and
ring.alloc gives each subset's optimal layer split. Subsets are visited in order of a
lower bound, so most are never split. Large pools are prefiltered by a per-layer score,
searched exactly over the best few, then improved by swap/insert/drop local search.

Determinism: candidates are sorted by peer id before anything else, so floating-point
sums happen in the same order whatever the input order; costs are compared after rounding
to `cost_quantum_s`, and ties go to the lexicographically smallest ring of peer ids.
Knows nothing of how measurements were made or what happens to the plan afterwards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

from ring.alloc import Allocation, allocate
from ring.cost import NodeTerms, coordinator_sends, evaluate
from ring.errors import InfeasibleError, InvalidInputError
from ring.network import Network, NodeInfo, PeerId
from ring.plan import Plan, Stage
from ring.roles import assign_roles
from ring.spec import ModelSpec, Workload
from shard.layers import LayerRange


@dataclass(frozen=True)
class Constraints:
    """What a ring must satisfy, and how hard to search for it."""

    pinned: PeerId | None = None  # this node must be a stage (e.g. the operator's own box)
    trusted_ends: bool = False  # head and tail see token ids / final states: trusted nodes only
    one_per_subnet: bool = True
    max_stages: int | None = None
    upload_aware: bool = True  # False: choose as if uplinks were infinite (a baseline)
    exact_max_nodes: int = 9  # pools up to this size are searched exactly
    local_search_candidates: int = 24  # outsiders tried by the large-pool local search
    cost_quantum_s: float = 1e-6

    def __post_init__(self) -> None:
        if self.exact_max_nodes < 1 or self.exact_max_nodes > 14:
            raise InvalidInputError("exact_max_nodes (1..14)", self.exact_max_nodes)
        if self.max_stages is not None and self.max_stages < 1:
            raise InvalidInputError("max_stages", self.max_stages)


@dataclass(frozen=True)
class Choice:
    """A candidate ring in search space: node indices in ring order and their layer counts."""

    key: tuple[int, tuple[PeerId, ...]]  # (quantised cost, peers in ring order): smaller wins
    order: tuple[int, ...]
    layers: tuple[int, ...]


class Problem:
    """The pool reduced to numbers, with nodes in canonical (peer id) order."""

    def __init__(self, network: Network, model: ModelSpec, workload: Workload, constraints: Constraints) -> None:
        self.network, self.model, self.workload, self.constraints = network, model, workload, constraints
        self.nodes: list[NodeInfo] = sorted(network.nodes, key=lambda n: n.peer)
        self.terms = [NodeTerms.of(n, model, workload) for n in self.nodes]
        coord_chunk_s, coord_round_s = coordinator_sends(network, model, workload)
        self.rounds = workload.decode_traversals
        self.floor_s = coord_chunk_s
        self.constant_s = coord_chunk_s + self.rounds * coord_round_s
        self.extra_chunks = workload.num_chunks - 1
        coord = network.coordinator
        self.lat_in = [network.link(coord, n.peer)[0] for n in self.nodes]
        self.lat_out = [network.link(n.peer, coord)[0] for n in self.nodes]
        self._lat: dict[tuple[int, int], float] = {}
        self._alloc: dict[tuple[int, ...], Allocation | None] = {}
        max_stages = constraints.max_stages or model.num_layers
        self.max_stages = min(max_stages, model.num_layers)

    def lat(self, i: int, j: int) -> float:
        value = self._lat.get((i, j))
        if value is None:
            value = self._lat[(i, j)] = self.network.link(self.nodes[i].peer, self.nodes[j].peer)[0]
        return value

    def path_latency(self, order: Sequence[int]) -> float:
        total = self.lat_in[order[0]]
        for a, b in zip(order, order[1:]):
            total += self.lat(a, b)
        return total + self.lat_out[order[-1]]

    def can_end(self, i: int) -> bool:
        return not self.constraints.trusted_ends or self.nodes[i].trusted

    def allocation(self, members: Sequence[int], head: int) -> Allocation | None:
        """The best split over `members` (in sorted order) with `head` holding the embedding too."""
        key = (*sorted(members), head)
        if key not in self._alloc:
            terms = [self.terms[i].as_head() if i == head else self.terms[i] for i in key[:-1]]
            self._alloc[key] = allocate(terms, self.model.num_layers, self.extra_chunks, self.floor_s)
        return self._alloc[key]

    def choice(self, order: Sequence[int]) -> Choice | None:
        """Cost a ring given in order; None if it breaks a constraint or cannot hold the model."""
        if not order or len(order) > self.max_stages or not (self.can_end(order[0]) and self.can_end(order[-1])):
            return None
        if self.constraints.one_per_subnet and len({self.nodes[i].subnet for i in order}) < len(order):
            return None
        alloc = self.allocation(order, order[0])
        if alloc is None:
            return None
        cost = ((1 + self.rounds) * self.path_latency(order) + self.constant_s
                + sum(self.terms[i].fixed_s for i in sorted(order)) + alloc.cost_s)
        by_index = dict(zip(sorted(order), alloc.layers))
        peers = tuple(self.nodes[i].peer for i in order)
        return Choice((round(cost / self.constraints.cost_quantum_s), peers), tuple(order), tuple(by_index[i] for i in order))

    def exact(self, candidates: Sequence[int], required: int | None) -> Choice | None:
        """Best ring using a subset of `candidates` (which must include `required`)."""
        cands = sorted(candidates)
        n = len(cands)
        subnet_bit: dict[str, int] = {}
        subnet_of = [1 << subnet_bit.setdefault(self.nodes[c].subnet, len(subnet_bit)) for c in cands]
        inf = math.inf
        size = 1 << n
        dp = [[inf] * n for _ in range(size)]
        parent = [[-1] * n for _ in range(size)]
        subnets = [0] * size
        for j, c in enumerate(cands):
            subnets[1 << j] = subnet_of[j]
            if self.can_end(c):
                dp[1 << j][j] = self.lat_in[c]
        for mask in range(1, size):
            if mask & (mask - 1):
                low = mask & -mask
                rest = subnets[mask ^ low]
                bit = subnet_of[low.bit_length() - 1]
                subnets[mask] = -1 if rest == -1 or (self.constraints.one_per_subnet and rest & bit) else rest | bit
            if subnets[mask] == -1 or mask.bit_count() >= self.max_stages:
                continue
            row = dp[mask]
            for j in range(n):
                here = row[j]
                if here == inf:
                    continue
                for k in range(n):
                    if mask >> k & 1:
                        continue
                    nxt = mask | 1 << k
                    value = here + self.lat(cands[j], cands[k])
                    if value < dp[nxt][k]:
                        dp[nxt][k], parent[nxt][k] = value, j
        bounds = []
        for mask in range(1, size):
            if subnets[mask] == -1 or mask.bit_count() > self.max_stages:
                continue
            members = [cands[j] for j in range(n) if mask >> j & 1]
            if required is not None and required not in members:
                continue
            closing = [(dp[mask][j] + self.lat_out[cands[j]], j) for j in range(n)
                       if mask >> j & 1 and dp[mask][j] < inf and self.can_end(cands[j])]
            if not closing or sum(self.terms[c].cap_layers for c in members) < self.model.num_layers:
                continue
            # Every closing node, not only the nearest: its path starts at another head, and
            # where the nearest path's head cannot hold the embedding another's may.
            bounds += [(self._lower_bound(members, latency), mask, last) for latency, last in closing]
        bounds.sort()
        best: Choice | None = None
        best_cost = inf
        for bound, mask, last in bounds:
            if bound > best_cost + self.constraints.cost_quantum_s:
                break
            order = [last]
            while (prev := parent[mask][order[-1]]) != -1:
                mask, order = mask ^ (1 << order[-1]), order + [prev]
            found = self.choice([cands[j] for j in reversed(order)])
            if found is not None and (best is None or found.key < best.key):
                best, best_cost = found, found.key[0] * self.constraints.cost_quantum_s
        return best

    def _lower_bound(self, members: Sequence[int], latency: float) -> float:
        terms = [self.terms[i] for i in members]
        w = [t.per_layer_s for t in terms]
        base = max(self.floor_s, max(t.chunk_send_s for t in terms))
        layers_sum = sum(w) + max(0, self.model.num_layers - len(w)) * min(w)
        return ((1 + self.rounds) * latency + self.constant_s + sum(t.fixed_s for t in terms)
                + layers_sum + self.extra_chunks * base)

    def score(self, i: int) -> float:
        """Seconds per layer served if this node ran as many layers as it can, alone."""
        t = self.terms[i]
        k = max(1, t.cap_layers)
        own = t.fixed_s + k * t.per_layer_s + self.extra_chunks * max(t.chunk_send_s, k * t.chunk_per_layer_s)
        return (own + (1 + self.rounds) * (self.lat_in[i] + self.lat_out[i])) / k

    def local_search(self, start: Choice, outsiders: Sequence[int], required: int | None) -> Choice:
        """Swap in, insert or drop single nodes while that lowers the cost."""
        best = start
        for _ in range(8):
            order = list(best.order)
            tries: list[list[int]] = []
            for o in outsiders:
                if o in order:
                    continue
                for p, m in enumerate(order):
                    if m != required:
                        tries.append(order[:p] + [o] + order[p + 1:])
                positions = range(len(order) + 1)
                insert_at = min(positions, key=lambda p: (self._insertion_latency(order, o, p), p))
                tries.append(order[:insert_at] + [o] + order[insert_at:])
            if len(order) > 1:
                tries += [order[:p] + order[p + 1:] for p, m in enumerate(order) if m != required]
            improved = best
            for trial in tries:
                found = self.choice(trial)
                if found is not None and found.key < improved.key:
                    improved = found
            if improved is best:
                return best
            best = improved
        return best

    def _insertion_latency(self, order: Sequence[int], new: int, position: int) -> float:
        before = self.lat_in[new] if position == 0 else self.lat(order[position - 1], new)
        after = self.lat_out[new] if position == len(order) else self.lat(new, order[position])
        return before + after


def select_ring(network: Network, model: ModelSpec, workload: Workload, constraints: Constraints = Constraints()) -> Plan:
    """The plan minimising predicted total request time under `constraints`, with roles.

    Raises InfeasibleError when no ring satisfies them (too little memory, a pinned node
    that cannot hold a layer, no trusted node for the ends...).
    """
    choosing = network if constraints.upload_aware else _upload_blind(network)
    problem = Problem(choosing, model, workload, constraints)
    usable = [i for i, t in enumerate(problem.terms) if t.cap_layers >= 1]
    required = None
    if constraints.pinned is not None:
        network.node(constraints.pinned)  # UnknownPeerError if absent
        required = next((i for i in usable if problem.nodes[i].peer == constraints.pinned), None)
        if required is None:
            raise InfeasibleError(f"pinned node {constraints.pinned} cannot hold one layer", len(network.nodes))
    if len(usable) <= constraints.exact_max_nodes:
        best = problem.exact(usable, required)
    else:
        best = _heuristic(problem, usable, required)
    if best is None:
        raise InfeasibleError(_why_infeasible(problem, usable), len(network.nodes))
    stages, start = [], 0
    for i, count in zip(best.order, best.layers):
        stages.append(Stage(problem.nodes[i].peer, LayerRange(start, start + count)))
        start += count
    plan = evaluate(stages, network, model, workload)
    return dataclasses.replace(plan, roles=assign_roles(plan, network, model, workload))


def _heuristic(problem: Problem, usable: Sequence[int], required: int | None) -> Choice | None:
    constraints = problem.constraints
    ranked = sorted(usable, key=lambda i: (problem.score(i), problem.nodes[i].peer))
    if constraints.one_per_subnet:
        # At most one stage per subnet, so a subnet's runner-up only matters as an outsider.
        seen: set[str] = set()
        firsts = [i for i in ranked if not (problem.nodes[i].subnet in seen or seen.add(problem.nodes[i].subnet))]
        ranked = firsts + [i for i in ranked if i not in set(firsts)]
    # Diversify the exact core: the best nodes by overall score, by uplink, by compute and
    # by distance to the coordinator, interleaved, so a node that only shines on one axis
    # (a fiber uplink with little memory) still gets considered.
    views = [ranked] + [sorted(ranked, key=lambda i, f=f: (f(i), problem.nodes[i].peer)) for f in (
        lambda i: problem.terms[i].chunk_send_s, lambda i: problem.terms[i].per_layer_s,
        lambda i: problem.lat_in[i] + problem.lat_out[i])]
    core: list[int] = []
    for rank in range(len(ranked)):
        for view in views:
            if len(core) < constraints.exact_max_nodes and view[rank] not in core:
                core.append(view[rank])
    if constraints.trusted_ends:
        trusted = [i for i in ranked if problem.nodes[i].trusted][:2]
        core = core[: constraints.exact_max_nodes - len(set(trusted) - set(core))]
        core = sorted(set(core) | set(trusted))
    if required is not None and required not in core:
        core = core[: constraints.exact_max_nodes - 1] + [required]
    start = problem.exact(core, required)
    if start is None:
        return None
    outsiders = [i for i in ranked if i not in set(start.order)][: constraints.local_search_candidates]
    return problem.local_search(start, outsiders, required)


def _upload_blind(network: Network) -> Network:
    nodes = tuple(dataclasses.replace(n, upload_bytes_per_s=math.inf) for n in network.nodes)
    return Network(network.coordinator, nodes, network.latency, math.inf)


def _why_infeasible(problem: Problem, usable: Sequence[int]) -> str:
    if not usable:
        return "no node can hold a single layer with its KV cache"
    if sum(problem.terms[i].cap_layers for i in usable) < problem.model.num_layers:
        return "the pool's memory cannot hold every layer"
    if problem.constraints.trusted_ends and not any(problem.nodes[i].trusted for i in usable):
        return "no trusted node for the head and tail"
    return "memory, subnet, stage-count and trust constraints cannot all be met"
