"""How long one round may take on a ring before it counts as missed.

Pure: the cost model's prediction for the round (from the stages' compute speeds and the
measured links, coordinator.swarm.topology.predict) and how recent rounds on this ring
measured against their own predictions in; seconds out. A stage that accepts frames and
never answers then costs a user a few times the round's expected time, not the old fixed
120 s per frame (4 attempts: 520 s and a 503). Knows nothing of rings, stages or clocks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class DeadlinePolicy:
    # A round waits behind other jobs' frames on a busy stage and shares its cores with
    # them: 5x what this ring has been measured to take (in the worst recent round,
    # relative to its prediction) leaves room for that without a false alarm.
    slack: float = 5.0
    # Added to any deadline: a scheduler hiccup, a GC pause, a first forward warming up
    # kernels costs seconds whatever the prediction says.
    margin_s: float = 5.0
    max_s: float = 120.0  # per frame of the round: never longer than a fixed timeout was
    # A cost model that under-predicts by more than this is not trusted to scale from: the
    # ring is measured to be that much slower, so the deadline stops at max_s instead.
    max_ratio: float = 50.0


def round_deadline_s(predicted_s: float | None, measured_ratios: Sequence[float], frames: int,
                     policy: DeadlinePolicy = DeadlinePolicy(), queued_s: float = 0.0) -> float:
    """Seconds from sending a round's first frame to its last result, past which the round
    is missed. `predicted_s`: the cost model's time for this round on this ring (None: no
    prediction, e.g. no plan yet); `measured_ratios`: measured / predicted traversal time
    of recent rounds on this ring (empty on a new ring: the prediction stands alone, at
    least 1x); `frames`: frames the round sends (each may wait its own turn on a stage);
    `queued_s`: the predicted time of other jobs' work that may be ahead of this round at
    a stage (a busy ring: without it, 32 streams on a 3-stage CPU ring had decode rounds
    wait behind others' prefill chunks past their deadline, and honest stages were blamed
    as stalled 7 times in 120 s — bench_load).

    The deadline is slack x (prediction + queued) x (the worst recent ratio, at least 1) +
    margin, capped at max_s per frame; without a usable prediction it is the cap."""
    cap_s = policy.max_s * max(frames, 1)
    if predicted_s is None or not math.isfinite(predicted_s) or predicted_s < 0:
        return cap_s
    ratios = [r for r in measured_ratios if math.isfinite(r) and r > 0]
    ratio = max([1.0, *ratios])
    if ratio > policy.max_ratio:
        return cap_s
    queued_s = queued_s if math.isfinite(queued_s) and queued_s > 0 else 0.0
    return min(cap_s, policy.slack * (predicted_s + queued_s) * ratio + policy.margin_s)
