"""ReleaseFrames: the coordinator tells a stage which (job, epoch) frame logs no audit needs.

A stage logs every frame of a job for audits (shard.frame_log). Once a job has finished and
the coordinator has drawn its audits (coordinator.trust.audit_plan), the frames of a stage
not drawn, or already audited, will never be asked for; the coordinator sends their keys in
batches on the stage's control stream (coordinator.trust.frame_release), and the stage drops
them at once (shard.audit_answers). Only the control stream the node opened to its own
coordinator carries it: a predecessor or a stranger cannot make a stage drop frames it may
be audited on. Registered in shard.wire.messages' allow-list like every other kind. Pure
data with its cross-field rule (`check`): nothing here drops or sends.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from shard.errors import WireError
from shard.wire.fields import JOB_ID, Int, ListOf, spec
from shard.wire.limits import Limits

# (job, epoch) pairs one message may name: at 32 streams a ring finishes a few jobs a
# second, and the coordinator flushes each second, so one message holds a second's jobs
# with room to spare; more go in the next one.
MAX_RELEASE_JOBS = 1024


@dataclass(frozen=True, kw_only=True)
class ReleaseFrames:
    """Coordinator -> stage (control stream): drop the frames you logged for job
    `job_ids[i]` on ring epoch `epochs[i]`, for every i; no audit will ask for them."""

    KIND: ClassVar[str] = "release_frames"
    job_ids: tuple[str, ...] = spec(ListOf(JOB_ID, max_items=MAX_RELEASE_JOBS))
    epochs: tuple[int, ...] = spec(ListOf(Int(), max_items=MAX_RELEASE_JOBS))

    def check(self, limits: Limits) -> None:
        if len(self.epochs) != len(self.job_ids):
            raise WireError("field 'epochs' length (one per job id)", len(self.job_ids), len(self.epochs))
