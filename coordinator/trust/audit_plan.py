"""Which (job, epoch, stage) an audit covers: the random draw after a job ends, and the plan.

A forked job's plan on the epoch it forked on carries its source's plan for the same stage
(`AuditPlan.prefix`): the frames whose K/V the stage copied into the job's first frame.
Pure given the rng. Knows nothing of fetching, replaying or comparing (coordinator.trust.audit).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from coordinator.trust.receipt_check import FinishedJob
from receipts import Receipt
from ring import PeerId
from shard.layers import LayerRange


@dataclass(frozen=True)
class AuditPlan:
    """One stage's frames of one (job, epoch) to replay, and which rounds to compare."""

    job_id: str
    epoch: int
    peer_id: PeerId
    layers: LayerRange
    is_tail: bool
    wire_dtype: str
    aux_dtype: str | None  # None: wire_dtype
    rounds: tuple[int, ...]  # every round sent on this epoch up to the last verified, in send order
    receipts: dict[int, Receipt]  # round -> this stage's verified receipt, for those rounds
    quant: str = "none"  # the weight quantisation the stage declared (shard.quant scheme name)
    # The job forked on this epoch: its first frame here started from the K/V slots
    # [0, prefix_len) of the source job's cache on the same stage. `prefix`: the source's
    # plan for this stage and epoch (its frames are replayed first, never compared); None
    # with prefix_len > 0: the source's receipts are unknown here (`source_unknown`).
    prefix: "AuditPlan | None" = None
    prefix_len: int = 0

    def under(self, quant: str) -> AuditPlan:
        """This plan, and its source's, for a stage that declared weight quantisation `quant`."""
        prefix = None if self.prefix is None else dataclasses.replace(self.prefix, quant=quant)
        return dataclasses.replace(self, quant=quant, prefix=prefix)

    @property
    def source_unknown(self) -> bool:
        """The job forked on this epoch from a source whose plan could not be made: this
        stage's frames of the fork cannot be replayed (the audit is skipped, nobody accused)."""
        return self.prefix_len > 0 and self.prefix is None


def _stage_plan(job: FinishedJob, epoch: int, index: int) -> AuditPlan | None:
    """The plan of stage `index` on `epoch`: every round sent on it up to its last verified
    one; None if no round of the epoch was verified."""
    sent, view = job.sent_rounds.get(epoch, []), job.epochs.get(epoch)
    verified = [i for i, r in enumerate(sent) if r in job.verified and job.verified[r].epoch == epoch]
    if view is None or not verified or index >= len(view.ring.stages):
        return None
    upto = sent[: verified[-1] + 1]
    receipts = {r: job.verified[r].receipts[index] for r in upto if r in job.verified and job.verified[r].epoch == epoch}
    peer, layers = view.ring.stages[index]
    a = view.ring.assignments[index]
    return AuditPlan(job.job_id, epoch, peer, layers, index == len(view.ring.stages) - 1, a.wire_dtype, a.aux_dtype,
                     tuple(upto), receipts)


def _with_prefix(plan: AuditPlan, job: FinishedJob, index: int, source: FinishedJob | None) -> AuditPlan:
    """`plan` with its source's plan for the same stage if the job forked on its epoch. The
    source's plan must be of the source the job named, on the same stage (same epoch:
    same ring); otherwise the source counts as unknown."""
    if job.prefix is None or job.prefix[0] != plan.epoch:
        return plan
    _, source_id, length = job.prefix
    prefix = None if source is None or source.job_id != source_id else _stage_plan(source, plan.epoch, index)
    if prefix is not None and (prefix.peer_id, prefix.layers) != (plan.peer_id, plan.layers):
        prefix = None
    return dataclasses.replace(plan, prefix=prefix, prefix_len=length)


def plan_audits(job: FinishedJob, rate: float, rng: random.Random,
                source: FinishedJob | None = None) -> list[AuditPlan]:
    """Select each (epoch, stage) of the job with probability `rate`; a plan covers every
    round sent on that epoch up to its last verified one. Pure given `rng` (the auditor
    uses SystemRandom: stages cannot predict it). One draw per (epoch, stage), in order.
    `source`: the FinishedJob of the job this one forked from (job.prefix), None if
    unknown; a plan on the fork's epoch carries the source's plan for its stage."""
    plans = []
    for epoch in sorted(job.sent_rounds):
        view = job.epochs.get(epoch)
        if view is None:
            continue
        for index in range(len(view.ring.stages)):
            if rng.random() >= rate:
                continue
            plan = _stage_plan(job, epoch, index)
            if plan is not None:
                plans.append(_with_prefix(plan, job, index, source))
    return plans
