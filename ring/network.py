"""What the coordinator knows about the pool: nodes, their links, and measured latencies.

Pure data. Knows nothing of models, workloads, costs or how measurements were taken
(that is the transport's link probe); it only stores them and estimates the missing ones.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, NewType

from ring.errors import InvalidInputError, UnknownPeerError
from shard.layers import LayerRange

PeerId = NewType("PeerId", str)


@dataclass(frozen=True)
class NodeInfo:
    """One volunteer as the coordinator sees it: capacity, measured speeds, links.

    Speeds are measured for the model being served (a node reports per-model numbers).
    """

    peer: PeerId
    memory_bytes: int
    decode_s_per_layer_token: float  # one layer, one token, during decode (memory-bound)
    prefill_s_per_layer_token: float  # one layer, one token, during chunked prefill
    upload_bytes_per_s: float
    download_bytes_per_s: float
    subnet: str  # e.g. "203.0.113.0/24": two stages in one subnet share one uplink and one fate
    trusted: bool = False
    held: LayerRange | None = None  # layers already on the node's disk/memory
    # One layer's weights as this node holds them (its weight quantisation); 0: the model's.
    bytes_per_layer: int = 0

    def __post_init__(self) -> None:
        if not self.peer:
            raise InvalidInputError("peer id", self.peer)
        if self.memory_bytes < 0:
            raise InvalidInputError(f"{self.peer} memory_bytes", self.memory_bytes)
        if self.bytes_per_layer < 0:
            raise InvalidInputError(f"{self.peer} bytes_per_layer", self.bytes_per_layer)
        for name in ("decode_s_per_layer_token", "prefill_s_per_layer_token"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise InvalidInputError(f"{self.peer} {name}", value)
        for name in ("upload_bytes_per_s", "download_bytes_per_s"):
            if not getattr(self, name) > 0:  # inf is allowed: "upload-blind" what-ifs use it
                raise InvalidInputError(f"{self.peer} {name}", getattr(self, name))


@dataclass(frozen=True)
class LatencyMatrix:
    """Measured one-way latencies in seconds, `(src, dst) -> s`; asymmetric allowed.

    The coordinator is a point in it like any node. Unknown links are estimated, and
    `get` says so: the reverse direction if that was measured, else the path through the
    coordinator (an upper bound by the triangle inequality: a conservative guess that
    makes the search prefer links someone actually measured), else `unknown_s`.
    """

    measured: Mapping[tuple[PeerId, PeerId], float]
    unknown_s: float = 0.150

    def __post_init__(self) -> None:
        for key, value in self.measured.items():
            if not (value >= 0 and math.isfinite(value)):
                raise InvalidInputError(f"latency {key[0]}->{key[1]}", value)

    def get(self, src: PeerId, dst: PeerId, via: PeerId | None = None) -> tuple[float, bool]:
        """Return `(seconds, estimated)` for the link src -> dst."""
        if src == dst:
            return 0.0, False
        value = self.measured.get((src, dst))
        if value is not None:
            return value, False
        value = self.measured.get((dst, src))
        if value is not None:
            return value, True
        if via is not None:
            first, second = self.measured.get((src, via)), self.measured.get((via, dst))
            if first is not None and second is not None:
                return first + second, True
        return self.unknown_s, True


@dataclass(frozen=True)
class Network:
    """Everything measured about the pool: the coordinator, the nodes, the latencies."""

    coordinator: PeerId
    nodes: tuple[NodeInfo, ...]
    latency: LatencyMatrix
    coordinator_upload_bytes_per_s: float = 12.5e6  # 100 Mbit/s; it only sends token ids
    _by_peer: dict[PeerId, NodeInfo] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        by_peer: dict[PeerId, NodeInfo] = {}
        for node in self.nodes:
            if node.peer in by_peer or node.peer == self.coordinator:
                raise InvalidInputError("duplicate peer id", node.peer)
            by_peer[node.peer] = node
        object.__setattr__(self, "_by_peer", by_peer)

    def node(self, peer: PeerId) -> NodeInfo:
        try:
            return self._by_peer[peer]
        except KeyError:
            raise UnknownPeerError(peer) from None

    def link(self, src: PeerId, dst: PeerId) -> tuple[float, bool]:
        """One-way latency src -> dst and whether it was estimated (see LatencyMatrix)."""
        for peer in (src, dst):
            if peer != self.coordinator and peer not in self._by_peer:
                raise UnknownPeerError(peer)
        return self.latency.get(src, dst, via=self.coordinator)

    def without(self, peers: set[PeerId]) -> "Network":
        """The same network after `peers` left (churn)."""
        kept = tuple(n for n in self.nodes if n.peer not in peers)
        return Network(self.coordinator, kept, self.latency, self.coordinator_upload_bytes_per_s)
