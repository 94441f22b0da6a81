"""Roles for the nodes a plan leaves off the ring, each with a reason a person can read.

Pure. Order of preference: one hot standby per stage (fastest to take that slice over),
a few weight seeders (good uplink), spot-check verifiers (can hold a layer). A node
that can hold the whole model gets no role of its own for it: unless --max-rings 1 it is
a one-stage ring (coordinator.swarm.ring_set), the "decode-only replica" a role once
promised. Everything else gets no role here: the relay
role (RoleKind.RELAY) is given after the ring is chosen, to a dialable spare near a stage
nobody can dial (coordinator.swarm.relay_choice), since it depends on who is on the ring.
Knows nothing of how the ring was chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

from ring.cost import max_layers
from ring.network import Network, NodeInfo, PeerId
from ring.plan import Plan, Role, RoleKind
from ring.spec import ModelSpec, Workload
from shard.layers import LayerRange


@dataclass(frozen=True)
class RolePolicy:
    standbys_per_stage: int = 1
    seeders_per_stage: float = 1.0  # up to max(2, this times the stage count)
    seeder_min_upload_bytes_per_s: float = 12.5e6  # 100 Mbit/s


def missing_layers(node: NodeInfo, layers: LayerRange) -> int:
    """How many of `layers` the node would still have to fetch."""
    if node.held is None:
        return len(layers)
    overlap = max(0, min(node.held.end, layers.end) - max(node.held.start, layers.start))
    return len(layers) - overlap


def fetch_s(node: NodeInfo, layers: LayerRange, model: ModelSpec, source_upload_bytes_per_s: float) -> float:
    """Seconds to fetch the missing part of `layers` over min(own download, source upload)."""
    rate = min(node.download_bytes_per_s, source_upload_bytes_per_s)
    return missing_layers(node, layers) * model.bytes_per_layer / rate


def assign_roles(plan: Plan, network: Network, model: ModelSpec, workload: Workload,
                 policy: RolePolicy = RolePolicy()) -> dict[PeerId, Role]:
    on_ring = set(plan.peers)
    spare = sorted((n for n in network.nodes if n.peer not in on_ring), key=lambda n: n.peer)
    roles: dict[PeerId, Role] = {}
    subnets = [network.node(s.peer).subnet for s in plan.stages]

    for index, stage in enumerate(plan.stages):
        others = set(subnets[:index] + subnets[index + 1:])
        source_upload = network.node(stage.peer).upload_bytes_per_s
        fits = [(fetch_s(n, stage.layers, model, source_upload), n.peer, n) for n in spare
                if n.peer not in roles and n.subnet not in others
                and max_layers(n, model, workload, head=index == 0) >= len(stage.layers)]
        for seconds, peer, _ in sorted(fits)[: policy.standbys_per_stage]:
            roles[peer] = Role(RoleKind.HOT_STANDBY,
                               f"fits stage {index}'s {len(stage.layers)} layers {stage.layers}; "
                               f"can load them in {seconds:.1f} s", index)

    seeders = verifiers = 0
    seeder_quota = max(2, round(policy.seeders_per_stage * len(plan.stages)))
    for node in spare:
        if node.peer in roles:
            continue
        cap = max_layers(node, model, workload)
        mbit = node.upload_bytes_per_s * 8 / 1e6
        if node.upload_bytes_per_s >= policy.seeder_min_upload_bytes_per_s and seeders < seeder_quota:
            roles[node.peer] = Role(RoleKind.WEIGHT_SEEDER, f"uplink {mbit:.0f} Mbit/s: seeds weight slices to new stages")
            seeders += 1
        elif cap >= 1:
            # Verifiers cost the ring nothing, and more of them sample more frames.
            index = verifiers % len(plan.stages)
            roles[node.peer] = Role(RoleKind.SPOT_CHECK_VERIFIER,
                                    f"holds {cap} layers: recomputes sampled frames of stage {index} "
                                    f"{plan.stages[index].layers} and compares receipts", index)
            verifiers += 1
        # else: no room for a layer and no seeder's uplink: no role (see the module docstring).
    return roles
