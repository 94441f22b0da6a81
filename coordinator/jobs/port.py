"""What a ring job and the engine that runs it exchange, and nothing else.

A job asks its engine through a `JobPort`: send a frame body to the ring's head, wait for
a ring or for the ring to change, read the current ring, ask how long a round may take
and report one that took longer, record a traversal it measured, hand back what its
planner learned, close its inbox. Into that inbox the engine delivers
`Arrived` results, the stages' `JobError`s and `RingLost`. The engine builds one port
per job; a test builds a fake one. This module does not know streams, the swarm's
bookkeeping, or how a job turns results into tokens.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from coordinator.spec.adapt import AdaptState
from coordinator.swarm.swarm import RingState
from coordinator.swarm.topology import Traversal
from shard.wire.messages import Forward, Result


@dataclass(frozen=True)
class Arrived:
    """A Result from the tail, with the SHA-256 of its canonical bytes as received (what
    the tail's receipt must name as its output; b"" when receipts are off)."""

    result: Result
    digest: bytes


class JobPort(Protocol):
    """The ring as one job may use it."""

    @property
    def ring(self) -> RingState | None:
        """The current ring, None while none is formed."""
        ...

    async def wait_ring(self) -> RingState:
        """The current ring, once there is one."""
        ...

    async def wait_change(self, epoch: int, timeout_s: float) -> None:
        """Return once the ring is no longer epoch `epoch` (no ring counts as changed) or
        `timeout_s` passed; always a checkpoint."""
        ...

    async def wait_room(self, timeout_s: float) -> None:
        """A stage refused this job for K/V: return once its ring (or another it is moved
        to) has room, or `timeout_s` passed."""
        ...

    async def send_body(self, ring: RingState, body: bytes, sent: Forward | None = None) -> None:
        """Send one encoded frame body to `ring`'s head (`sent`: the Forward it encodes, if
        it is one, so nobody decodes our own frame again). Raises TransportError."""
        ...

    def leave_burst(self, burst: tuple[int, ...]) -> None:
        """The job sends no frame for this head product's burst (coordinator.jobs.burst_gate)
        after all: the product's other frames need not wait for one. Never blocks."""
        ...

    def round_timer(self, ring: RingState, shape: Traversal) -> AbstractContextManager[None]:
        """As trio.fail_after, for a round of `shape` (its traversal_s and compute_s unused)
        on `ring`: raises trio.TooSlowError out of the block once the round is missed
        (its deadline, coordinator.jobs.deadline, soft while the ring answers others:
        coordinator.jobs.liveness)."""
        ...

    def prefix_for(self, ring: RingState, prompt: list[int], drafters: list) -> tuple[tuple[str, int], list] | None:
        """((source job, tokens) of K/V kept on `ring` that a new job's prompt starts with, the
        job's drafters forked to match: coordinator.jobs.prefix_sources); None: it prefills all.
        Never blocks."""
        ...

    def fork_failed(self, source: str) -> None:
        """A frame forking from `source` failed on the ring: that source is gone."""
        ...

    def keep_source(self, ring: RingState, job_id: str, tokens: list[int], drafters: list) -> bool:
        """The job ended on `ring` with the K/V of `tokens` on every stage: whether they stay
        there for later prompts (then the engine, not the job, ends it on the stages), and
        its `drafters` for later jobs to fork."""
        ...

    def round_missed(self, ring: RingState, round: int) -> None:
        """Round `round` missed its deadline on `ring`: a stage of it sits out (the ring
        re-forms without it; the job resumes). Never blocks."""
        ...

    def record_traversal(self, t: Traversal) -> None:
        """A round the job measured, for the swarm's predictions against measurements."""
        ...

    def hand_back(self, epoch: int, learned: AdaptState) -> None:
        """What the job's planner learned on ring `epoch`; the next job starts from it."""
        ...

    def close(self) -> None:
        """Stop delivering to the job's inbox (idempotent)."""
        ...
