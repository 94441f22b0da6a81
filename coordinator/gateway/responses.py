"""OpenAI response bodies for open generations: whole or streamed, n choices, logprobs.

One GenerationResponse runs a request's generations (one per choice, concurrently) while
the client listens and renders their events in OpenAI's chat.completion(.chunk) or
text_completion shapes, logprobs included when asked. It does not validate requests,
open jobs or know the engine; errors are turned into OpenAI errors by the caller's
`error_of` (coordinator.gateway.api.request_error_for).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

import trio
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from coordinator.errors import CoordinatorError, RequestError
from coordinator.jobs.engine import Finished, Generation, TextChunk
from coordinator.spec.target import TokenLogprob

log = logging.getLogger(__name__)


def job_id_of(name: str) -> str:
    """The job id a response id (chatcmpl-<job id>, cmpl-<job id>) or a job id names."""
    for prefix in (ChatShape.id_prefix, CompletionShape.id_prefix):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def usage_of(fins: Sequence[Finished]) -> dict[str, int]:
    """One prompt, n completions: the prompt counts once (as OpenAI counts it)."""
    prompt, completion = fins[0].prompt_tokens, sum(f.completion_tokens for f in fins)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class TokenText:
    """Token ids as the text and UTF-8 bytes OpenAI's logprobs show (a byte-level token that
    is part of a character decodes to U+FFFD; its bytes say which)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def __call__(self, token: int) -> str:
        return self._tokenizer.decode([token])

    def entry(self, token: int, logprob: float) -> dict[str, Any]:
        text = self(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


class ChatShape:
    """chat.completion / chat.completion.chunk bodies."""

    id_prefix, object_whole, object_chunk = "chatcmpl-", "chat.completion", "chat.completion.chunk"

    @staticmethod
    def logprobs(entries: Sequence[TokenLogprob], text_of: TokenText, offset: int) -> dict[str, Any]:
        return {"content": [{**text_of.entry(e.token, e.logprob), "top_logprobs": [text_of.entry(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    @staticmethod
    def whole_choice(index: int, text: str, fin: Finished, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": fin.finish_reason,
                "logprobs": logprobs}

    @staticmethod
    def first_chunk_choices(n: int) -> list[dict[str, Any]]:
        return [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}
                for i in range(n)]

    @staticmethod
    def chunk_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return {"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": logprobs}

    @staticmethod
    def delta_choice(index: int, delta: dict[str, Any]) -> dict[str, Any]:
        return {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}


class CompletionShape:
    """text_completion bodies (the same object name streams and whole)."""

    id_prefix, object_whole, object_chunk = "cmpl-", "text_completion", "text_completion"

    @staticmethod
    def logprobs(entries: Sequence[TokenLogprob], text_of: TokenText, offset: int) -> dict[str, Any]:
        """The legacy shape; text_offset counts characters from `offset` (the text before)."""
        tokens = [text_of(e.token) for e in entries]
        offsets = [offset + sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{text_of(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}

    @staticmethod
    def whole_choice(index: int, text: str, fin: Finished, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": fin.finish_reason, "logprobs": logprobs}

    @staticmethod
    def first_chunk_choices(n: int) -> list[dict[str, Any]]:
        return []

    @staticmethod
    def chunk_choice(index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        return {"index": index, "text": text, "finish_reason": finish_reason, "logprobs": logprobs}


async def _cancel_on_disconnect(receive: Receive, scope: trio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


async def _no_receive() -> dict[str, Any]:
    raise RuntimeError("a finished response does not read the request")


class GenerationResponse(Response):
    """Runs a request's open Generations (choice i is gens[i]) while the client listens,
    then frees their jobs and slots.

    Resource handling: whatever happens (normal end, client disconnect, engine failure,
    cancellation) every generation is closed and `release` called exactly once, in
    `__call__`'s finally. A disconnect (http.disconnect on receive) cancels the work.
    Error handling: an engine failure mid-way becomes an error body when nothing was sent
    yet, or an SSE `error` event when streaming had begun.
    """

    def __init__(self, gens: Sequence[Generation], release: Callable[[], None], shape: Any, model: str, *,
                 stream: bool, include_usage: bool, error_of: Callable[[CoordinatorError], RequestError],
                 text_of: TokenText, prefix_text: str = "", headers: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(status_code=200)
        self.gens, self.release, self.shape, self.model = list(gens), release, shape, model
        self.stream, self.include_usage, self.prefix_text = stream, include_usage, prefix_text
        self.error_of, self.text_of = error_of, text_of
        self.extra_headers = [(k.lower().encode(), v.encode()) for k, v in headers]
        # The first choice's job id when the engine names its jobs (receipts are kept by it),
        # so GET /v1/receipts/{id} finds the bundle by the response's id too.
        self.id = shape.id_prefix + str(getattr(self.gens[0].job, "job_id", None) or secrets.token_hex(12))
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices, **extra}

    def _logprobs(self, index: int, entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any] | None:
        if self.gens[index].params.logprobs is None:
            return None
        return self.shape.logprobs(entries, self.text_of, offset)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_cancel_on_disconnect, receive, nursery.cancel_scope)
                await (self._send_stream(send) if self.stream else self._send_whole(send))
                nursery.cancel_scope.cancel()
        finally:
            try:
                with trio.CancelScope(shield=True):
                    for gen in self.gens:
                        await gen.aclose()
            finally:
                self.release()

    async def _each_event(self, on_event: Callable[[int, TextChunk | Finished], Any]) -> None:
        """Hand every generation's events to `on_event` as (choice index, event), as they
        come. Raises the first CoordinatorError a generation meets, outside any nursery
        (so callers catch it by type), after cancelling the others."""
        send_channel, receive_channel = trio.open_memory_channel(0)
        failed: list[CoordinatorError] = []

        async def pump(index: int, gen: Generation, out: trio.MemorySendChannel) -> None:
            async with out:
                try:
                    async with aclosing(gen.events()) as events:
                        async for event in events:
                            await out.send((index, event))
                except CoordinatorError as exc:
                    await out.send((index, exc))

        async with trio.open_nursery() as nursery:
            async with send_channel:
                for index, gen in enumerate(self.gens):
                    nursery.start_soon(pump, index, gen, send_channel.clone())
            async with receive_channel:
                async for index, event in receive_channel:
                    if isinstance(event, CoordinatorError):
                        failed.append(event)
                        nursery.cancel_scope.cancel()
                        break
                    await on_event(index, event)
        if failed:
            raise failed[0]

    async def _send_whole(self, send: Send) -> None:
        n = len(self.gens)
        parts: list[list[str]] = [[self.prefix_text] for _ in range(n)]
        entries: list[list[TokenLogprob]] = [[] for _ in range(n)]
        fins: list[Finished | None] = [None] * n

        async def on_event(index: int, event: TextChunk | Finished) -> None:
            if isinstance(event, TextChunk):
                parts[index].append(event.text)
                entries[index] += event.logprobs
            else:
                fins[index] = event  # Generation.events always ends with exactly one Finished

        try:
            await self._each_event(on_event)
        except CoordinatorError as exc:
            await JSONResponse(self.error_of(exc).body(), status_code=self.error_of(exc).status,
                               headers=dict(self._headers_str()))({"type": "http"}, _no_receive, send)
            return
        done = [f for f in fins if f is not None]
        choices = [self.shape.whole_choice(i, "".join(parts[i]), done[i], self._logprobs(i, entries[i], len(self.prefix_text)))
                   for i in range(n)]
        shard = done[0].stats if n == 1 else {**done[0].stats, "choices": [f.stats for f in done]}
        body = self._envelope(self.shape.object_whole, choices, usage=usage_of(done), shard=shard)
        await JSONResponse(body, headers=dict(self._headers_str()))({"type": "http"}, _no_receive, send)

    def _headers_str(self) -> list[tuple[str, str]]:
        return [(k.decode(), v.decode()) for k, v in self.extra_headers]

    async def _send_stream(self, send: Send) -> None:
        headers = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
                   *self.extra_headers]
        await send({"type": "http.response.start", "status": 200, "headers": headers})

        async def event(data: Any) -> None:
            payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
            await send({"type": "http.response.body", "body": f"data: {payload}\n\n".encode(), "more_body": True})

        n, obj = len(self.gens), self.shape.object_chunk
        first = self.shape.first_chunk_choices(n)
        if first:
            await event(self._envelope(obj, first))
        if self.prefix_text:
            for i in range(n):
                await event(self._envelope(obj, [self.shape.chunk_choice(i, self.prefix_text, None, None)]))
        offsets = [len(self.prefix_text)] * n  # characters sent per choice (completions' text_offset)
        fins: list[Finished] = []
        # A shape that reads structure out of the text (tool calls) turns each choice's text
        # into its own deltas as it streams (coordinator.gateway.tool_stream).
        streamer = getattr(self.shape, "streamer", None)
        readers = [streamer() for _ in range(n)] if streamer is not None else None

        async def on_event(index: int, ev: TextChunk | Finished) -> None:
            if readers is not None:
                reader = readers[index]
                deltas = reader.feed(ev.text) if isinstance(ev, TextChunk) else reader.finish()
                for delta in deltas:
                    await event(self._envelope(obj, [self.shape.delta_choice(index, delta)]))
                if isinstance(ev, Finished):
                    fins.append(ev)
                    finish = "tool_calls" if reader.called else ev.finish_reason
                    await event(self._envelope(obj, [self.shape.chunk_choice(index, "", finish, None)], shard=ev.stats))
            elif isinstance(ev, TextChunk):
                if ev.text or ev.logprobs:
                    logprobs = self._logprobs(index, ev.logprobs, offsets[index])
                    await event(self._envelope(obj, [self.shape.chunk_choice(index, ev.text, None, logprobs)]))
                    offsets[index] += len(ev.text)
            else:
                fins.append(ev)
                await event(self._envelope(obj, [self.shape.chunk_choice(index, "", ev.finish_reason, None)],
                                           shard=ev.stats))

        try:
            await self._each_event(on_event)
            if self.include_usage:
                await event(self._envelope(obj, [], usage=usage_of(fins)))
            await event("[DONE]")
        except CoordinatorError as exc:
            await event(self.error_of(exc).body())
        except Exception:  # a bug: the client still gets an error event and a closed stream, not silence
            log.exception("generation failed mid-stream")
            await event(RequestError(500, "The server had an error while processing your request.",
                                     type="server_error").body())
        await send({"type": "http.response.body", "body": b"", "more_body": False})
