"""A stage's logged frames of forked jobs' sources, kept for the next fork's audit.

A forked job's audit fetches the stage's frames of its source job too
(coordinator.trust.prefix_audit), and a source is forked from again and again (chat resends
its system prompt and history every turn; bench_load's mix resends its six prompts): at 16
streams the source's prompt frames were most of the bytes a fork's audit fetched, the same
bytes every time, encoded on the stage's trio thread and carried over its control stream.
Kept here per (stage, source job, epoch, rounds) once fetched whole, least recently used
first out past `max_bytes`. A stage's records of a finished job's rounds do not change, and
they are checked against the source's receipts at every use (prefix_audit.with_source); a
stage that dropped them since is not asked again: the fork's replay starts from the frames
the source's receipts bind, which is what its audit checks. Knows nothing of replaying.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Awaitable, Callable

from coordinator.trust.audit_plan import AuditPlan

Records = dict[int, tuple[bytes, bytes]]  # round -> (input frame, output frame), as the stage logged them


class SourceFrames:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.held = max_bytes, 0
        self._kept: OrderedDict[tuple, tuple[Records, int]] = OrderedDict()
        self.hits = self.fetches = 0

    async def records(self, plan: AuditPlan, fetch: Callable[[AuditPlan], Awaitable[Records]]) -> Records:
        """The stage's records of the source's rounds in `plan` (the fork's plan.prefix): kept,
        else `fetch(plan)`, kept when every round came back (a record missing is the audit's
        finding, not something to remember). Error handling: fetch's errors pass through."""
        key = (plan.peer_id, plan.job_id, plan.epoch, plan.rounds)
        if key in self._kept:
            self.hits += 1
            self._kept.move_to_end(key)
            return self._kept[key][0]
        self.fetches += 1
        got = await fetch(plan)
        size = sum(len(i) + len(o) for i, o in got.values())
        if len(got) == len(plan.rounds) and size <= self.max_bytes and key not in self._kept:
            self._kept[key], self.held = (got, size), self.held + size
            while self.held > self.max_bytes:
                self.held -= self._kept.popitem(last=False)[1][1]
        return got

    def __len__(self) -> int:
        return len(self._kept)
