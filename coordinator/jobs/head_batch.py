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

`accept_batched` runs a round's acceptance (coordinator.spec.target.accept_round) in a
worker thread on logits from the batcher: all rows at once when there are few (a decode
round's one row, a small tree), else asked lazily row by row as the walk needs them.
Knows nothing of rings or jobs beyond the rows they hand it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch
import trio

T = TypeVar("T")

# A round with at most this many rows has all its logits computed up front, in one ask;
# a bigger tree asks row by row as the acceptance walk needs them (most of it is never
# walked). In a product with other jobs' rows, 16 more rows cost about 3x one row here.
EAGER_ROWS = 16
# Rows in one product at most (SmolLM2: 256 rows of logits are 50 MB); the rest wait.
MAX_BATCH_ROWS = 256


class Head(Protocol):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(eq=False)
class _Ask:
    hidden: torch.Tensor  # (T, H)
    woken: trio.Event = field(default_factory=trio.Event)  # its product ran, or it must run the next
    done: bool = False
    runs_next: bool = False  # handed the turn to run the next product
    out: torch.Tensor | None = None
    error: BaseException | None = None


class HeadBatcher:
    """One output head for many jobs (all on one trio thread); products run in a worker thread."""

    def __init__(self, head: Head, max_rows: int = MAX_BATCH_ROWS) -> None:
        self.head, self.max_rows = head, max_rows
        self._waiting: list[_Ask] = []
        self._busy = False  # a product runs, or the ask handed the turn is about to run one
        self.products = 0  # products run (a figure for tests and benchmarks)
        self.rows = 0  # rows they multiplied

    async def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, H) -> logits (T, V), equal to `head.logits(hidden)` alone. Raises what
        the head raises for these rows alone."""
        ask = _Ask(hidden)
        self._waiting.append(ask)
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
            batch = self._take()
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
        assert ask.out is not None
        return ask.out

    def _take(self) -> list[_Ask]:
        """The oldest waiting asks whose rows fit max_rows (the oldest always)."""
        batch, rows = [], 0
        for a in list(self._waiting):
            if batch and rows + a.hidden.shape[0] > self.max_rows:
                break
            batch.append(a)
            rows += a.hidden.shape[0]
        del self._waiting[:len(batch)]
        return batch

    def _hand_over(self) -> None:
        """Give the turn to the oldest waiting ask, if any (it runs the next product)."""
        if self._waiting and not self._busy:
            self._busy = True
            self._waiting[0].runs_next = True
            self._waiting[0].woken.set()

    def _run(self, batch: list[_Ask]) -> None:
        """Worker thread: one product for the batch, split back per ask; if it raises, each
        ask alone, so an error stays with the ask that caused it."""
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
    """`accept(logits_of)` in a worker thread, where `logits_of(indices)` gives the logits
    of those of `rows` (M+1, H) from `head`: all of them computed first when there are at
    most EAGER_ROWS, else each call asks the batcher from the worker thread. `cheap`: the
    acceptance is a few argmaxes (greedy, no grammar): with its logits computed it runs
    here, saving the thread hop (two wake-ups of the event loop per job and round)."""
    if rows.shape[0] <= EAGER_ROWS:
        logits = await head.logits(rows)
        if cheap:
            return accept(lambda r: logits[r])
        return await trio.to_thread.run_sync(lambda: accept(lambda r: logits[r]))
    return await trio.to_thread.run_sync(lambda: accept(lambda r: trio.from_thread.run(head.logits, rows[r])))
