"""The swarm as operators see it: the plan, its predictions against measured rounds, roles,
and each node's measured facts, as JSON (GET /v1/topology via the engine's info).

Pure: a formation snapshot, the traversal log and the size facts in, a dict out. Knows
nothing of streams, of how rings are chosen, or of HTTP.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from coordinator.swarm import topology
from coordinator.swarm.formation import Snapshot
from coordinator.swarm.topology import TopologyConfig, TraversalLog
from ring import ModelSpec


def topology_info(snapshot: Snapshot, traversals: TraversalLog, config: TopologyConfig, model: ModelSpec) -> dict[str, Any]:
    """The plan, its predictions, measured rounds, roles and each node's measured links;
    each hop with the path its sender reported (traversals.paths)."""
    plan, held = snapshot.plan, snapshot.held
    nodes = {}
    for peer, reg in sorted(snapshot.registrations.items()):
        nodes[peer] = {
            "upload_bytes_per_s": reg.upload_bytes_per_s, "download_bytes_per_s": reg.download_bytes_per_s,
            "decode_s_per_layer": reg.decode_s_per_layer, "prefill_s_per_layer_token": reg.prefill_s_per_layer_token,
            "memory_bytes": reg.memory_bytes, "one_way_to_coordinator_s": snapshot.links.get((peer, snapshot.coordinator)),
            "subnet": topology.subnet_of(peer, reg.listen_addrs),
            "held": [held[peer].start, held[peer].end] if peer in held else None,
            "faulty": snapshot.faulty.get(peer),
        }
    return {
        "plan": topology.plan_info(plan, traversals.paths, traversals.vias) if plan is not None else None,
        "roles": {p: {"role": r.kind.value, "reason": r.reason, "stage_index": r.stage_index}
                  for p, r in sorted(plan.roles.items())} if plan is not None else {},
        "measured": traversals.summary(),
        "workload": dataclasses.asdict(config.workload()),
        "model": dataclasses.asdict(model),
        "nodes": nodes,
        "measured_links": len(snapshot.links),
    }
