"""Where a stage's CPU goes: its forwards' thread CPU seconds and rows by frame phase.

A stage worker adds every forward (its frames' rows and the CPU seconds the forward thread
spent: torch runs one thread per node, so a forward's CPU is that thread's) and every
`every_s` seconds one line is logged: rows and CPU-s by phase (prefill, decode, verify;
a batch's CPU shared by its rows), and the whole process's CPU-s over the same time, so
what is not forwards (transport, codec, signing, audits' replays) shows as the rest
(issue 21: rows and CPU by kind per generated token). Knows nothing of frames beyond
their phase and rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

log = logging.getLogger("shard.node")


class ForwardCpu:
    """Rows and CPU-s of forwards by phase since `since` (time.monotonic by default)."""

    def __init__(self, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic,
                 process_cpu: Callable[[], float] = time.process_time) -> None:
        self.every_s, self.clock, self.process_cpu = every_s, clock, process_cpu
        self._reset()

    def _reset(self) -> None:
        self.since, self.process_since = self.clock(), self.process_cpu()
        self.rows: dict[str, int] = {}
        self.cpu_s: dict[str, float] = {}

    def add(self, frames: Sequence[tuple[object, object]], pieces: Sequence[tuple[int, int] | None], cpu_s: float) -> None:
        """One forward: `frames` (message, bytes) run as `pieces` (None: whole) in cpu_s."""
        rows = [(getattr(f, "phase", "?"), int(f.positions.shape[0]) if p is None else p[1] - p[0])
                for (f, _), p in zip(frames, pieces)]
        total = sum(n for _, n in rows)
        for phase, n in rows:
            self.rows[phase] = self.rows.get(phase, 0) + n
            self.cpu_s[phase] = self.cpu_s.get(phase, 0.0) + cpu_s * n / max(total, 1)
        if self.clock() - self.since >= self.every_s:
            log.info("stage CPU: %s", self.summary())
            self._reset()

    def summary(self) -> str:
        """Rows and CPU-s by phase since `since`, and the process's CPU-s."""
        parts = ", ".join(f"{phase} {self.rows[phase]} rows {self.cpu_s[phase]:.2f} s" for phase in sorted(self.rows))
        forwards = sum(self.cpu_s.values())
        process = self.process_cpu() - self.process_since
        return (f"{self.clock() - self.since:.0f} s: forwards {forwards:.2f} CPU-s ({parts or 'none'}); "
                f"process {process:.2f} CPU-s, {process - forwards:.2f} outside forwards")
