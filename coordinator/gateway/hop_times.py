"""Each hop's transfer time, from the clocks a frame collects on its way round the ring.

The coordinator notes its wall clock when it sends a frame (`sent_at_s`); each stage
stamps the frame's `clock_s` when it takes it in and when it hands its output on; the
tail's Result comes back at `arrived_at_s`. Hop i (0: coordinator -> head, N: tail ->
coordinator) is its receiver's take-in less its sender's hand-off: the sender's outbox
wait, serialisation on its uplink, the link's latency and the receiver's read. A stage's
queueing and compute fall between its own two stamps, outside every hop.

Clocks: each stamp is its machine's wall clock. Uncorrected, a hop's figure carries the
offset between its two ends' clocks (a stage whose clock runs 3 s ahead adds 3 s to the hop
into it and takes 3 s from the hop out of it); their sum carries none. So each stage's
stamps are first put on the coordinator's clock by subtracting that stage's offset
(`offsets_s`: coordinator.swarm.clock_offset's NTP-style estimate, applied only where the
round trips tell the clocks apart; the coordinator's own stamps have offset 0): a hop's
figure is then off by at most its two ends' estimate uncertainties (rtt/2 each), and the
sum is unchanged. On one machine (`--local-nodes`, tests) every figure is exact. A figure
may still come out below zero when the residual exceeds the hop: reported as measured in
/v1/ring, clamped at 0 in the histogram (see metrics.py).

`hop_transfers_s` is the pure arithmetic; `HopWindow` keeps recent frames of the current
ring for medians; `with_measured_hops` folds them into /v1/ring's plan hops. Knows nothing
of streams, Prometheus or HTTP.
"""

from __future__ import annotations

import copy
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

WINDOW_FRAMES = 256  # recent frames per kind whose medians /v1/ring shows
# A frame's kind for the medians: prefill chunks are big (hundreds of rows), decode and
# verify frames a few rows, and a hop's transfer grows with the bytes it carries.
KINDS = {"prefill": "prefill", "decode": "decode", "verify": "decode"}


def hop_transfers_s(sent_at_s: float, clock_s: Sequence[float], arrived_at_s: float,
                    stages: int, offsets_s: Sequence[float] | None = None) -> tuple[float, ...] | None:
    """The N+1 hops' transfer seconds of one frame through N stages, or None when its
    stamps do not fit the ring (not two per stage: a stage that does not stamp, or a
    frame that did not cross the ring this Result says it did). `offsets_s`: each stage's
    clock less the coordinator's, in ring order (None, or not one per stage: all 0)."""
    if stages < 1 or len(clock_s) != 2 * stages:
        return None
    offsets = offsets_s if offsets_s is not None and len(offsets_s) == stages else (0.0,) * stages
    took_in = [t - off for t, off in zip(clock_s[0::2], offsets)]  # on the coordinator's clock
    handed_on = [t - off for t, off in zip(clock_s[1::2], offsets)]
    starts = (sent_at_s, *handed_on)  # each hop's sender's hand-off
    ends = (*took_in, arrived_at_s)  # each hop's receiver's take-in
    return tuple(end - start for start, end in zip(starts, ends))


class HopWindow:
    """Recent frames' hop transfers on one ring epoch: a new epoch starts it over (its hops
    are other links). Bounded: the newest `frames` per kind."""

    def __init__(self, frames: int = WINDOW_FRAMES) -> None:
        self.epoch: int | None = None
        self.samples: dict[str, deque[tuple[float, ...]]] = {k: deque(maxlen=frames) for k in set(KINDS.values())}

    def add(self, epoch: int, phase: str, hops: tuple[float, ...]) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            for window in self.samples.values():
                window.clear()
        self.samples[KINDS[phase]].append(hops)

    def summary(self) -> list[dict[str, Any]]:
        """Per hop, in ring order: the median transfer per kind (None: no frame of it) and
        how many frames each median is over. Frames whose hop count differs from the
        newest's (cannot happen within an epoch) are left out."""
        newest = max((w[-1] for w in self.samples.values() if w), key=len, default=())
        out = []
        for i in range(len(newest)):
            medians, counts = {}, {}
            for kind, window in sorted(self.samples.items()):
                values = [hops[i] for hops in window if len(hops) == len(newest)]
                medians[kind] = statistics.median(values) if values else None
                counts[kind] = len(values)
            out.append({"transfer_s": medians, "frames": counts})
        return out


def with_measured_hops(info: dict[str, Any], window: HopWindow) -> dict[str, Any]:
    """Engine info (GET /v1/ring) with each plan hop's measured transfer added as
    `measured` (medians per kind, seconds, and their frame counts), when the window holds
    frames of the ring the info describes: same epoch, one hop per plan hop. Otherwise
    each plan hop gets `measured: None`: not measured on this ring yet."""
    out = copy.deepcopy(info)
    hops = ((out.get("topology") or {}).get("plan") or {}).get("hops")
    if not hops:
        return out
    summary = window.summary() if window.epoch is not None and window.epoch == out.get("epoch") else []
    for i, hop in enumerate(hops):
        hop["measured"] = summary[i] if len(summary) == len(hops) else None
    return out
