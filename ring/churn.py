"""Re-selection after nodes leave: prefer rings that keep survivors on layers they hold.

Moving weights over home uplinks costs far more than a slightly slower ring, so every
candidate is charged its weight-transfer time amortised over the requests the ring is
expected to serve: objective = total_s + move_s / amortise_over_requests. Candidates are
(1) repairs: survivors keep their slices and the gap goes to one outsider, two outsiders
or the neighbours, and (2) a fresh `select_ring`. Knows nothing of how the departure was noticed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterable

from ring.cost import NodeTerms, evaluate, max_layers
from ring.errors import InfeasibleError, RingError
from ring.network import Network, NodeInfo
from ring.plan import Move, Plan, Stage
from ring.roles import assign_roles, missing_layers
from ring.search import Constraints, select_ring
from ring.spec import ModelSpec, Workload
from shard.layers import LayerRange
from shard.weight_plan import WeightsConfig


_PAIR_SHORTLIST = 6  # outsiders considered for two-way splits of a hole: 30 pairs x cut points


@dataclass(frozen=True)
class ChurnPolicy:
    amortise_over_requests: float = 20.0  # requests a ring serves before the next change
    # The coordinator serves weights no node holds, at this rate (coordinator.swarm.seeding).
    origin_upload_bytes_per_s: float = 12.5e6
    # Holders serve weights at this share of their upload (a token bucket, shard.weight_server).
    seed_upload_share: float = WeightsConfig.seed_upload_share
    cost_quantum_s: float = 1e-6


def fetch_seconds(nbytes: int, files: int, download_bytes_per_s: float, source_uploads_bytes_per_s: Iterable[float],
                  share: float) -> float:
    """Seconds to fetch `nbytes` in `files` files of equal size as shard.weight_fetch does:
    each file from one source, a source taking the next file as soon as it is free, each
    sending at `share` of its upload, all together capped by the receiver's download (each
    source's rate scaled down alike). So at most `files` sources help, the fastest first, and
    8 files from 3 equal sources take 3 files' time, not 8/3."""
    ups = sorted((u for u in source_uploads_bytes_per_s if u > 0), reverse=True)[: max(1, files)]
    rates = [share * u for u in ups]
    total = sum(rates)
    if not total > 0:
        raise InfeasibleError("no source can send weights (no upload)", len(rates))
    if total > download_bytes_per_s:
        rates = [r * download_bytes_per_s / total for r in rates]
    size = nbytes / max(1, files)
    done_at = [0.0] * len(rates)  # when each source is free again
    for _ in range(max(1, files)):
        i = min(range(len(rates)), key=lambda j: (done_at[j] + size / rates[j], j))
        done_at[i] += size / rates[i]
    return max(done_at)


def plan_moves(stages: Iterable[Stage], network: Network, model: ModelSpec,
               policy: ChurnPolicy = ChurnPolicy()) -> tuple[tuple[Move, ...], float]:
    """Weight fetches each stage needs, and the time until all are done (they run in parallel):
    from every node holding the stage's whole slice (fetch_seconds), else the coordinator."""
    moves = []
    for stage in stages:
        node = network.node(stage.peer)
        missing = missing_layers(node, stage.layers)
        if missing == 0:
            continue
        holders = [n for n in network.nodes if n.peer != node.peer and n.held is not None
                   and n.held.start <= stage.layers.start and stage.layers.end <= n.held.end]
        source = max(holders, key=lambda n: (n.upload_bytes_per_s, n.peer), default=None)
        source_peer = source.peer if source else network.coordinator
        if holders:
            seconds = fetch_seconds(missing * model.bytes_per_layer, missing, node.download_bytes_per_s,
                                    [n.upload_bytes_per_s for n in holders], policy.seed_upload_share)
        else:
            seconds = fetch_seconds(missing * model.bytes_per_layer, missing, node.download_bytes_per_s,
                                    [policy.origin_upload_bytes_per_s], 1.0)
        moves.append(Move(node.peer, stage.layers, missing, missing * model.bytes_per_layer, seconds, source_peer))
    return tuple(moves), max((m.seconds for m in moves), default=0.0)


def with_moves(plan: Plan, network: Network, model: ModelSpec, policy: ChurnPolicy = ChurnPolicy()) -> Plan:
    """`plan` with the weight fetches its stages need on `network` (plan_moves), when it names
    none yet: a fresh ring's plan then predicts its fetches too. Moves a plan already names
    (reselect's, costed on the survivors' served slices) are kept."""
    if plan.moves:
        return plan
    moves, move_s = plan_moves(plan.stages, network, model, policy)
    return dataclasses.replace(plan, moves=moves, move_s=move_s)


def reselect(previous: Plan, network: Network, model: ModelSpec, workload: Workload,
             constraints: Constraints = Constraints(), policy: ChurnPolicy = ChurnPolicy()) -> Plan:
    """The best ring on `network` (the pool after churn) counting weight moves.

    Survivors of `previous` are taken to hold the slices they served. The returned plan's
    `moves` say what must be fetched, by whom and from where.
    """
    network = _with_previous_slices(previous, network)
    candidates: list[list[Stage]] = _repairs(previous, network, model, workload)
    try:
        candidates.append(list(select_ring(network, model, workload, constraints).stages))
    except InfeasibleError:
        if not candidates:
            raise
    best_key, best = None, None
    for stages in candidates:
        if not _allowed(stages, network, constraints):
            continue
        try:
            plan = evaluate(stages, network, model, workload)
        except RingError:
            continue
        moves, move_s = plan_moves(stages, network, model, policy)
        objective = plan.total_s + move_s / policy.amortise_over_requests
        key = (round(objective / policy.cost_quantum_s), tuple((s.peer, s.layers.end) for s in stages))
        if best_key is None or key < best_key:
            best_key, best = key, dataclasses.replace(plan, moves=moves, move_s=move_s)
    if best is None:
        raise InfeasibleError("no repair or fresh ring satisfies the constraints", len(network.nodes))
    return dataclasses.replace(best, roles=assign_roles(best, network, model, workload))


def _with_previous_slices(previous: Plan, network: Network) -> Network:
    served = {s.peer: s.layers for s in previous.stages}
    nodes = tuple(dataclasses.replace(n, held=served[n.peer]) if n.peer in served else n for n in network.nodes)
    return Network(network.coordinator, nodes, network.latency, network.coordinator_upload_bytes_per_s)


def _repairs(previous: Plan, network: Network, model: ModelSpec, workload: Workload) -> list[list[Stage]]:
    """Rings that keep every survivor's slice, filling each gap with one outsider or the neighbours."""
    present = {n.peer for n in network.nodes}
    stages: list[Stage | LayerRange] = [s if s.peer in present else s.layers for s in previous.stages]
    gaps = [i for i, s in enumerate(stages) if isinstance(s, LayerRange)]
    if not gaps:
        return [list(previous.stages)]  # nobody on the ring left
    if len(gaps) > 1:
        return []  # several holes: leave it to the fresh selection
    gap = gaps[0]
    hole = stages[gap]
    on_ring = {s.peer for s in stages if isinstance(s, Stage)}
    out: list[list[Stage]] = []
    outsiders = sorted((n for n in network.nodes if n.peer not in on_ring), key=lambda n: n.peer)
    caps = {n.peer: max_layers(n, model, workload, head=gap == 0) for n in outsiders}
    for node in outsiders:
        if caps[node.peer] >= len(hole):
            out.append(_fill(stages, gap, [Stage(node.peer, hole)]))
    # A hole too big for any one outsider: split it between two of the most capable.
    terms = {n.peer: NodeTerms.of(n, model, workload) for n in outsiders}
    shortlist = sorted((n.peer for n in outsiders if caps[n.peer] >= 1),
                       key=lambda p: (terms[p].fixed_s + terms[p].per_layer_s * len(hole) / 2, p))[:_PAIR_SHORTLIST]
    for first in shortlist:
        for second in shortlist:
            for cut in range(hole.start + 1, hole.end):
                if first != second and caps[first] >= cut - hole.start and caps[second] >= hole.end - cut:
                    out.append(_fill(stages, gap, [Stage(first, LayerRange(hole.start, cut)),
                                                   Stage(second, LayerRange(cut, hole.end))]))
    before = stages[gap - 1] if gap > 0 else None
    after = stages[gap + 1] if gap + 1 < len(stages) else None
    for cut in range(hole.start, hole.end + 1):  # the predecessor takes [start, cut), the successor the rest
        if (cut > hole.start and before is None) or (cut < hole.end and after is None):
            continue
        fill = []
        if before is not None:
            fill.append(Stage(before.peer, LayerRange(before.layers.start, max(before.layers.end, cut))))
        if after is not None:
            fill.append(Stage(after.peer, LayerRange(min(cut, after.layers.start), after.layers.end)))
        out.append(_fill(stages, gap, fill, replace_neighbours=True))
    return out


def _fill(stages: list, gap: int, fill: list[Stage], replace_neighbours: bool = False) -> list[Stage]:
    lo, hi = (max(0, gap - 1), min(len(stages), gap + 2)) if replace_neighbours else (gap, gap + 1)
    result = stages[:lo] + fill + stages[hi:]
    return [s for s in result if isinstance(s, Stage)]


def _allowed(stages: list[Stage], network: Network, constraints: Constraints) -> bool:
    nodes: list[NodeInfo] = [network.node(s.peer) for s in stages]
    if constraints.one_per_subnet and len({n.subnet for n in nodes}) < len(nodes):
        return False
    if constraints.trusted_ends and not (nodes[0].trusted and nodes[-1].trusted):
        return False
    if constraints.pinned is not None and constraints.pinned not in {n.peer for n in nodes}:
        return False
    return constraints.max_stages is None or len(stages) <= constraints.max_stages
