"""Ring inputs from the registry, and the plan's predictions held against measured rounds.

Pure: registrations, probe reports and the model store's size facts in; `ring` records
(Network, ModelSpec, Workload) out; measured traversals in, predicted-vs-measured
summaries out. Knows nothing of streams, of how probes ran, of how a ring is chosen
(ring.select_ring) or of which nodes are registered right now (the swarm).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ring import LatencyMatrix, ModelSpec, Network, NodeInfo, PeerId, Plan, Workload, evaluate, speed_bands
from ring.assign import SPEED_TOLERANCE
from shard.layers import LayerRange
from shard.options import option
from shard.store import ModelStore
from shard.wire.dtypes import wire_bytes_per_token
from shard.wire.messages import Register


@dataclass(frozen=True)
class TopologyConfig:
    """The request a ring is chosen for, and the coordinator's own link facts."""

    prompt_tokens: int = 512  # typical prompt the ring is optimised for
    output_tokens: int = 128
    prefill_chunk_tokens: int = 256  # keep equal to EngineConfig.prefill_chunk_tokens
    round_tokens: int = 5  # positions per decode traversal (root + draft)
    expected_tokens_per_traversal: float = 2.0  # committed per traversal with drafting
    kv_bytes_per_value: int = 4  # nodes keep K/V in their compute dtype (float32 by default)
    coordinator_upload_bytes_per_s: float = 12.5e6  # 100 Mbit/s; it sends token ids only
    # Emulated one-way latency of the coordinator's own sends (EngineConfig.link_latency_ms).
    # Pongs on control streams do not pass through it, so it is added to nodes' reports.
    coordinator_link_latency_s: float = 0.0
    unknown_latency_s: float = 0.150  # a link nobody measured (ring.LatencyMatrix)
    # Nodes' measured speeds within this factor of each other are planned as one (the
    # slowest of them: ring.speed_bands), so identical nodes get an even split.
    speed_tolerance: float = SPEED_TOLERANCE
    one_per_subnet: bool = True
    # The head sees each prompt's token ids and the tail the final hidden states: an
    # operator may keep both ends on machines it runs (ring.Constraints.trusted_ends).
    trusted_peers: tuple[str, ...] = option((), "comma-separated peer ids trusted to be the ring's head and tail "
                                                "(default: none, any node may be)", parse=lambda text: tuple(
                                                    p.strip() for p in text.split(",") if p.strip()), show=",".join)

    def workload(self) -> Workload:
        return Workload(self.prompt_tokens, self.output_tokens, self.prefill_chunk_tokens, self.round_tokens,
                        self.expected_tokens_per_traversal)


def model_spec(store: ModelStore, wire_dtype: str, kv_bytes_per_value: int = 4) -> ModelSpec:
    """The store's size facts: mean bytes per layer on disk, K+V per token per layer, one
    token's hidden state on the wire in `wire_dtype`, and the embedding the head holds."""
    cfg, n = store.config, store.num_layers
    return ModelSpec(
        name=store.manifest.name,
        num_layers=n,
        bytes_per_layer=max(1, store.layer_bytes(LayerRange(0, n)) // n),
        kv_bytes_per_token_layer=2 * cfg.num_kv_heads * cfg.head_dim * kv_bytes_per_value,  # K and V
        activation_bytes_per_token=wire_bytes_per_token(cfg.hidden_size, wire_dtype),
        head_bytes=store.embedding_bytes(),  # the head stage holds the embedding too (as stored)
    )


def subnet_of(peer_id: str, listen_addrs: Sequence[str]) -> str:
    """The network a node shares an uplink (and a fate) with: the /24 (IPv4) or /48 (IPv6)
    of its first public listen address. Loopback and private addresses (and a relay's, in
    a circuit) say nothing about which home a node is in, so such a node counts as its own
    subnet."""
    for addr in listen_addrs:
        parts = addr.split("/")
        if "/p2p-circuit" in addr:  # the relay's address, not the node's home
            continue
        if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            continue
        try:
            ip = ipaddress.ip_address(parts[2])
        except ValueError:
            continue
        if ip.is_global:
            prefix = 24 if ip.version == 4 else 48
            return str(ipaddress.ip_network(f"{ip}/{prefix}", strict=False))
    return f"peer:{peer_id}"


def node_info(reg: Register, held: LayerRange | None = None, trusted: bool = False) -> NodeInfo:
    """A registration as the cost model sees it. Decode speed is measured for one token,
    prefill per token of a 128-token chunk (shard.node.measure_compute)."""
    return NodeInfo(
        peer=PeerId(reg.peer_id),
        memory_bytes=reg.memory_bytes,
        decode_s_per_layer_token=reg.decode_s_per_layer,
        prefill_s_per_layer_token=reg.prefill_s_per_layer_token,
        upload_bytes_per_s=max(reg.upload_bytes_per_s, 1.0),
        download_bytes_per_s=max(reg.download_bytes_per_s, 1.0),
        subnet=subnet_of(reg.peer_id, reg.listen_addrs),
        held=held,
        bytes_per_layer=reg.bytes_per_layer,
        trusted=trusted,
    )


def even_speeds(nodes: Sequence[NodeInfo], tolerance: float) -> tuple[NodeInfo, ...]:
    """`nodes` with decode and prefill speeds each banded (ring.speed_bands): figures within
    `tolerance` of each other are the measurement's noise (three processes of one machine
    read 1.3x apart at load 8), not a reason to give one of them more layers."""
    decode = speed_bands([n.decode_s_per_layer_token for n in nodes], tolerance)
    prefill = speed_bands([n.prefill_s_per_layer_token for n in nodes], tolerance)
    return tuple(dataclasses.replace(n, decode_s_per_layer_token=d, prefill_s_per_layer_token=p)
                 for n, d, p in zip(nodes, decode, prefill))


def record_rtts(links: Mapping[tuple[PeerId, PeerId], float], reporter: PeerId, rtt_ms: Mapping[str, float],
                coordinator: PeerId, coordinator_link_latency_s: float = 0.0) -> dict[tuple[PeerId, PeerId], float]:
    """One-way latencies (src, dst) -> s after `reporter` measured these round trips.

    A round trip cannot tell the two directions apart, so each gets half. That is exact for
    what the cost model adds up: a ring is a cycle, and with every echo sent back over the
    echoing side's own (emulated or real) path, the halves of a cycle's round trips sum to
    the cycle's one-way latencies.
    """
    out = dict(links)
    for name, ms in rtt_ms.items():
        peer = PeerId(name)  # as the report names it (the wire's text form)
        if peer == reporter or not (ms >= 0 and math.isfinite(ms)):
            continue
        rtt_s = ms / 1e3 + (coordinator_link_latency_s if peer == coordinator else 0.0)
        out[(reporter, peer)] = out[(peer, reporter)] = rtt_s / 2
    return out


def forget_peer(links: Mapping[tuple[PeerId, PeerId], float], peer: PeerId) -> dict[tuple[PeerId, PeerId], float]:
    return {k: v for k, v in links.items() if peer not in k}


def relay_of(listen_addrs: Sequence[str]) -> PeerId | None:
    """The relay a node is reached through: the relay's peer id when its first address is
    a circuit (.../p2p/<relay>/p2p-circuit/p2p/<node>), which a node nobody can dial
    advertises first (shard.relay); None for a dialable node."""
    first = listen_addrs[0] if listen_addrs else ""
    relay_part, circuit, _ = first.partition("/p2p-circuit")
    _, p2p, relay = relay_part.rpartition("/p2p/")
    return PeerId(relay) if circuit and p2p and relay else None


def relayed_links(links: Mapping[tuple[PeerId, PeerId], float], registrations: Mapping[PeerId, Register],
                  coordinator: PeerId, config: TopologyConfig, round_bytes: int,
                  relays: Mapping[PeerId, PeerId] | None = None) -> dict[tuple[PeerId, PeerId], float]:
    """`links` with every hop into a node reached through a relay costed as the relay makes
    it: both legs (sender -> relay -> node, each measured by its own probe) plus one decode
    round's bytes on the relay's upload, which all such hops through it share. Planned as
    relayed even where DCUtR may punch through (cheaper then: the plan is the safe side);
    the coordinator and the relay itself reach the node over its own connection, directly.
    A hop whose legs are not both measured is left to ring.LatencyMatrix's estimate.
    `relays` names the relay of some relayed nodes (a relay-role node chosen for them,
    coordinator.swarm.relay_choice); the others are reached through the relay of their
    first address (the coordinator's, where they reserved when they registered)."""
    relayed = {peer: relay for peer, reg in registrations.items() if (relay := relay_of(reg.listen_addrs))}
    relayed.update({peer: relay for peer, relay in (relays or {}).items() if peer in relayed})
    out = dict(links)
    for dst, relay in relayed.items():
        sharing = sum(1 for r in relayed.values() if r == relay)  # one circuit into each such stage
        relay_upload = (config.coordinator_upload_bytes_per_s if relay == coordinator
                        else registrations[relay].upload_bytes_per_s if relay in registrations else None)
        for src in registrations:
            legs = (links.get((src, relay)), links.get((relay, dst)))
            if src in (dst, relay) or relay_upload is None or None in legs:
                continue
            out[(src, dst)] = legs[0] + legs[1] + round_bytes * sharing / max(relay_upload, 1.0)
    return out


def round_bytes(config: TopologyConfig, model: ModelSpec | None) -> int:
    """One decode round's activations on a hop (0 without a model: relays cost legs only)."""
    return config.round_tokens * model.activation_bytes_per_token if model is not None else 0


def build_network(coordinator: PeerId, registrations: Mapping[PeerId, Register],
                  links: Mapping[tuple[PeerId, PeerId], float], held: Mapping[PeerId, LayerRange],
                  config: TopologyConfig, model: ModelSpec | None = None,
                  relays: Mapping[PeerId, PeerId] | None = None) -> Network:
    """The pool as ring sees it: every registered node, the links measured among them and
    to the coordinator (others estimated by ring.LatencyMatrix), hops into relayed nodes as
    the relay makes them (`relayed_links`, with `model`'s activation bytes per decode
    round, through `relays` where named), and what each holds."""
    nodes = even_speeds([node_info(reg, held.get(peer), peer in config.trusted_peers)
                         for peer, reg in sorted(registrations.items())], config.speed_tolerance)
    present = set(registrations) | {coordinator}
    links = relayed_links(links, registrations, coordinator, config, round_bytes(config, model), relays)
    measured = {(a, b): s for (a, b), s in links.items() if a in present and b in present}
    return Network(coordinator, nodes, LatencyMatrix(measured, config.unknown_latency_s),
                   config.coordinator_upload_bytes_per_s)


# -- predictions against measurements ---------------------------------------------------------

@dataclass(frozen=True)
class Traversal:
    """One round as the engine measured it: sent frames out, the tail's result back."""

    epoch: int
    prefill: bool  # the round fed prompt (or re-prefill) chunks, not only a decode frame
    frames: int
    tokens: int  # positions sent over all frames
    traversal_s: float
    compute_s: tuple[float, ...]  # per stage, in ring order, for the round's last frame


@dataclass(frozen=True)
class Predicted:
    traversal_s: float
    compute_s: tuple[float, ...]  # per stage, for the round's last frame


def predict(plan: Plan, network: Network, model: ModelSpec, config: TopologyConfig, t: Traversal) -> Predicted:
    """What the cost model says this round should have cost on the plan's ring: a prefill
    round is a chunked prompt of `tokens` (its TTFT), a decode round one step of `tokens`."""
    if t.prefill:
        chunk = max(1, math.ceil(t.tokens / max(t.frames, 1)))
        work = Workload(t.tokens, 1, chunk, 1, 1.0)
        p = evaluate(plan.stages, network, model, work)
        return Predicted(p.ttft_s, tuple(s.chunk_compute_s for s in p.timings))
    work = Workload(1, 2, 1, t.tokens, 1.0)
    p = evaluate(plan.stages, network, model, work)
    return Predicted(p.decode_step_s, tuple(s.round_compute_s for s in p.timings))


class Predictions:
    """`predict`, remembered per planned ring and round shape: every decode round of a ring
    asks it (at 16 streams ~100 a second, ~4% of the gateway's main thread on the dev VM)
    and rounds of one shape on one plan predict the same. `planned` is the (plan, network)
    a ring was formed on; a re-formed ring brings a new one. Bounded: cleared when full."""

    def __init__(self, size: int = 512) -> None:
        self.size = size
        self._memo: dict[tuple, tuple[object, Predicted]] = {}  # (id(planned), shape) -> (planned, predicted)

    def predict(self, planned: tuple[Plan, Network], model: ModelSpec, config: TopologyConfig, t: Traversal) -> Predicted:
        """predict(*planned, model, config, t); raises what it raises (nothing is kept then)."""
        key = (id(planned), t.prefill, t.tokens, t.frames if t.prefill else 0)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is planned:
            return hit[1]
        predicted = predict(*planned, model, config, t)
        if len(self._memo) >= self.size:
            self._memo.clear()
        self._memo[key] = (planned, predicted)
        return predicted


@dataclass
class TraversalLog:
    """Recent rounds of the current ring with their predictions (a bounded window), and
    the path each sender's ring stream crosses, (src, dst) -> "direct", "hole_punched" or
    "relayed" as the sender reported it (kept across rings: a stream outlives its epoch)."""

    window: int = 256
    samples: deque[tuple[Traversal, Predicted]] = field(default_factory=deque)
    paths: dict[tuple[str, str], str] = field(default_factory=dict)
    vias: dict[tuple[str, str], str | None] = field(default_factory=dict)  # the relay a relayed hop crosses

    def record_path(self, src: str, dst: str, path: str, via: str | None = None) -> None:
        self.paths[(src, dst)], self.vias[(src, dst)] = path, via

    def add(self, t: Traversal, p: Predicted) -> None:
        self.samples.append((t, p))
        while len(self.samples) > self.window:
            self.samples.popleft()

    def clear(self) -> None:
        self.samples.clear()

    def summary(self) -> dict[str, Any]:
        """Medians per kind of round: measured vs predicted traversal and per-stage compute
        (of the last frame), and for decode rounds transport (traversal minus compute: every
        hop's latency and serialisation together, since frames carry no per-hop timestamps)."""
        out: dict[str, Any] = {}
        for kind, prefill in (("prefill", True), ("decode", False)):
            rows = [(t, p) for t, p in self.samples if t.prefill == prefill]
            if not rows:
                continue
            stages = min(len(t.compute_s) for t, _ in rows)
            med = statistics.median
            out[kind] = {
                "rounds": len(rows),
                "tokens_median": med(t.tokens for t, _ in rows),
                "measured_traversal_s": med(t.traversal_s for t, _ in rows),
                "predicted_traversal_s": med(p.traversal_s for _, p in rows),
                "measured_stage_compute_s": [med(t.compute_s[i] for t, _ in rows) for i in range(stages)],
                "predicted_stage_compute_s": [med(p.compute_s[i] for _, p in rows) for i in range(stages)],
            }
            if not prefill:
                out[kind]["measured_transport_s"] = med(t.traversal_s - sum(t.compute_s) for t, _ in rows)
                out[kind]["predicted_transport_s"] = med(p.traversal_s - sum(p.compute_s) for _, p in rows)
        return out


def plan_info(plan: Plan, hop_paths: Mapping[tuple[str, str], str] | None = None,
              hop_vias: Mapping[tuple[str, str], str | None] | None = None) -> dict[str, Any]:
    """A plan as JSON: the ring, its predictions and its per-hop breakdown, each hop with
    the path its sender's stream crosses ("direct", "hole_punched", "relayed"; None until
    the sender has opened one) and, relayed, `via`: the relay's peer id."""
    paths, vias = hop_paths or {}, hop_vias or {}
    return {
        "stages": [{"peer_id": s.peer, "layers": [s.layers.start, s.layers.end]} for s in plan.stages],
        "predicted": {"ttft_s": plan.ttft_s, "decode_step_s": plan.decode_step_s, "total_s": plan.total_s,
                      "bottleneck_s": plan.bottleneck_s},
        "hops": [{"src": h.src, "dst": h.dst, "latency_s": h.latency_s, "latency_estimated": h.latency_estimated,
                  "chunk_send_s": h.chunk_send_s, "round_send_s": h.round_send_s, "path": paths.get((h.src, h.dst)),
                  "via": vias.get((h.src, h.dst))}
                 for h in plan.hops],
        "stage_timings": [{"peer_id": t.peer, "chunk_compute_s": t.chunk_compute_s, "round_compute_s": t.round_compute_s}
                          for t in plan.timings],
        "moves": [{"peer_id": m.peer, "layers": [m.layers.start, m.layers.end], "missing_layers": m.missing_layers,
                   "bytes": m.bytes, "seconds": m.seconds, "source": m.source} for m in plan.moves],
        "move_s": plan.move_s,
    }
