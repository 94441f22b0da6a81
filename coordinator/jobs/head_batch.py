"""The coordinator's output head, shared by every job: one matmul for the rows waiting.

The gateway keeps the model's final norm and LM head (SmolLM2: 49152 x 576 f32, 113 MB
read per product). Per job, sixteen jobs each finishing a round cost sixteen products
reading the whole head for one row each; the rows of all of them in one product read it
once (measured on the 2-core dev VM, 1 thread: 3.4 ms for 1 row, 14 ms for 16).

`HeadBatcher.logits(hidden)` hands a job's rows to whatever product runs next: the first
ask while none runs starts one at once with everything waiting (never waiting for
company: a lone job's rows run alone, as before); asks that arrive while a product runs
go together in the next one, which the first of them runs. Each ask's logits equal its
rows alone: the norm is per row, and the head's `shard.linear.Linear` multiplies a row
the same way in every multi-row product (a lone row runs as two where oneDNN's one-row
kernel differs; tests/coordinator/jobs/test_head_batch.py checks SmolLM2 bitwise). A
product that raises (one job's rows of a wrong width) is run again ask by ask, so only
the ask at fault gets the error.

An ask may carry `then`, a function of its logits that the product's worker thread runs
right after the product (the ask gets its result): a sampled round's acceptance rides
the product's one thread hop instead of taking a hop of its own per job.
`accept_batched` runs a round's acceptance (coordinator.spec.target.accept_round) on
logits from the batcher: all rows at once, acceptance in the product's thread, when
there are few (a decode round's one row, a small tree), else asked lazily row by row
from a worker thread as the walk needs them.
Bursts (shard.wire.trailer): a job's task notes the burst of the Result it took
(`note_arrived`); a product about to start while an ask's burst has not all asked yet waits
for the rest, and each ask of a product leaves with that product's burst for its job's
next frame (`take_next_burst`), so the head stage gets the group's frames as one burst.
How long it waits: while some of the burst's Results reached their jobs (`received`,
from the ring stream) whose jobs have not asked yet, have no ask waiting already (a job
asks for one Result at a time: its next waits for this product) and did not skip them
(`skipped`: a discarded round's), the rest is work in hand (their jobs check receipts
before they ask: ~10 ms for a burst at 16 streams on the dev VM), so it waits for them up
to IN_HAND_WAIT_S after the first ask; else up to `burst_wait_s` (company that may never
come). A lone ask never waits.
Groups (`groups` > 0): where the ring's stages share a few cores (a local ring on a small
machine), more groups of jobs in flight than cores only time-slice them and make every
forward smaller (at 16 streams on the 2-core dev VM the three stages and the gateway each held
one group of ~4). A product about to start with fewer jobs than 1/`groups` of those that
asked in the last ACTIVE_WINDOW_S waits for more asks, up to `group_wait_s`: the groups
in flight merge until there are about `groups` of them. A lone job (or any number at most
`groups`) never waits for this.
Knows nothing of rings or jobs beyond the rows they hand it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import trio

T = TypeVar("T")
log = logging.getLogger("coordinator.jobs")

# A round with at most this many rows has all its logits computed up front, in one ask;
# a bigger tree asks row by row as the acceptance walk needs them (most of it is never
# walked). In a product with other jobs' rows, 16 more rows cost about 3x one row here.
EAGER_ROWS = 16
# Rows in one product at most (SmolLM2: 256 rows of logits are 50 MB); the rest wait.
MAX_BATCH_ROWS = 256
# The longest a product waits for a burst's Results already received but not yet asked
# (their jobs' receipt checks under load); a Result whose job never asks (it ended, its
# receipts failed) costs the product at most this. burst_wait_s 0 turns it off too.
IN_HAND_WAIT_S = 0.025
TALLY_EVERY_S = 10.0  # how often how full the products were is logged, while they run
# Jobs that asked within this long count as in flight for the group bound (a round at 16
# streams takes ~0.3 s on the dev VM's loopback ring; a job that stops asking drops out).
ACTIVE_WINDOW_S = 0.5


# Per job task: the burst of the Result it took last, and the burst its next frame carries.
_ARRIVED: ContextVar[tuple[tuple[int, ...], str]] = ContextVar("arrived_burst", default=((), ""))
_NEXT: ContextVar[tuple[int, ...]] = ContextVar("next_burst", default=())


def note_arrived(burst: tuple[int, ...], job_id: str) -> None:
    """The calling job task (of job `job_id`) took a Result of this burst (its next ask belongs to it)."""
    _ARRIVED.set((tuple(burst), job_id))


def take_next_burst() -> tuple[int, ...]:
    """The burst the calling job task's next frame carries (once; () after)."""
    burst = _NEXT.get()
    _NEXT.set(())
    return burst


class Head(Protocol):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class _Burst:
    size: int
    received: set[str] = field(default_factory=set)  # jobs whose Result of it reached their inbox
    skipped: set[str] = field(default_factory=set)  # jobs that took theirs as stale (no ask to come)
    asked_jobs: set[str] = field(default_factory=set)  # jobs that asked with it (one ask each: the next has no burst)
    first_asked_s: float | None = None  # trio time of its first ask
    seen_s: float = 0.0  # trio time it was first heard of (received or asked)

    def deadline_s(self, burst_wait_s: float, waiting_jobs: set[str]) -> float | None:
        """Until when a product waits for its rest (None: nothing to wait for); `waiting_jobs`
        have an ask in this product already (their next ask comes after it)."""
        if self.first_asked_s is None or len(self.asked_jobs) >= self.size:
            return None
        in_hand = self.received - self.asked_jobs - self.skipped - waiting_jobs
        return self.first_asked_s + (IN_HAND_WAIT_S if in_hand else burst_wait_s)


@dataclass(eq=False)
class _Ask:
    hidden: torch.Tensor  # (T, H)
    then: Callable[[torch.Tensor], object] | None = None  # run on its logits in the product's thread
    burst: tuple[int, ...] = ()  # the burst of the Result its rows came in
    job_id: str = ""
    sent_with: tuple[int, ...] = ()  # the product's burst, for the job's next frame
    woken: trio.Event = field(default_factory=trio.Event)  # its product ran, or it must run the next
    done: bool = False
    runs_next: bool = False  # handed the turn to run the next product
    out: object = None  # its logits (T, V), then what `then` made of them
    error: BaseException | None = None


class HeadBatcher:
    """One output head for many jobs (all on one trio thread); products run in a worker thread."""

    def __init__(self, head: Head, max_rows: int = MAX_BATCH_ROWS, burst_wait_s: float = 0.0,
                 groups: int = 0, group_wait_s: float = 0.0) -> None:
        self.head, self.max_rows, self.burst_wait_s = head, max_rows, burst_wait_s
        self.groups, self.group_wait_s = groups, group_wait_s
        self._last_ask: dict[str, float] = {}  # job id -> trio time of its last ask (the group bound)
        self._waiting: list[_Ask] = []
        self._asked = trio.Event()  # set (and replaced) whenever an ask or a burst's Result arrives
        self._bursts: dict[int, _Burst] = {}
        self.waits, self.waited_s = 0, 0.0  # products that waited (a group, a burst's rest), how long
        self._tally = (0.0, 0, 0, 0, 0, 0.0)  # since, products, asks, rows, waits, waited_s (logged every TALLY_EVERY_S)
        self._busy = False  # a product runs, or the ask handed the turn is about to run one
        self.products = 0  # products run (a figure for tests and benchmarks)
        self.rows = 0  # rows they multiplied

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, H) -> logits (T, V), equal to `head.logits(hidden)` alone. Raises what
        the head raises for these rows alone."""
        return await self.logits_then(hidden, None)

    async def logits_then(self, hidden: torch.Tensor, then: Callable[[torch.Tensor], T] | None) -> T:
        """`then(logits)` (the logits themselves if None), `then` run in the product's worker
        thread. Raises what the head raises for these rows alone, or what `then` raises."""
        ask = _Ask(hidden, then, *_ARRIVED.get())
        _ARRIVED.set(((), ""))
        self._waiting.append(ask)
        self._note(ask.burst, ask.job_id)
        if self._busy:
            try:
                await ask.woken.wait()
            except BaseException:  # cancelled while waiting: leave no turn and no rows behind
                if ask in self._waiting:
                    self._waiting.remove(ask)
                if ask.runs_next and not ask.done:
                    self._busy = False
                    self._hand_over()
                raise
        if not ask.done:  # its turn: run a product for itself and whoever waits now
            self._busy = True
            try:
                await self._gather()
            except BaseException:  # cancelled while waiting for a burst: hand the turn on
                self._waiting.remove(ask)
                self._busy = False
                self._hand_over()
                raise
            batch = self._take()
            self._log_tally(batch)
            try:
                await trio.to_thread.run_sync(self._run, batch)  # not abandoned on cancel: the others need it
            finally:
                for a in batch:
                    a.done = True
                    a.woken.set()
                self._busy = False
                self._hand_over()
        if ask.error is not None:
            raise ask.error
        _NEXT.set(ask.sent_with)
        return ask.out

    def _log_tally(self, batch: list[_Ask]) -> None:
        """Count a product about to run; every TALLY_EVERY_S log how full the products were."""
        now, t = trio.current_time(), self._tally
        if now - t[0] >= TALLY_EVERY_S:
            if t[1]:
                waits = self.waits - t[4]
                log.info("head products: %d in %.0f s, %.1f asks and %.1f rows each; waited for a group or a burst's "
                         "rest %d times, %.2f ms each", t[1], now - t[0], t[2] / t[1], t[3] / t[1], waits,
                         1e3 * (self.waited_s - t[5]) / max(waits, 1))
            t = (now, 0, 0, 0, self.waits, self.waited_s)
        self._tally = (t[0], t[1] + 1, t[2] + len(batch), t[3] + sum(a.hidden.shape[0] for a in batch), t[4], t[5])

    def received(self, burst: tuple[int, ...], job_id: str) -> None:
        """A Result of this burst reached job `job_id`'s inbox (its ask is to come)."""
        if len(burst) == 2 and burst[1] > 1:
            self._entry(burst).received.add(job_id)
            self._asked.set()  # a product waiting on the timer may now wait for work in hand
            self._asked = trio.Event()

    def _entry(self, burst: tuple[int, ...]) -> _Burst:
        now = trio.current_time()
        if len(self._bursts) > 1024:  # long complete or given up
            self._bursts = {k: v for k, v in self._bursts.items() if now - v.seen_s <= 1.0}
        entry = self._bursts.get(burst[0])
        if entry is None:
            entry = self._bursts[burst[0]] = _Burst(burst[1], seen_s=now)
        return entry

    def skipped(self, burst: tuple[int, ...], job_id: str) -> None:
        """Job `job_id` took its Result of this burst as stale (a discarded round's): no ask comes."""
        if len(burst) == 2 and burst[1] > 1 and (entry := self._bursts.get(burst[0])) is not None:
            entry.skipped.add(job_id)
            self._asked.set()
            self._asked = trio.Event()

    def forget(self, job_id: str) -> None:
        """`job_id` ended: it asks no more, so no product waits for it (the group bound counted
        it for ACTIVE_WINDOW_S after its last ask: products in a cluster of jobs ending
        together each waited the whole group_wait_s for asks that never came)."""
        self._last_ask.pop(job_id, None)

    def _note(self, burst: tuple[int, ...], job_id: str) -> None:
        self._asked.set()
        self._asked = trio.Event()
        if job_id and self.groups > 0:  # pruned per product (_gather_group); kept only where it is read
            self._last_ask[job_id] = trio.current_time()
        if len(burst) == 2 and burst[1] > 1:
            entry = self._entry(burst)
            entry.asked_jobs.add(job_id)
            if entry.first_asked_s is None:
                entry.first_asked_s = trio.current_time()

    async def _gather(self) -> None:
        """Wait until every waiting ask's burst has asked in full, or its bound passes:
        IN_HAND_WAIT_S after its first ask while more of it was received than asked,
        burst_wait_s while not; first, with `groups`, for a group's worth of jobs."""
        started = trio.current_time()
        waited = await self._gather_group()
        if self.burst_wait_s <= 0:
            self._count_wait(started, waited)
            return
        while True:
            waiting_jobs = {a.job_id for a in self._waiting}
            bounds = [e.deadline_s(self.burst_wait_s, waiting_jobs) for a in self._waiting
                      if len(a.burst) == 2 and (e := self._bursts.get(a.burst[0]))]
            deadline = min((b for b in bounds if b is not None), default=None)
            if deadline is None or deadline <= trio.current_time():
                break
            waited = True
            with trio.move_on_at(deadline):
                await self._asked.wait()
        self._count_wait(started, waited)

    async def _gather_group(self) -> bool:
        """Wait, up to group_wait_s, until the waiting asks come from 1/groups of the jobs
        that asked in the last ACTIVE_WINDOW_S (their ask counted); whether it waited."""
        if self.groups <= 0:
            return False
        now = trio.current_time()
        self._last_ask = {j: t for j, t in self._last_ask.items() if now - t < ACTIVE_WINDOW_S}
        need, deadline, waited = math.ceil(len(self._last_ask) / self.groups), now + self.group_wait_s, False
        while len({a.job_id for a in self._waiting}) < need and trio.current_time() < deadline:
            waited = True
            with trio.move_on_at(deadline):
                await self._asked.wait()
        return waited

    def _count_wait(self, started: float, waited: bool) -> None:
        if waited:
            self.waits += 1
            self.waited_s += trio.current_time() - started

    def _take(self) -> list[_Ask]:
        """The oldest waiting asks whose rows fit max_rows (the oldest always)."""
        batch, rows = [], 0
        for a in list(self._waiting):
            if batch and rows + a.hidden.shape[0] > self.max_rows:
                break
            batch.append(a)
            rows += a.hidden.shape[0]
        del self._waiting[:len(batch)]
        sent_with = ((self.products + 1) % (1 << 32), len(batch)) if len(batch) > 1 else ()
        for a in batch:  # their jobs' next frames leave as one burst
            a.sent_with = sent_with
        return batch

    def _hand_over(self) -> None:
        """Give the turn to the oldest waiting ask, if any (it runs the next product)."""
        if self._waiting and not self._busy:
            self._busy = True
            self._waiting[0].runs_next = True
            self._waiting[0].woken.set()

    def _run(self, batch: list[_Ask]) -> None:
        """Worker thread: one product for the batch, split back per ask, then each ask's
        `then`; if the product raises, each ask alone, so an error stays with the ask that
        caused it."""
        self._product(batch)
        for a in batch:
            if a.then is not None and a.error is None:
                try:
                    a.out = a.then(a.out)
                except Exception as exc:  # noqa: BLE001 - handed to the ask's own job
                    a.error = exc

    def _product(self, batch: list[_Ask]) -> None:
        self.products += 1
        self.rows += sum(a.hidden.shape[0] for a in batch)
        if len(batch) > 1:
            try:
                out = self.head.logits(torch.cat([a.hidden for a in batch]))
            except Exception:  # noqa: BLE001 - one ask's rows; found below by running each alone
                pass
            else:
                start = 0
                for a in batch:
                    a.out = out[start:start + a.hidden.shape[0]]
                    start += a.hidden.shape[0]
                return
        for a in batch:
            try:
                a.out = self.head.logits(a.hidden)
            except Exception as exc:  # noqa: BLE001 - handed to the ask's own job
                a.error = exc


async def accept_batched(head: HeadBatcher, rows: torch.Tensor,
                         accept: Callable[[Callable[[list[int]], torch.Tensor]], T], *, cheap: bool = False) -> T:
    """`accept(logits_of)`, where `logits_of(indices)` gives the logits of those of `rows`
    (M+1, H) from `head`: all of them computed first when there are at most EAGER_ROWS
    (the acceptance then runs in the product's worker thread), else each call asks the
    batcher from a worker thread of its own. `cheap`: the acceptance is a few argmaxes
    (greedy, no grammar): it runs here once the logits are in, sparing the product's
    thread (and the asks of other jobs waiting on it) its time."""
    if rows.shape[0] <= EAGER_ROWS:
        if cheap:
            logits = await head.logits(rows)
            return accept(lambda r: logits[r])
        return await head.logits_then(rows, lambda logits: accept(lambda r: logits[r]))
    return await trio.to_thread.run_sync(lambda: accept(lambda r: trio.from_thread.run(head.logits, rows[r])))
