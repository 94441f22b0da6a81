"""A node's sessions with its coordinator: when the control connection drops, try again.

Weights outlive connections: the node object (its loaded slice, its epoch) stays, and
only the session (dial, control stream, registration, the tasks that serve it) is run
again, after a backoff that doubles from `first_s` to `max_s` and starts over once a
session has registered. Each attempt is logged once. What ends a session for good is
anything that is not a lost connection (a refused registration, a bug): it is raised
bare, not wrapped in the nursery's ExceptionGroup, so the CLI can print it as one line.
Knows nothing of what a session does.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import trio

from shard.errors import ShardError, TransportError, WireError, sole_error

log = logging.getLogger("shard.node")

# What a lost or garbled control connection raises; anything else ends the node.
CONNECTION_LOST = (TransportError, WireError, trio.TooSlowError)


class RegistrationRefused(ShardError):
    """The coordinator refused this node (`code`: 'duplicate_identity', 'model_mismatch', ...)."""

    def __init__(self, code: str, reason: str) -> None:
        self.code, self.reason = code, reason
        super().__init__(f"the coordinator refused this node: {reason}")


@dataclass(frozen=True)
class ReconnectPolicy:
    first_s: float = 0.5
    # A coordinator restarted under warm nodes is found within this of listening again.
    # 2 s, not more: a restarted gateway takes 5-6 s to listen (python, torch, tokenizer),
    # and a 5 s cap let the nodes' next dial land up to 5 s after that (13 s from kill to
    # first token in bench_internet's restart, 8.5 s with this cap); a refused dial costs
    # the gateway one SYN, so hundreds of nodes retrying every 2 s is still no load.
    max_s: float = 2.0

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


def _first_leaf(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


async def serve_reconnecting(session: Callable[[Callable[[], None]], Awaitable[None]],
                             policy: ReconnectPolicy = ReconnectPolicy(), task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run `session(registered)` again whenever it ends with a lost connection, after a
    backoff; `registered()` (called by the session once it is registered) resets the
    backoff, and the first call reports `task_status.started()`. Returns only if a session
    returns. Error handling: anything but a lost connection propagates, unwrapped when it
    is the group's only error."""
    attempt = 0
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
            lost = connection_lost(exc)
            if lost is None:
                sole = sole_error(exc)
                if isinstance(sole, Exception) and sole is not exc:
                    raise sole from exc
                raise
        attempt += 1
        delay_s = policy.delay_s(attempt)
        log.warning("lost the coordinator (%s); reconnecting in %.1f s (attempt %d)", lost, delay_s, attempt)
        await trio.sleep(delay_s)
