"""The engine's side of the prefix cache: keeping finished jobs as sources, forks from them,
and ending the sources it lets go.

The index (coordinator.jobs.prefix_cache) decides; this keeps the rest in step with it. A
source is pinned with the frame releaser (coordinator.trust.frame_release) while it is kept,
and once more by every job that forks from it until that job's audits are over, so each
stage keeps the source's logged frames an audit of a fork replays first. A source let go
(least recently used, idle, its ring needing the room, its ring gone) gets its EndJob on
its ring if that ring still stands (the stages free its K/V and frames) and its pin back.
No source is kept, and no job forks, on a ring with a stage on probation: its rounds are
recomputed from each job's own frames (coordinator.trust.shadow), which a fork lacks.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import trio

from coordinator.jobs.prefix_cache import PrefixIndex, Source
from coordinator.swarm.swarm import RingState
from shard.transport import TransportError
from shard.wire.codec import encode
from shard.wire.messages import EndJob

log = logging.getLogger("shard.coordinator")


class PrefixSources:
    def __init__(self, index: PrefixIndex, *, ring_by_epoch: Callable[[int], RingState | None],
                 send_end: Callable[[RingState, bytes], Awaitable[None]], on_probation: Callable[[RingState], tuple],
                 slots: Callable[[int], int]) -> None:
        """`send_end(ring, body)`: an EndJob's body to `ring`'s head; `slots(tokens)`: the K/V
        slots a job's cache holds on a stage once it has written that many."""
        self.index = index
        self._ring_by_epoch, self._send_end, self._on_probation, self._slots = ring_by_epoch, send_end, on_probation, slots
        self.pins: Any = None  # the FrameReleaser when audits run (set by coordinator.assembly)
        self._ending: list[Source] = []
        self._wake = trio.Event()

    def fork(self, ring: RingState, prompt: Sequence[int], drafters: list) -> tuple[tuple[str, int], list] | None:
        """((source job, tokens), the job's drafters) a new job with `drafters` starts from on
        `ring`: those reading the target's features forked from the source's; None: it
        prefills all."""
        self.end(self.index.expire())
        if not self.index.enabled or self._on_probation(ring):
            return None
        hit = self.index.lookup(ring.epoch, prompt)
        if hit is None:
            return None
        source, n = hit
        forked = fork_drafters(drafters, source.drafters, n)
        if forked is None:
            return None
        # Until the fork's audits are over (the releaser drops it once the job is done with them). The
        # job records the frame naming the source with its receipts before its first checkpoint.
        self._pin(source.job_id)
        return (source.job_id, n), forked

    def keep(self, ring: RingState, job_id: str, tokens: Sequence[int], drafters: Sequence = ()) -> bool:
        """Whether the job that just ended on `ring` stays as a source of `tokens` (then the job's
        own EndJob says keep); its `drafters` reading the target's features are kept to fork."""
        if not self.index.enabled or self._on_probation(ring):
            return False
        readers = tuple(d for d in drafters if getattr(d, "aux_layers", ()))
        tokens = tokens[:min((d.observed_tokens for d in readers), default=len(tokens))]  # features known
        kept, gone = self.index.add(Source(job_id, ring.epoch, ring.ring_id, tuple(tokens), self._slots(len(tokens)),
                                           readers))
        if kept:
            self._pin(job_id)
        self.end(gone)
        return kept

    def failed(self, job_id: str) -> None:
        """A fork from `job_id` failed on a stage: it is no source any more."""
        self.end(self.index.drop(job_id))

    def free(self, ring_id: int) -> bool:
        """Let every source on ring `ring_id` go (a job needs their K/V room); whether any was there."""
        gone = self.index.drop_ring(ring_id)
        self.end(gone)
        return bool(gone)

    def ring_changed(self) -> None:
        """Sources of epochs no longer formed are gone with their stages' K/V."""
        self.end(self.index.drop_epochs(lambda epoch: self._ring_by_epoch(epoch) is not None))

    def end(self, gone: list[Source]) -> None:
        if gone:
            self._ending += gone
            self._wake.set()

    async def serve(self) -> None:
        """Send the EndJob of each source let go and give back its pin, forever."""
        while True:
            await self._wake.wait()
            self._wake = trio.Event()
            ending, self._ending = self._ending, []
            for source in ending:
                ring = self._ring_by_epoch(source.epoch)
                try:
                    if ring is not None:
                        await self._send_end(ring, encode(EndJob(job_id=source.job_id, epoch=source.epoch)))
                except TransportError as exc:  # the head gone: the stages' K/V go with the ring
                    log.info("EndJob of prefix source %s not sent: %s", source.job_id, exc)
                finally:
                    if self.pins is not None:  # its frames now last a stage's grace_s, pinned or not
                        self.pins.unpin(source.job_id, ended=True)

    def _pin(self, job_id: str) -> None:
        if self.pins is not None:
            self.pins.pin(job_id)


def fork_drafters(drafters: list, kept: Sequence, n: int) -> list | None:
    """`drafters` with each that reads the target's features (EAGLE) replaced by a fork of the
    kept drafter of its kind at `n` tokens; None when one has no such drafter to fork from."""
    out = []
    for d in drafters:
        if getattr(d, "aux_layers", ()):
            source = next((k for k in kept if type(k) is type(d) and k.aux_layers == d.aux_layers), None)
            if source is None or source.observed_tokens < n:
                return None
            d = source.fork(n)
        out.append(d)
    return out
