"""One job's port onto the RingEngine (coordinator.jobs.port.JobPort): what a RingJob may ask of it.

Sends go through the engine's BurstGate (coordinator.jobs.burst_gate), so a head product's
next frames leave together; each sent frame is counted in flight (coordinator.jobs.liveness)
and fed to the shadow when its ring is on probation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from coordinator.jobs.head_batch import take_next_burst
from coordinator.spec import adapt
from coordinator.swarm.swarm import RingState
from coordinator.swarm.topology import Traversal
from shard.wire.messages import Forward


@dataclass(frozen=True)
class EnginePort:
    """One job's port (coordinator.jobs.port.JobPort) onto the engine and its swarm."""

    engine: Any  # the coordinator.jobs.ring_engine.RingEngine that built it (imported there, not here)
    job_id: str

    @property
    def ring(self) -> RingState | None:
        return self.engine.router.ring_for(self.job_id)  # the job's own ring (coordinator.jobs.ring_router)

    async def wait_ring(self) -> RingState:
        return await self.engine.router.wait_ring(self.job_id)

    async def wait_change(self, epoch: int, timeout_s: float) -> None:
        await self.engine.swarm.wait_change(epoch, timeout_s)

    async def wait_room(self, timeout_s: float) -> None:
        """A stage refused this job for K/V: until its ring (or another) has room."""
        self.engine.router.refused(self.job_id)
        await self.engine.router.wait_room(self.job_id, timeout_s)

    async def send_body(self, ring: RingState, body: bytes, sent: Forward | None = None) -> None:
        await self.engine.gate.send(ring, body, sent)
        self.engine.liveness.frame_sent(ring.epoch, body, sent)  # rows in flight, for other jobs' deadlines
        await self.engine.shadow_feed(ring, body)  # before the job awaits its result

    def round_timer(self, ring: RingState, shape: Traversal):
        return self.engine.liveness.round_timer(ring, shape, self.job_id)

    def round_missed(self, ring: RingState, round: int) -> None:
        self.engine.round_missed(ring, round)

    def record_traversal(self, t: Traversal) -> None:
        self.engine.swarm.record_traversal(t)

    def hand_back(self, epoch: int, learned: adapt.AdaptState) -> None:
        self.engine.learned_adapt = (epoch, learned)

    def leave_burst(self, burst: tuple[int, ...]) -> None:
        self.engine.gate.leave(burst)

    def prefix_for(self, ring: RingState, prompt: list[int], drafters: list) -> tuple[tuple[str, int], list] | None:
        return self.engine.prefixes.fork(ring, prompt, drafters)

    def fork_failed(self, source: str) -> None:
        self.engine.prefixes.failed(source)

    def keep_source(self, ring: RingState, job_id: str, tokens: list[int], drafters: list) -> bool:
        return self.engine.prefixes.keep(ring, job_id, tokens, drafters)

    def close(self) -> None:
        """Also: the calling job task sends no frame for its head product's burst (it ended)."""
        self.engine.gate.leave(take_next_burst())
        self.engine.close_job(self.job_id)
