"""Which (job, epoch, stage) an audit covers: the random draw after a job ends, and the plan.

Pure given the rng. Knows nothing of fetching, replaying or comparing (coordinator.trust.audit).
"""

from __future__ import annotations

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


def plan_audits(job: FinishedJob, rate: float, rng: random.Random) -> list[AuditPlan]:
    """Select each (epoch, stage) of the job with probability `rate`; a plan covers every
    round sent on that epoch up to its last verified one. Pure given `rng` (the auditor
    uses SystemRandom: stages cannot predict it). One draw per (epoch, stage), in order."""
    plans = []
    for epoch, sent in sorted(job.sent_rounds.items()):
        view = job.epochs.get(epoch)
        if view is None:
            continue
        verified = [i for i, r in enumerate(sent) if r in job.verified and job.verified[r].epoch == epoch]
        for index, (peer, layers) in enumerate(view.ring.stages):
            if rng.random() >= rate or not verified:
                continue
            upto = sent[: verified[-1] + 1]
            receipts = {r: job.verified[r].receipts[index] for r in upto
                        if r in job.verified and job.verified[r].epoch == epoch}
            a = view.ring.assignments[index]
            plans.append(AuditPlan(job.job_id, epoch, peer, layers, index == len(view.ring.stages) - 1,
                                   a.wire_dtype, a.aux_dtype, tuple(upto), receipts))
    return plans
