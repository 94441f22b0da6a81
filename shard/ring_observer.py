"""What a benchmark or test may watch of ring frames, as explicit hooks passed in.

A Node and the coordinator's ring engine each take one `RingObserver` and call it where a
frame crosses them: a ring frame sent (bytes with the length prefix, counted where the
sender hands it to its link), a coordinator round sent, a frame received and computed by
a stage, a tail's Result arrived, the coordinator's logits. The default observes nothing.
Hooks run on the trio thread, inline with the frame: they must not block or raise.
It does not time or aggregate anything itself (scripts/bench_ringkit.py's FrameProbe does).
"""

from __future__ import annotations

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
