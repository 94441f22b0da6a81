"""What a benchmark or test may watch of ring frames, as explicit hooks passed in.

A Node and the coordinator's ring engine each take one `RingObserver` and call it where a
frame crosses them (the engine times its logits through an `ObservedHead`): a ring frame sent (bytes with the length prefix, counted where the
sender hands it to its link), a coordinator round sent, a frame received and computed by
a stage, a tail's Result arrived, the coordinator's logits. The default observes nothing.
Hooks run inline with the frame, on the trio thread (logits_computed: in the worker thread
that computed them): they must not block or raise.
It does not time or aggregate anything itself (scripts/bench_ringkit.py's FrameProbe does).
"""

from __future__ import annotations

import time

import torch

from shard.stage import OutputHead
from shard.wire.messages import Forward, Result


class RingObserver:
    """Every hook a no-op; an observer overrides the ones it needs."""

    def frame_sent(self, sender: str, nbytes: int) -> None:
        """`sender` (a stage's or the coordinator's peer id) sent a ring frame of `nbytes`
        (its body plus the u32 length prefix) to its successor."""

    def round_sent(self, fwd: Forward) -> None:
        """The coordinator is sending round `fwd.round` of job `fwd.job_id` to the head."""

    def stage_received(self, stage: str, fwd: Forward) -> None:
        """Stage `stage` took `fwd` off its ring stream (before its compute)."""

    def stage_computed(self, stage: str, fwd: Forward) -> None:
        """Stage `stage` has its output for `fwd` encoded and signed, ready to send."""

    def result_arrived(self, result: Result) -> None:
        """A tail's Result reached the coordinator (before its receipts are checked)."""

    def logits_computed(self, seconds: float) -> None:
        """The coordinator's final norm and LM head took `seconds` over one batch of rows."""


NO_OBSERVER = RingObserver()


class ObservedHead:
    """An OutputHead whose logits report their time to an observer; the head is unchanged."""

    def __init__(self, head: OutputHead, observer: RingObserver) -> None:
        self._head, self._observer = head, observer
        self.cfg, self.norm, self.lm_head = head.cfg, head.norm, head.lm_head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = self._head.logits(hidden)
        self._observer.logits_computed(time.perf_counter() - t0)
        return out
