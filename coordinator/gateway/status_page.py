"""The live status page: GET / serves static/status.html and its script (plain files, no
build step), which polls GET /v1/ring (the engine's info: ring, hops with their measured
transfer and path, nodes, roles) and GET /v1/status, both served here: the last minutes of
requests (tokens/s, TTFT, tokens per traversal, per drafter), recent errors, and the
receipt and audit results.

`RecentRequests` keeps the window (fed as a job watcher and by the HTTP tap's errors);
`window_summary` is the pure arithmetic over it. A job counts in the bucket it ended in.
Does not know the ring, Prometheus or how a page is drawn (the script does that).
"""

from __future__ import annotations

import pathlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from coordinator.gateway.metering import JobRecord

STATIC_DIR = pathlib.Path(__file__).parent / "static"
WINDOW_S = 300.0  # "the last minutes" the page shows
BUCKET_S = 10.0  # one point of its sparklines
MAX_JOBS = 5000  # records kept, whatever the window (a busy gateway keeps the newest)
MAX_ERRORS = 20


@dataclass(frozen=True)
class ErrorRecord:
    at: float  # wall clock
    where: str  # "POST /v1/chat/completions" or "job"
    status: int | None  # the HTTP status; None: a job failed after its response began
    message: str


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def window_summary(jobs: Iterable[JobRecord], now: float, *, window_s: float = WINDOW_S, bucket_s: float = BUCKET_S,
                   since: float | None = None) -> dict[str, Any]:
    """Figures over the jobs that ended in (now - window_s, now]. Throughput divides by the
    time the window covers (since `since`, the gateway's start, when that is later), so a
    gateway up for 30 s does not show a fifth of its rate."""
    start = now - window_s
    recent = [j for j in jobs if start < j.ended_at <= now]
    covered_s = max(1e-9, now - max(start, since if since is not None else start))
    ttfts = [j.ttft_s for j in recent if j.ttft_s is not None]
    tokens = sum(j.tokens for j in recent)
    traversals = sum(j.traversals for j in recent)
    drafters: dict[str, list[float]] = {}
    for j in recent:
        for family, figures in j.drafted.items():
            acc = drafters.setdefault(family, [0, 0, 0.0])
            for i, v in enumerate(figures):  # rounds, tokens, seconds
                acc[i] += v
    series = []
    for b in range(int(window_s // bucket_s)):
        lo = start + b * bucket_s
        in_bucket = [j for j in recent if lo < j.ended_at <= lo + bucket_s]
        b_ttft = [j.ttft_s for j in in_bucket if j.ttft_s is not None]
        b_trav = sum(j.traversals for j in in_bucket)
        series.append({"ago_s": round(now - lo - bucket_s, 3), "requests": len(in_bucket),
                       "tokens_per_s": sum(j.tokens for j in in_bucket) / bucket_s,
                       "ttft_s": statistics.median(b_ttft) if b_ttft else None,
                       "tokens_per_traversal": sum(j.tokens for j in in_bucket) / b_trav if b_trav else None})
    return {
        "window_s": window_s, "bucket_s": bucket_s, "requests": len(recent),
        "failed": sum(1 for j in recent if j.error), "tokens": tokens,
        "prompt_tokens": sum(j.prompt_tokens for j in recent),
        "tokens_per_s": tokens / min(covered_s, window_s),
        "ttft_s": {"median": statistics.median(ttfts) if ttfts else None, "p90": _quantile(ttfts, 0.9)},
        "tokens_per_traversal": tokens / traversals if traversals else None,
        "drafters": {f: {"traversals": r, "tokens": n, "tokens_per_traversal": n / r if r else None,
                         "traversal_s": sec / r if r else None} for f, (r, n, sec) in sorted(drafters.items())},
        "series": series,
    }


class RecentRequests:
    """The status page's memory: recent jobs and errors (bounded), and what runs now."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.started_at = clock()
        self.jobs: deque[JobRecord] = deque(maxlen=MAX_JOBS)
        self.errors: deque[ErrorRecord] = deque(maxlen=MAX_ERRORS)
        self.running = self.waiting = 0
        self.ended = self.failed = 0  # since the start, not only in the window
        self.receipt_failures: dict[str, int] = {}  # receipts check -> jobs it failed closed

    # JobWatcher
    def job_opened(self) -> None:
        self.waiting += 1

    def first_token(self, ttft_s: float, tokens: int) -> None:
        self.waiting -= 1
        self.running += 1

    def block(self, tokens: int, gap_s: float) -> None:
        pass

    def job_ended(self, record: JobRecord) -> None:
        if record.ttft_s is None:
            self.waiting -= 1
        else:
            self.running -= 1
        self.jobs.append(record)
        self.ended += 1
        self.failed += bool(record.error)
        if record.receipt_check is not None:
            self.receipt_failures[record.receipt_check] = self.receipt_failures.get(record.receipt_check, 0) + 1
        if record.error:
            self.errors.append(ErrorRecord(record.ended_at, "job", None, record.error))

    def http_error(self, method: str, path: str, status: int, message: str) -> None:
        self.errors.append(ErrorRecord(self.clock(), f"{method} {path}", status, message))

    def status(self) -> dict[str, Any]:
        now = self.clock()
        return {"now": now, "up_s": now - self.started_at,
                "jobs": {"running": self.running, "waiting": self.waiting, "ended": self.ended, "failed": self.failed,
                         "receipt_failures": dict(self.receipt_failures)},
                "window": window_summary(self.jobs, now, since=self.started_at),
                "errors": [asdict(e) for e in reversed(self.errors)]}


def status_routes(recent: RecentRequests, trust: Callable[[], dict[str, Any]],
                  ring_info: Callable[[], dict[str, Any]]) -> list[BaseRoute]:
    """GET / (the page), /static/* (its script and style), /v1/status and /v1/ring (its
    JSON; `ring_info`: the engine's info with the hops' measured transfer)."""

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "status.html", media_type="text/html")

    async def status(request: Request) -> Response:
        return JSONResponse({**recent.status(), "trust": trust()})

    async def ring(request: Request) -> Response:
        return JSONResponse(ring_info())

    return [Route("/", page, methods=["GET"]), Route("/v1/status", status, methods=["GET"]),
            Route("/v1/ring", ring, methods=["GET"]),
            Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static")]
