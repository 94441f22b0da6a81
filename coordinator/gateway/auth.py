"""API keys and per-key limits: who may call the gateway, how many generations each key runs
at once, and how many tokens it spends a minute.

Keys are held only as SHA-256 digests (read once, when the `--api-keys` flag is parsed),
and a presented key is compared with every digest by `hmac.compare_digest`, with no early
exit, so the time taken says nothing about which key nearly matched. The token budget is a
bucket (`Bucket`, pure): a request is admitted while the key's bucket is not overdrawn and is
charged what it used, its prompt when the job opens and each committed block as it comes
(`charge_tokens`), so a long answer may run the bucket below zero and the key then waits
`Retry-After` seconds for it to refill. `KeyGate` is the ASGI middleware that applies all
this; refusals use OpenAI's error shape (401 `invalid_api_key`, 429 `rate_limit_exceeded`).
Does not know request bodies, the engine or metrics (refusals go to an `on_refused` callback).
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import json
import math
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace

from starlette.types import ASGIApp, Receive, Scope, Send

from coordinator.errors import RequestError

DIGEST_PREFIX = "sha256:"  # a key file line holding a key's digest instead of the key
# The routes that run generations: the ones per-key concurrency and token budgets apply to.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(frozen=True)
class KeyBook:
    """The accepted keys, as SHA-256 digests; `source` names the file they came from."""

    digests: tuple[bytes, ...]
    source: str = ""

    @classmethod
    def from_file(cls, path: str) -> KeyBook:
        """One key per line; blank lines and lines starting with `#` are skipped. A line
        `sha256:<64 hex digits>` is a key's digest, so the file at rest need not hold keys.
        Error handling: ValueError naming the file when it cannot be read or holds no key."""
        try:
            with open(path, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"--api-keys {path}: cannot read the key file ({exc.__class__.__name__}: {exc})") from exc
        keys = [line for line in lines if line and not line.startswith("#")]
        if not keys:
            raise ValueError(f"--api-keys {path}: no keys in the file (one key per line)")
        return cls(tuple(_digest_of_line(k) for k in keys), path)

    def match(self, presented: str) -> int | None:
        """The index of the key `presented` is, None if none. Every digest is compared."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for i, known in enumerate(self.digests):
            if hmac.compare_digest(digest, known):
                found = i
        return found

    def label(self, index: int) -> str:
        """A name for key `index` fit for logs and metrics: its digest's first 8 hex digits
        (a digest of a random key reveals nothing of it)."""
        return DIGEST_PREFIX + self.digests[index].hex()[:8]


def _digest_of_line(line: str) -> bytes:
    if line.startswith(DIGEST_PREFIX) and len(line) == len(DIGEST_PREFIX) + 64:
        try:
            return bytes.fromhex(line[len(DIGEST_PREFIX):])
        except ValueError:
            pass  # not hex: then it is a key that happens to start so
    return hashlib.sha256(line.encode()).digest()


@dataclass(frozen=True)
class KeyLimits:
    """Per-key limits; 0 means none."""

    max_concurrent_jobs: int = 0
    tokens_per_minute: int = 0


# -- the token bucket (pure) ------------------------------------------------------------------

@dataclass(frozen=True)
class Bucket:
    """Tokens a key may still spend, refilled at `rate_per_s` up to `capacity` (one minute's
    worth); it may go below zero (overdrawn), since a request is charged after it is admitted."""

    tokens: float
    at_s: float  # monotonic time `tokens` was computed at


def refilled(b: Bucket, now_s: float, rate_per_s: float, capacity: float) -> Bucket:
    return Bucket(min(capacity, b.tokens + (now_s - b.at_s) * rate_per_s), now_s)


def wait_s(b: Bucket, rate_per_s: float) -> float:
    """Seconds until a refilled bucket `b` admits a request (is not overdrawn); 0: now."""
    return 0.0 if b.tokens >= 0 else (-b.tokens / rate_per_s if rate_per_s > 0 else math.inf)


def spent(b: Bucket, tokens: int) -> Bucket:
    return replace(b, tokens=b.tokens - tokens)


@dataclass
class KeyAccount:
    """One key's running generations and token bucket."""

    limits: KeyLimits
    running: int = 0
    bucket: Bucket = field(default_factory=lambda: Bucket(0.0, 0.0))

    def __post_init__(self) -> None:
        self.bucket = Bucket(float(self.limits.tokens_per_minute), time.monotonic())

    @property
    def rate_per_s(self) -> float:
        return self.limits.tokens_per_minute / 60.0

    def admit_nowait(self) -> None:
        """Take a generation slot, or raise RateLimited."""
        lim = self.limits
        if lim.max_concurrent_jobs and self.running >= lim.max_concurrent_jobs:
            raise RateLimited(f"This API key is running {self.running} generations, its limit; retry when one "
                                "finishes.", "requests", 1)
        if lim.tokens_per_minute:
            self.bucket = refilled(self.bucket, time.monotonic(), self.rate_per_s, lim.tokens_per_minute)
            wait = wait_s(self.bucket, self.rate_per_s)
            if wait > 0:
                raise RateLimited(f"This API key used its {lim.tokens_per_minute} tokens per minute; retry in "
                                    f"{math.ceil(wait)} s.", "tokens", math.ceil(wait))
        self.running += 1

    def charge(self, tokens: int) -> None:
        if self.limits.tokens_per_minute:
            self.bucket = spent(self.bucket, tokens)


class RateLimited(RequestError):
    """A key over one of its limits: 429, and when to retry (whole seconds, at least 1).
    `type` is OpenAI's: "requests" (concurrency) or "tokens" (the token budget)."""

    def __init__(self, message: str, kind: str, retry_after_s: int) -> None:
        super().__init__(429, message, type=kind, code="rate_limit_exceeded")
        self.retry_after_s = max(1, retry_after_s)


# The account a request's tokens are charged to, set by KeyGate around a generation request.
# A context variable, because the engine meets the request's tokens (job opened, blocks
# committed) inside the request's own task but is not handed the request.
_paying: contextvars.ContextVar[KeyAccount | None] = contextvars.ContextVar("shard_paying_key", default=None)


def token_charger() -> Callable[[int], None]:
    """The charge function of the key paying for the current request (a no-op without one).
    Call it in the request's task (engine.open_job is) and keep it for the job's blocks."""
    account = _paying.get()
    return account.charge if account is not None else (lambda tokens: None)


def bearer_token(scope: Scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


class KeyGate:
    """ASGI middleware: without `book` everything passes; with it, a path outside `public`
    needs a known bearer key, and a generation request takes a slot of its key's limits for
    as long as the response runs (streaming included).

    Error handling: refusals are answered here (401, 429 with Retry-After) and reported to
    `on_refused(reason)`. Resource handling: the slot is released however the response ends.
    """

    def __init__(self, app: ASGIApp, book: KeyBook | None, limits: KeyLimits, *, public: Collection[str] = (),
                 public_prefixes: Collection[str] = (), on_refused: Callable[[str], None] = lambda reason: None) -> None:
        self.app, self.book, self.limits = app, book, limits
        self.public, self.public_prefixes, self.on_refused = frozenset(public), tuple(public_prefixes), on_refused
        self.accounts: dict[int, KeyAccount] = {}

    def is_public(self, path: str) -> bool:
        return path in self.public or path.startswith(self.public_prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.book is None or self.is_public(scope["path"]):
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope)
        index = self.book.match(token) if token is not None else None
        if index is None:
            self.on_refused("unauthorized")
            await _refuse(send, _unauthorized(token is not None))
            return
        if not (scope["method"] == "POST" and scope["path"] in GENERATION_PATHS):
            await self.app(scope, receive, send)
            return
        account = self.accounts.setdefault(index, KeyAccount(self.limits))
        try:
            account.admit_nowait()
        except RateLimited as err:
            self.on_refused(f"rate_{err.type}")
            await _refuse(send, err, [(b"retry-after", str(err.retry_after_s).encode())])
            return
        paying, held = _paying.set(account), [True]

        def release() -> None:  # once, whichever comes first: the last bytes or the end
            if held:
                held.clear()
                account.running -= 1

        async def send_then_release(message) -> None:
            # The slot is free once the response's last bytes leave, before the job's own
            # clean-up: a client that reads the end of one response may send the next at once.
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                release()
            await send(message)

        try:
            await self.app(scope, receive, send_then_release)
        finally:
            _paying.reset(paying)
            release()


def _unauthorized(presented: bool) -> RequestError:
    if presented:
        return RequestError(401, "Incorrect API key provided. Ask the operator of this gateway for a key.",
                            code="invalid_api_key")
    return RequestError(401, "You didn't provide an API key. Provide it in an Authorization header using Bearer "
                        "auth (i.e. Authorization: Bearer YOUR_KEY).", code="invalid_api_key")


async def _refuse(send: Send, err: RequestError, headers: Collection[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(err.body()).encode()
    extra = [(b"www-authenticate", b"Bearer")] if err.status == 401 else []
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *extra, *headers]})
    await send({"type": "http.response.body", "body": body})
