"""Request bodies bounded where they enter the app: a size limit and a read deadline.

An ASGI middleware. A body whose Content-Length is over the limit is refused with 413
before the app runs and before one body byte is read; a streamed body (chunked, or with
no Content-Length) is cut off at the limit while it is read; a body not received whole
within the deadline (a client announcing 10 GB and sending nothing, or one byte a second)
is 408. Refusals are OpenAI's error shape. hypercorn itself bounds what it buffers ahead
of the app (max_app_queue_size messages of at most 64 KiB), so the app's reads are where
a body's memory grows.

starlette's own RequestBodyLimitMiddleware checks the same two limits, but it answers
text/plain "Content Too Large" whatever the app sends, so OpenAI clients could not read the
refusal; this is its behaviour with our error shape, plus the deadline starlette lacks.
It does not know the routes: a route that never reads its body is never limited by it.
"""

from __future__ import annotations

import json
import logging

import trio
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from coordinator.errors import RequestError

log = logging.getLogger(__name__)

# What hypercorn's trio server raises from `send` once the client's connection is going
# down under it: closed, reset, or (a client that closes while still sending its body)
# hypercorn's own task closing the socket while the refusal is being written.
CONNECTION_GOING = (trio.BusyResourceError, trio.BrokenResourceError, trio.ClosedResourceError)


def body_too_large(limit_bytes: int) -> RequestError:
    return RequestError(413, f"The request body is over {limit_bytes} bytes, the limit.", code="body_too_large")


def body_too_slow(timeout_s: float) -> RequestError:
    return RequestError(408, f"The request body was not received within {timeout_s:g} s, the limit.",
                        code="body_timeout")


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, or None without one (h11 has refused malformed ones)."""
    value = Headers(scope=scope).get("content-length")
    return int(value) if value is not None and value.isdigit() else None


class BodyLimit:
    """Wraps an ASGI app: at most `max_body_bytes` of body, received within `body_timeout_s`
    of the request's headers."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, body_timeout_s: float) -> None:
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = declared_length(scope)
        if length is not None and length > self.max_body_bytes:
            await send_error(send, body_too_large(self.max_body_bytes))
            return
        deadline = trio.current_time() + self.body_timeout_s
        received, body_done, started = 0, False, False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # a streamed answer waits on receive() for the disconnect: no deadline
                return await receive()
            with trio.move_on_at(deadline) as timer:
                message = await receive()
            if timer.cancelled_caught:
                raise body_too_slow(self.body_timeout_s)
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise body_too_large(self.max_body_bytes)
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracked_send)
        except RequestError as exc:
            if started or exc.status not in (408, 413):
                raise
            await send_error(send, exc)


async def send_error(send: Send, err: RequestError) -> None:
    """The refusal as a whole response; the client's unread body makes hypercorn close the
    connection after it. A connection already going down gets nothing more, and one log
    line instead of an unhandled error's traceback (a hostile client could otherwise make
    the gateway log one per connection: seen in bench_hostile_ring's 100 MB bodies)."""
    body = json.dumps(err.body()).encode()
    try:
        await send({"type": "http.response.start", "status": err.status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
    except CONNECTION_GOING as exc:
        log.info("a %d refusal (%s) was not sent: the client's connection was going down (%s)",
                 err.status, err.code, type(exc).__name__)
