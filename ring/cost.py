"""The cost model: predicted TTFT, decode step and request time of a ring.

One source of truth for timing. `evaluate` costs a concrete ring; `NodeTerms` is the
same model regrouped per node so the search can add it up piece by piece:

    total = (1 + R) * sum(hop latencies)                       # R = decode traversals
          + coord_send + sum_i [S_i + R * Sr_i + k_i * (P_i + R * D_i)]
          + (C - 1) * max(coord_send, max_i S_i, max_i k_i * P_i)

with k_i the layers of stage i, C prefill chunks, P/D per-layer prefill-chunk/decode-round
compute, S/Sr the chunk/round serialisation on the node's own uplink. Order only enters
through latency and layer counts only through the compute terms, which is what makes
exact search cheap. Knows nothing of how a ring is chosen.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from ring.errors import InvalidInputError
from ring.network import Network, NodeInfo
from ring.plan import Hop, Plan, Stage, StageTiming
from ring.spec import ModelSpec, Workload


def max_layers(node: NodeInfo, model: ModelSpec, workload: Workload, head: bool = False) -> int:
    """How many layers fit in the node's memory with their KV cache for the whole context
    (each layer's weights as the node holds them: a quantised node seats more); `head`:
    as the ring's head stage, which holds the token embedding too (model.head_bytes)."""
    room = node.memory_bytes - (model.head_bytes if head else 0)
    return max(0, min(model.num_layers, room // model.layer_bytes_with_kv(workload.context_tokens, node.bytes_per_layer)))


@dataclass(frozen=True)
class NodeTerms:
    """One node's contribution to the objective, independent of where it sits in the ring."""

    fixed_s: float  # S + R * Sr: its uplink's share of prefill sum and of all decode rounds
    per_layer_s: float  # P + R * D: one layer's prefill-chunk and decode-rounds compute
    chunk_per_layer_s: float  # P: one layer's compute per prefill chunk (bottleneck candidate)
    chunk_send_s: float  # S: serialising one chunk (bottleneck candidate)
    cap_layers: int
    head_cap_layers: int = -1  # as the head stage (with the embedding); -1: as cap_layers

    def as_head(self) -> "NodeTerms":
        """These terms with the cap of a head stage."""
        return self if self.head_cap_layers < 0 else dataclasses.replace(self, cap_layers=self.head_cap_layers)

    @classmethod
    def of(cls, node: NodeInfo, model: ModelSpec, workload: Workload) -> "NodeTerms":
        chunk_tokens, rounds = workload.tokens_per_chunk, workload.decode_traversals
        chunk_send = chunk_tokens * model.activation_bytes_per_token / node.upload_bytes_per_s
        round_send = workload.round_tokens * model.activation_bytes_per_token / node.upload_bytes_per_s
        chunk_layer = node.prefill_s_per_layer_token * chunk_tokens
        round_layer = node.decode_s_per_layer_token * workload.round_tokens
        return cls(
            fixed_s=chunk_send + rounds * round_send,
            per_layer_s=chunk_layer + rounds * round_layer,
            chunk_per_layer_s=chunk_layer,
            chunk_send_s=chunk_send,
            cap_layers=max_layers(node, model, workload),
            head_cap_layers=max_layers(node, model, workload, head=True),
        )


def coordinator_sends(network: Network, model: ModelSpec, workload: Workload) -> tuple[float, float]:
    """Seconds for the coordinator to put one chunk's / one round's token ids on its uplink."""
    per_token = model.token_id_bytes / network.coordinator_upload_bytes_per_s
    return workload.tokens_per_chunk * per_token, workload.round_tokens * per_token


def check_stages(stages: Sequence[Stage], network: Network, model: ModelSpec, workload: Workload) -> None:
    """Raise InvalidInputError unless the stages tile [0, num_layers) in order and fit memory."""
    if not stages:
        raise InvalidInputError("ring", "no stages")
    expected = 0
    for index, stage in enumerate(stages):
        if stage.layers.start != expected:
            raise InvalidInputError("ring layer coverage", f"{stage.peer} starts at {stage.layers.start}, expected {expected}")
        expected = stage.layers.end
        if len(stage.layers) > max_layers(network.node(stage.peer), model, workload, head=index == 0):
            what = " and the token embedding" if index == 0 and model.head_bytes else ""
            raise InvalidInputError("ring memory", f"{stage.peer} cannot hold {len(stage.layers)} layers{what}")
    if expected != model.num_layers:
        raise InvalidInputError("ring layer coverage", f"ends at {expected}, model has {model.num_layers}")
    if len({s.peer for s in stages}) != len(stages):
        raise InvalidInputError("ring", "a peer appears twice")


def evaluate(plan: Plan | Sequence[Stage], network: Network, model: ModelSpec, workload: Workload) -> Plan:
    """Predict the timings of a ring (a Plan's stages or a list of stages); returns a new Plan.

    Roles and moves of an input Plan are kept. Raises InvalidInputError for a ring that
    does not tile the model exactly once or does not fit memory.
    """
    stages = tuple(plan.stages if isinstance(plan, Plan) else plan)
    check_stages(stages, network, model, workload)
    coord_chunk_s, coord_round_s = coordinator_sends(network, model, workload)
    path = (network.coordinator, *(s.peer for s in stages), network.coordinator)
    hops, timings = [], []
    resources = [coord_chunk_s]  # pipeline resources a prefill chunk occupies, in order
    for i, (src, dst) in enumerate(zip(path, path[1:])):
        latency_s, estimated = network.link(src, dst)
        if i == 0:
            chunk_send_s, round_send_s = coord_chunk_s, coord_round_s
        else:
            stage, terms = stages[i - 1], NodeTerms.of(network.node(src), model, workload)
            layers = len(stage.layers)
            round_compute_s = layers * network.node(src).decode_s_per_layer_token * workload.round_tokens
            timings.append(StageTiming(src, layers * terms.chunk_per_layer_s, round_compute_s))
            chunk_send_s = terms.chunk_send_s
            round_send_s = workload.round_tokens * model.activation_bytes_per_token / network.node(src).upload_bytes_per_s
            resources += [layers * terms.chunk_per_layer_s, chunk_send_s]
        hops.append(Hop(src, dst, latency_s, estimated, chunk_send_s, round_send_s))
    latency_s = sum(h.latency_s for h in hops)
    bottleneck_s = max(resources)
    # Equal chunks through a flow shop of resources in series: the first chunk pays every
    # resource and every latency, each later one only the slowest resource.
    ttft_s = latency_s + sum(resources) + (workload.num_chunks - 1) * bottleneck_s
    decode_step_s = latency_s + sum(h.round_send_s for h in hops) + sum(t.round_compute_s for t in timings)
    total_s = ttft_s + workload.decode_traversals * decode_step_s
    if isinstance(plan, Plan):
        roles, moves, move_s = plan.roles, plan.moves, plan.move_s
    else:
        roles, moves, move_s = {}, (), 0.0
    return Plan(stages, ttft_s, decode_step_s, total_s, tuple(hops), tuple(timings), bottleneck_s, roles, moves, move_s)
