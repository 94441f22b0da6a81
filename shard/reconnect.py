"""A node's sessions with its coordinator: when one ends, start another, unless it should not.

Weights outlive sessions: the node object (its loaded slice, its epoch) stays, and only
the session (dial, control stream, registration, the tasks that serve it) is run again.
How a session ended decides what follows (`ending`):
- a lost connection: again after a backoff that doubles from `first_s` to `max_s` and
  starts over once a session has registered, for as long as it takes;
- a refusal or a configuration this node cannot serve under (RegistrationRefused,
  DeviceError, StoreError): the node ends, raised bare (not wrapped in the nursery's
  ExceptionGroup) so the CLI prints it as one line;
- anything else is a bug: logged at ERROR with its traceback, `on_crash()` drops what the
  session left behind (the node's jobs), and a fresh session starts after
  `CrashPolicy.delay_s`, at most `max_restarts` times within `window_s`; one more in that
  window ends the node with CrashLoopError, one line saying how often and what last.
Cancellation (and every other BaseException) passes. Knows nothing of what a session does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import trio

from shard.errors import DeviceError, ShardError, StoreError, TransportError, WireError, sole_error

log = logging.getLogger("shard.node")

# What a lost or garbled control connection raises.
CONNECTION_LOST = (TransportError, WireError, trio.TooSlowError)


class RegistrationRefused(ShardError):
    """The coordinator refused this node (`code`: 'duplicate_identity', 'model_mismatch', ...)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code, self.reason = code, reason
        super().__init__(f"the coordinator refused this node: {reason}")


class CrashLoopError(ShardError):
    """Sessions kept ending on a bug: `crashes` within `window_s`, the last with `last`."""

    def __init__(self, crashes: int, window_s: float, last: BaseException) -> None:
        self.crashes, self.window_s, self.last = crashes, window_s, last
        super().__init__(f"the node's session failed {crashes} times within {window_s:.0f} s, last with "
                         f"{type(last).__name__}: {last}; giving up (the tracebacks are logged above)")


# Ends the node whatever the session: another session would be refused or fail the same way.
FATAL = (RegistrationRefused, DeviceError, StoreError)


@dataclass(frozen=True)
class CrashPolicy:
    """How a node restarts sessions that ended on a bug (pure: `delay_s`)."""

    # A bug a frame or message triggers now and then costs a session each time; one that
    # every session meets (a deterministic crash) would spin forever: this many restarts
    # within window_s, and the next crash ends the node.
    max_restarts: int = 5
    window_s: float = 600.0
    # Before restart n within the window: first_s * 2^(n-1), at most max_s. The first is
    # short (a restart costs the ring its re-formation anyway); a loop slows down.
    first_s: float = 1.0
    max_s: float = 30.0

    def delay_s(self, crashes_s: list[float], now_s: float) -> float | None:
        """Seconds before restarting after a crash at `now_s`, given the times of every
        crash so far (this one included); None: too many within window_s, end the node."""
        recent = sum(now_s - t <= self.window_s for t in crashes_s)
        if recent > self.max_restarts:
            return None
        return min(self.first_s * 2 ** (max(recent, 1) - 1), self.max_s)


@dataclass(frozen=True)
class ReconnectPolicy:
    first_s: float = 0.5
    # A coordinator restarted under warm nodes is found within this of listening again.
    # 2 s, not more: a restarted gateway takes 5-6 s to listen (python, torch, tokenizer),
    # and a 5 s cap let the nodes' next dial land up to 5 s after that (13 s from kill to
    # first token in bench_internet's restart, 8.5 s with this cap); a refused dial costs
    # the gateway one SYN, so hundreds of nodes retrying every 2 s is still no load.
    max_s: float = 2.0
    crashes: CrashPolicy = field(default_factory=CrashPolicy)

    def delay_s(self, attempt: int) -> float:
        """Seconds before attempt `attempt` (1 = the first retry)."""
        return min(self.first_s * 2 ** (attempt - 1), self.max_s)


def connection_lost(exc: BaseException) -> BaseException | None:
    """The error that says the connection was lost, when that is all `exc` (bare or an
    ExceptionGroup from a nursery) holds; None otherwise."""
    if isinstance(exc, BaseExceptionGroup):
        lost, rest = exc.split(CONNECTION_LOST)
        if rest is None and lost is not None:
            return _first_leaf(lost)
        return None
    return exc if isinstance(exc, CONNECTION_LOST) else None


def ending(exc: BaseException) -> str:
    """How a session that raised `exc` ended: 'lost' (the connection), 'fatal' (a refusal,
    a configuration, a cancellation or any other BaseException: the node ends) or 'bug'."""
    if connection_lost(exc) is not None:
        return "lost"
    if isinstance(exc, BaseExceptionGroup):
        if exc.split(Exception)[1] is not None:  # a Cancelled or KeyboardInterrupt among them
            return "fatal"
        return "fatal" if exc.split(FATAL)[0] is not None else "bug"
    return "bug" if isinstance(exc, Exception) and not isinstance(exc, FATAL) else "fatal"


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def serve_reconnecting(session: Callable[[Callable[[], None]], Awaitable[None]],
                             policy: ReconnectPolicy = ReconnectPolicy(), task_status=trio.TASK_STATUS_IGNORED,
                             on_crash: Callable[[], None] = lambda: None) -> None:
    """Run `session(registered)` again whenever it ends with a lost connection or a bug
    (module docstring); `registered()` (called by the session once it is registered)
    resets the lost-connection backoff, and the first call reports `task_status.started()`.
    Returns only if a session returns. Error handling: a fatal ending propagates,
    unwrapped when it is the group's only error; too many bugs raise CrashLoopError."""
    attempt = 0
    crashes_s: list[float] = []
    unstarted = [task_status]

    def registered() -> None:
        nonlocal attempt
        attempt = 0
        if unstarted:
            unstarted.pop().started()

    while True:
        try:
            await session(registered)
            return
        except BaseException as exc:  # noqa: BLE001 (classified below; Cancelled re-raised)
            how = ending(exc)
            if how == "fatal":
                sole = sole_error(exc)
                if isinstance(sole, Exception) and sole is not exc:
                    raise sole from exc
                raise
            failure = exc
        if how == "lost":
            attempt += 1
            delay_s = policy.delay_s(attempt)
            log.warning("lost the coordinator (%s); reconnecting in %.1f s (attempt %d)",
                        connection_lost(failure), delay_s, attempt)
        else:
            now_s = trio.current_time()
            crashes_s = [t for t in crashes_s if now_s - t <= policy.crashes.window_s] + [now_s]
            delay_s = policy.crashes.delay_s(crashes_s, now_s)
            last = sole_error(failure)
            if delay_s is None:
                log.error("the session failed again (%d times within %.0f s); the node ends", len(crashes_s),
                          policy.crashes.window_s, exc_info=last)
                raise CrashLoopError(len(crashes_s), policy.crashes.window_s, last) from failure
            log.error("the session failed on a bug (%d within %.0f s): its jobs are dropped and a new session "
                      "registers in %.1f s", len(crashes_s), policy.crashes.window_s, delay_s, exc_info=last)
            on_crash()
        await trio.sleep(delay_s)
