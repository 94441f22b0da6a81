"""Per-job timing for the operator's views: an Engine decorator that watches each job's
committed blocks and tells its watchers (metrics, the status page's window) what it saw.

A job is watched from `open_job` to `aclose`: time to first token (from open_job, so it
includes the prefill traversal), the gap before each later block split over the tokens it
brought (inter-token latency; a speculative block brings several at once), committed
tokens (each block's as it is delivered, the first's included), the job's own stats at the
end (traversals and tokens per drafter), and the error that ended it, if any. Tokens are
charged to the request's API key as they come (coordinator.gateway.auth.token_charger).
The engine's behaviour is unchanged: every call and attribute forwards. Does not know
HTTP, Prometheus or how tokens are made.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any, Protocol

from coordinator.errors import CoordinatorError, ReceiptRejected
from coordinator.gateway.auth import token_charger
from coordinator.jobs.engine import Engine, Job
from coordinator.spec.sampling import SamplingParams


@dataclass(frozen=True)
class JobRecord:
    """One finished job as the gateway saw it."""

    ended_at: float  # wall clock (time.time()), for the page's "last minutes"
    prompt_tokens: int
    tokens: int  # committed by the engine (a block past a stop string counts whole)
    ttft_s: float | None  # None: no token came
    duration_s: float  # open_job to aclose
    traversals: int
    # family -> (rounds, tokens, seconds of those traversals); "none": rounds without a draft
    drafted: dict[str, tuple[int, int, float]] = field(default_factory=dict)
    error: str | None = None  # the error that ended it, as the client was told
    error_kind: str | None = None  # its type name ("JobFailedError", "ReceiptRejected", ...)
    receipt_check: str | None = None  # the receipts check that failed, when one did


class JobWatcher(Protocol):
    def job_opened(self) -> None: ...

    def first_token(self, ttft_s: float, tokens: int) -> None:
        """The job's first block, of `tokens`, came `ttft_s` after open_job."""

    def block(self, tokens: int, gap_s: float) -> None:
        """A later block of `tokens` came `gap_s` after the previous one."""

    def job_ended(self, record: JobRecord) -> None: ...


def drafted_rounds(stats: dict[str, Any], tokens: int) -> dict[str, tuple[int, int, float]]:
    """(rounds, tokens, traversal seconds) per drafter family from a ring job's stats;
    rounds without a draft (the prefill's included) under "none", with the tokens the
    drafted ones did not commit. Engines without those figures give {}."""
    rounds, round_tokens = stats.get("draft_rounds"), stats.get("draft_round_tokens")
    traversals, seconds = stats.get("traversals"), stats.get("traversal_s_by_drafter") or {}
    if not isinstance(rounds, dict) or not isinstance(round_tokens, dict) or not isinstance(traversals, int):
        return {}
    out = {str(f): (int(n), int(round_tokens.get(f, 0)), float(seconds.get(f, 0.0))) for f, n in rounds.items()}
    plain_rounds = traversals - sum(n for n, _, _ in out.values())
    if plain_rounds > 0:
        out["none"] = (plain_rounds, max(0, tokens - sum(t for _, t, _ in out.values())),
                       float(seconds.get("none", 0.0)))
    return out


class MeteredJob:
    """A Job whose blocks and end are reported to watchers; closes the wrapped job."""

    def __init__(self, job: Job, prompt_tokens: int, opened_s: float, watchers: Sequence[JobWatcher],
                 charge: Any) -> None:
        self._job, self._watchers, self._charge = job, watchers, charge
        self.prompt_tokens, self.opened_s = prompt_tokens, opened_s
        self.tokens, self.ttft_s, self._last_s = 0, None, opened_s
        self._error: CoordinatorError | None = None
        self._ended = False

    def __getattr__(self, name: str) -> Any:  # job_id, receipts... as the engine's job has them
        return getattr(self._job, name)

    async def next_tokens(self) -> AsyncIterator[list[int]]:
        try:
            async with aclosing(self._job.next_tokens()) as blocks:
                async for block in blocks:
                    now = time.monotonic()
                    if self.ttft_s is None:
                        self.ttft_s = now - self.opened_s
                        for w in self._watchers:
                            w.first_token(self.ttft_s, len(block))
                    else:
                        for w in self._watchers:
                            w.block(len(block), now - self._last_s)
                    self._last_s = now
                    self.tokens += len(block)
                    self._charge(len(block))
                    yield block
        except CoordinatorError as exc:
            self._error = exc
            raise

    def stats(self) -> dict[str, Any]:
        return self._job.stats()

    async def aclose(self) -> None:
        try:
            await self._job.aclose()
        finally:
            if not self._ended:
                self._ended = True
                self._report()

    def _report(self) -> None:
        try:
            stats = self._job.stats()
        except Exception:  # a job that failed half-built may have no stats; the record still counts
            stats = {}
        err = self._error
        record = JobRecord(
            ended_at=time.time(), prompt_tokens=self.prompt_tokens, tokens=self.tokens, ttft_s=self.ttft_s,
            duration_s=time.monotonic() - self.opened_s, traversals=int(stats.get("traversals") or 0),
            drafted=drafted_rounds(stats, self.tokens), error=None if err is None else str(err),
            error_kind=None if err is None else type(err).__name__,
            receipt_check=err.check if isinstance(err, ReceiptRejected) else None)
        for w in self._watchers:
            w.job_ended(record)


class MeteredEngine:
    """`engine` with its jobs watched (MeteredJob); everything else is the engine's own."""

    def __init__(self, engine: Engine, watchers: Sequence[JobWatcher]) -> None:
        self._engine, self._watchers = engine, tuple(watchers)
        self.model_id, self.tokenizer = engine.model_id, engine.tokenizer
        self.max_context_tokens, self.eos_token_ids = engine.max_context_tokens, engine.eos_token_ids

    def __getattr__(self, name: str) -> Any:  # bundle(), drafters, whatever the engine offers
        return getattr(self._engine, name)

    async def open_job(self, prompt_ids: list[int], params: SamplingParams) -> MeteredJob:
        opened_s, charge = time.monotonic(), token_charger()
        job = await self._engine.open_job(prompt_ids, params)
        charge(len(prompt_ids))
        for w in self._watchers:
            w.job_opened()
        return MeteredJob(job, len(prompt_ids), opened_s, self._watchers, charge)

    def info(self) -> dict[str, Any]:
        return self._engine.info()
