"""The decisions this package hands out: a ring plan, its predicted timings, roles, moves.

Pure records with stable leading fields. Knows nothing of how they were chosen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Mapping

from ring.network import PeerId
from shard.layers import LayerRange
from shard.wire import roles as wire_roles


@dataclass(frozen=True, order=True)
class Stage:
    """Stage i of the ring: which peer runs which layers."""

    peer: PeerId
    layers: LayerRange


@dataclass(frozen=True)
class Hop:
    """One link of the ring, costed with the *sender's* upload."""

    src: PeerId
    dst: PeerId
    latency_s: float
    latency_estimated: bool
    chunk_send_s: float  # serialising one prefill chunk onto src's uplink
    round_send_s: float  # serialising one decode round


@dataclass(frozen=True)
class StageTiming:
    peer: PeerId
    chunk_compute_s: float  # one prefill chunk over the stage's layers
    round_compute_s: float  # one decode round over the stage's layers


class RoleKind(enum.Enum):
    """What a node does in a ring epoch. The values are the wire's role names (one table,
    shard.wire.roles), so `RoleKind(assignment.role)` converts at the boundary."""

    STAGE = wire_roles.ROLE_STAGE  # a ring member; plans give roles only to the others
    HOT_STANDBY = wire_roles.ROLE_HOT_STANDBY
    SPOT_CHECK_VERIFIER = wire_roles.ROLE_SPOT_CHECK_VERIFIER
    WEIGHT_SEEDER = wire_roles.ROLE_WEIGHT_SEEDER
    RELAY = wire_roles.ROLE_RELAY


@dataclass(frozen=True)
class Role:
    kind: RoleKind
    reason: str
    stage_index: int | None = None  # the stage a standby would replace or a verifier checks


@dataclass(frozen=True)
class Move:
    """Weights a ring member must fetch before serving its slice."""

    peer: PeerId
    layers: LayerRange
    missing_layers: int
    bytes: int
    seconds: float
    source: PeerId  # who seeds them (a holder with the best uplink, or the coordinator)


@dataclass(frozen=True)
class Plan:
    """An ordered ring with its predictions: coordinator -> stages[0] -> ... -> coordinator."""

    stages: tuple[Stage, ...]
    ttft_s: float
    decode_step_s: float
    total_s: float
    hops: tuple[Hop, ...]  # len(stages) + 1, starting at the coordinator
    timings: tuple[StageTiming, ...]
    bottleneck_s: float  # the slowest pipeline resource per prefill chunk
    roles: Mapping[PeerId, Role] = field(default_factory=dict)
    moves: tuple[Move, ...] = ()
    move_s: float = 0.0  # weights fetch in parallel; the ring is ready after the slowest

    @property
    def peers(self) -> tuple[PeerId, ...]:
        return tuple(s.peer for s in self.stages)

    def describe(self) -> str:
        ring = " -> ".join(f"{s.peer}{s.layers}" for s in self.stages)
        return (f"{ring}: ttft {self.ttft_s:.3f} s, step {self.decode_step_s * 1e3:.1f} ms, "
                f"total {self.total_s:.3f} s, moves {len(self.moves)} ({self.move_s:.1f} s)")
