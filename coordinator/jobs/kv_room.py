"""How much K/V a ring's stages hold, and whether one more job fits there (issue 21).

A stage refuses a frame (CacheFullError, its JobError) when opening or growing a job's
cache would pass its K/V bytes: what its node registered as memory less its layers'
weights (shard.kv_budget, by which the node sizes its cache). A job's
cache starts at INITIAL_SLOTS and grows by doubling up to its max_slots (shard.kvcache),
so what a job holds once it has written n slots is not n but the doubling step past it;
`job_slots` counts that (conservatively when one frame may write more than INITIAL_SLOTS).
A ring fits a job when, on each stage, the slots its jobs will hold plus the newcomer's fit
that stage's bytes, and its job count stays under the stage's open-jobs cap and under what
the stages' refusals taught (`Room.learned_jobs`: estimates can be wrong). Pure arithmetic:
the router (coordinator.jobs.ring_router) supplies the figures and decides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shard.kvcache import INITIAL_SLOTS


def job_slots(tokens: int, max_slots: int, step: int) -> int:
    """Slots a job's cache holds on a stage once `tokens` slots are written, frames writing
    at most `step` slots each. While a frame writes no more than INITIAL_SLOTS it never
    crosses more than the capacity it finds, so the cache doubles: exactly the doubling step
    at or past `tokens`. A larger frame can grow it to itself and the next one past that to
    twice it, so then at most 2 * (tokens - 1), the most any growth can reach."""
    cap = min(INITIAL_SLOTS, max_slots)
    while cap < min(tokens, max_slots):
        cap = min(max_slots, 2 * cap)
    return cap if step <= INITIAL_SLOTS else min(max_slots, max(cap, 2 * (tokens - 1)))


@dataclass(frozen=True)
class StageRoom:
    """One stage's K/V bound: bytes, bytes per slot of its layers, open-jobs cap (0: none)."""

    kv_bytes: int
    bytes_per_slot: int
    max_jobs: int = 0

    @property
    def slots(self) -> int:
        return self.kv_bytes // max(self.bytes_per_slot, 1)


@dataclass(frozen=True)
class Room:
    """A ring's stages and what its jobs hold: `reserved` slots each (the same on every
    stage: a slot is one position), `learned_jobs` the most jobs it held when a stage
    refused one (0: no refusal seen on this ring)."""

    stages: Sequence[StageRoom]
    reserved: Sequence[int]
    learned_jobs: int = 0

    def fits(self, slots: int) -> bool:
        """Whether a job that will hold `slots` slots fits beside the ones there now."""
        jobs, held = len(self.reserved) + 1, sum(self.reserved) + slots
        if self.learned_jobs and jobs > self.learned_jobs:
            return False
        return all(held <= s.slots and (not s.max_jobs or jobs <= s.max_jobs) for s in self.stages)

    def could_ever_fit(self, slots: int) -> bool:
        """Whether the job fits this ring with nothing else on it."""
        return all(slots <= s.slots for s in self.stages)
