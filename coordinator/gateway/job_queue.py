"""Running generations under a limit, and the bounded queue in front of them (issue 21).

A request needs one slot per choice (`n`). It runs at once while slots are free and no
one waits; otherwise it waits, first come first served, in a queue of at most
`max_waiting` requests for at most `wait_s`. A request the queue cannot take, or whose
wait runs out, is refused with 429 and a `Retry-After` from how long slots have been
held. The decisions are pure functions (`admit`, `retry_after_s`); `JobQueue` is their
thin trio half. Does not know engines, HTTP or what a job does.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import trio

from coordinator.errors import RequestError

RUN, WAIT, REFUSE = "run", "wait", "refuse"
# Before any job has finished, a slot is expected to free within this long.
FIRST_JOB_S = 10.0
# How much of each finished job's time enters the running mean (older ones fade).
MEAN_WEIGHT = 0.2
MAX_RETRY_AFTER_S = 600


def admit(in_use: int, limit: int, waiting: int, max_waiting: int, wanted: int) -> str:
    """RUN, WAIT or REFUSE for a request wanting `wanted` slots. First come first served:
    a newcomer never runs ahead of a request already waiting, even if its own slots are free."""
    if wanted > limit:
        return REFUSE  # could never run
    if waiting == 0 and in_use + wanted <= limit:
        return RUN
    return WAIT if waiting < max_waiting else REFUSE


def retry_after_s(ahead: int, limit: int, mean_job_s: float) -> int:
    """Whole seconds a refused request should wait: until the `ahead` requests in front of
    it and itself could have started, `limit` at a time, each holding a slot `mean_job_s`."""
    rounds = (ahead + 1) / max(limit, 1)
    return max(1, min(MAX_RETRY_AFTER_S, math.ceil(rounds * mean_job_s)))


class QueueRefused(RequestError):
    """429: the server is at its limit and its queue is full or the wait ran out."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(429, message, type="rate_limit_error", code="too_many_concurrent_jobs")
        self.retry_after_s = retry_after_s


@dataclass
class Ticket:
    """A request's slots while it runs: how many, and since when (seconds, `clock`)."""

    slots: int
    since_s: float
    released: bool = False


@dataclass
class _Waiter:
    wanted: int
    ready: trio.Event = field(default_factory=trio.Event)
    ticket: Ticket | None = None


class JobQueue:
    """Slots for running generations; `max_waiting` = 0 refuses at once past the limit."""

    def __init__(self, limit: int, max_waiting: int = 0, wait_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit, self.max_waiting, self.wait_s, self.clock = limit, max_waiting, wait_s, clock
        self.in_use = 0
        self.waiters: deque[_Waiter] = deque()
        self.mean_job_s = FIRST_JOB_S

    @property
    def waiting(self) -> int:
        return len(self.waiters)

    def _refuse(self, why: str, ahead: int) -> QueueRefused:
        return QueueRefused(f"The server is running {self.in_use} generations, its limit, {why}; retry shortly.",
                            retry_after_s(ahead, self.limit, self.mean_job_s))

    async def acquire(self, wanted: int) -> Ticket:
        """`wanted` slots, at once or after waiting in the queue. Raises QueueRefused (429)
        when the queue is full or the wait runs out. Cancellation while waiting leaves
        the queue as if the request never came."""
        decision = admit(self.in_use, self.limit, self.waiting, self.max_waiting, wanted)
        if decision == RUN:
            self.in_use += wanted
            return Ticket(wanted, self.clock())
        if decision == REFUSE:
            why = (f"and a request for {wanted} choices can never fit" if wanted > self.limit else
                   f"and {self.waiting} requests already wait" if self.max_waiting else "and it does not queue")
            raise self._refuse(why, self.waiting)
        waiter = _Waiter(wanted)
        self.waiters.append(waiter)
        try:
            with trio.move_on_after(self.wait_s):
                await waiter.ready.wait()
        except BaseException:  # cancelled while waiting (the client left): as if it never came
            self._leave(waiter)
            raise
        if waiter.ticket is None:
            self._leave(waiter)
            raise self._refuse(f"and this request waited {self.wait_s:g} s in the queue", self.waiting)
        return waiter.ticket

    def release(self, ticket: Ticket) -> None:
        """Give a ticket's slots back (once; a second call does nothing) and start waiters."""
        if ticket.released:
            return
        held_s = self.clock() - ticket.since_s
        self.mean_job_s += MEAN_WEIGHT * (held_s - self.mean_job_s)
        self._give_back(ticket)

    def _give_back(self, ticket: Ticket) -> None:
        ticket.released = True
        self.in_use -= ticket.slots
        self._wake()

    def _leave(self, waiter: _Waiter) -> None:
        """A waiter that will not run: out of the queue, or its slots back if it was just
        started (a cancellation can land after _wake handed it a ticket)."""
        if waiter.ticket is not None:
            self._give_back(waiter.ticket)
        elif waiter in self.waiters:
            self.waiters.remove(waiter)
            self._wake()  # those behind it may fit now

    def _wake(self) -> None:
        """Start waiters from the front while the front one's slots are free."""
        while self.waiters and self.in_use + self.waiters[0].wanted <= self.limit:
            waiter = self.waiters.popleft()
            self.in_use += waiter.wanted
            waiter.ticket = Ticket(waiter.wanted, self.clock())
            waiter.ready.set()
