"""The OpenAI-compatible HTTP gateway: a starlette app over an Engine, served by hypercorn on trio.

Routes: GET /v1/models, GET /v1/models/{id}, POST /v1/chat/completions, POST /v1/completions
(streaming as server-sent events, or whole; bodies in coordinator.gateway.responses), GET /health,
GET /v1/ring, GET /v1/receipts/{response or job id}, GET /v1/receipts/key. Errors use OpenAI's
JSON shape with the status a client expects (400 bad request, 404 unknown model or route,
408 a body not sent within its deadline, 413 a body over its limit or a prompt longer than
the context, 429 with Retry-After when the generations running are at their limit and the
queue in front of them is full or the wait ran out (coordinator.gateway.job_queue), 503
no ring). Every response carries a `shard`
object with the job's stats.

Request bodies are bounded where they enter (coordinator.gateway.body_limit: refused by
Content-Length before a byte is read, cut off at the limit while streamed, 408 past a
deadline); headers have hypercorn's deadline (serve_http).

It runs on trio (hypercorn's trio worker): connection lifetimes use trio cancel scopes.
This module does not know how tokens are made (the Engine does), nor the stopping rules
(engine.Generation owns them); it validates, renders JSON and manages connection lifetime.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial, wraps
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.middleware import Middleware
from starlette.routing import Route

from coordinator.jobs.engine import Engine, Generation, completion_budget, encode_chat, encode_prompt, open_generation
from coordinator.gateway.responses import ChatShape, CompletionShape, GenerationResponse, TokenText, job_id_of
from coordinator.gateway.tools import ToolChatShape, check_template_takes_tools, forced_call_constraint
from coordinator.spec.grammar import json_constraint
from coordinator.spec.sampling import SamplingParams, choice_params
from coordinator.gateway.openai_schema import (MAX_BODY_BYTES, ChatRequest, CompletionRequest, parse_chat_request,
                                               parse_completion_request, parse_json_object)
from coordinator.errors import (CoordinatorError, EmptyPromptError, JobFailedError, NotReadyError, PromptFormatError, PromptTooLongError,
                                RequestError, SamplingParamError, UnverifiedNewcomers)
from coordinator.gateway.auth import KeyBook
from coordinator.gateway.job_queue import JobQueue
from coordinator.gateway.body_limit import BodyLimit
from shard.options import option

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP gateway's settings; the only defaults (the CLI derives its flags from these)."""

    host: str = "127.0.0.1"
    port: int = 8000
    max_concurrent_jobs: int = option(8, "generations run at once; past it requests wait in a queue "
                                      "(--max-queued-jobs, --queue-timeout-s), then get 429")
    max_queued_jobs: int = option(64, "requests that may wait for a running generation to finish; past it 429 "
                                  "with Retry-After (0: refuse at once)")
    queue_timeout_s: float = option(30.0, "how long a request waits in the queue before 429 with Retry-After")
    # Keys and the operator's surface (coordinator.gateway.auth, .operator).
    api_keys: KeyBook | None = option(None, "file of API keys, one a line (or a key's sha256:<hex> digest); requests "
                                      "then need `Authorization: Bearer KEY` (default: none, the API is open)",
                                      parse=KeyBook.from_file)
    key_max_concurrent_jobs: int = option(0, "generations one API key may run at once, more get 429 (default: 0, no limit)")
    key_tokens_per_minute: int = option(0, "prompt and generated tokens one API key may use a minute, past it 429 "
                                        "with Retry-After (default: 0, no limit)")
    public_health: bool = option(True, "with --api-keys, serve /health without a key")
    public_status: bool = option(False, "with --api-keys, serve the status page's data (/v1/ring, /v1/status) "
                                 "without a key (the page itself asks for one otherwise)")
    public_metrics: bool = option(False, "with --api-keys, serve /metrics without a key")
    # Hostile clients (coordinator.gateway.body_limit): 4 MiB holds the JSON of any prompt
    # the context admits many times over; the deadlines end a client that announces more
    # than it sends, or sends its headers a byte at a time.
    max_body_bytes: int = option(MAX_BODY_BYTES, "request bodies over this many bytes get 413, refused by their "
                                 "Content-Length before they are read, or cut off at the limit while streamed")
    body_timeout_s: float = option(30.0, "a request body not received whole within this many seconds gets 408")
    header_timeout_s: float = option(10.0, "a connection whose request headers are not complete this many seconds "
                                     "after it opened (or after its previous response) is closed")


def error_response(err: RequestError) -> JSONResponse:
    retry_after_s = getattr(err, "retry_after_s", None)  # a 429 says when to come back
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


# Each cause the engine raises -> (HTTP status, OpenAI error type, code); the first
# entry an error is an instance of wins, so subclasses come before their parents.
# A param of None means the error is about the prompt (messages or prompt).
STATUS_OF: tuple[tuple[type[CoordinatorError], int, str, str], ...] = (
    (PromptTooLongError, 413, "invalid_request_error", "context_length_exceeded"),
    (PromptFormatError, 400, "invalid_request_error", "invalid_prompt"),
    (EmptyPromptError, 400, "invalid_request_error", "empty_prompt"),
    (SamplingParamError, 400, "invalid_request_error", "invalid_parameter"),
    (NotReadyError, 503, "service_unavailable", "no_ring"),
    (UnverifiedNewcomers, 503, "service_unavailable", "unverified_newcomers"),
    (JobFailedError, 503, "service_unavailable", "job_failed"),
    (CoordinatorError, 503, "service_unavailable", "engine_error"),
)


def request_error_for(exc: CoordinatorError, prompt_param: str = "messages") -> RequestError:
    """The status and OpenAI fields for an engine-side refusal (STATUS_OF)."""
    if isinstance(exc, RequestError):
        return exc
    for cause, status, kind, code in STATUS_OF:
        if isinstance(exc, cause):
            param = getattr(exc, "param", None) or (prompt_param if status in (400, 413) else None)
            return RequestError(status, str(exc), type=kind, param=param, code=code)
    raise AssertionError("STATUS_OF ends with the root, so every CoordinatorError has a row")


def _openai_errors(handler: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    prompt_param = "prompt" if handler.__name__ == "completions" else "messages"

    @wraps(handler)
    async def wrapped(request: Request) -> Response:
        try:
            return await handler(request)
        except CoordinatorError as exc:
            return error_response(request_error_for(exc, prompt_param))

    return wrapped


def create_app(engine: Engine, config: ApiConfig = ApiConfig()) -> Starlette:
    """The ASGI app over `engine`. Stateless apart from the job slots and their queue."""
    slots = JobQueue(config.max_concurrent_jobs, config.max_queued_jobs, config.queue_timeout_s)

    def check_model(model: str) -> None:
        if model != engine.model_id:
            raise RequestError(
                404, f"The model `{model}` does not exist or you do not have access to it.",
                param="model", code="model_not_found",
            )

    def model_card() -> dict[str, Any]:
        return {"id": engine.model_id, "object": "model", "created": 0, "owned_by": "shard"}

    def constrained(req: ChatRequest | CompletionRequest) -> SamplingParams:
        """The request's params with its response_format's grammar (coordinator.spec.grammar)."""
        schema, forced = getattr(req, "json_schema", None), getattr(req, "forced_tool", None)
        if forced is not None:
            return replace(req.params, constraint=forced_call_constraint(engine.tokenizer, req.tools, forced))
        return req.params if schema is None else replace(req.params, constraint=json_constraint(engine.tokenizer, schema))

    async def start(prompt_ids: list[int], req: ChatRequest | CompletionRequest, shape: Any,
                    prefix_text: str = "") -> Response:
        completion_budget(engine, len(prompt_ids), req.params)  # 413 before taking a slot
        ticket = await slots.acquire(req.n)  # a slot per choice: each is a job; may wait in the queue
        gens: list[Generation] = []
        try:
            for params in choice_params(constrained(req), req.n):
                gens.append(await open_generation(engine, prompt_ids, params))
        except BaseException:
            with trio.CancelScope(shield=True):
                for gen in gens:
                    await gen.aclose()
            slots.release(ticket)
            raise
        headers = [("Warning", f'299 shard "Ignored unknown fields: {", ".join(req.ignored)}"')] if req.ignored else []
        return GenerationResponse(gens, lambda: slots.release(ticket), shape, engine.model_id,
                                  stream=req.stream, include_usage=req.include_usage, error_of=request_error_for,
                                  text_of=TokenText(engine.tokenizer), prefix_text=prefix_text, headers=headers)

    @_openai_errors
    async def chat_completions(request: Request) -> Response:
        body = parse_json_object(await request.body())
        req = parse_chat_request(body, max_context_tokens=engine.max_context_tokens)
        check_model(req.model)
        if req.tools:
            check_template_takes_tools(engine.tokenizer, engine.model_id)
        prompt_ids = encode_chat(engine.tokenizer, [m.as_template_dict() for m in req.messages], req.tools)
        return await start(prompt_ids, req, ToolChatShape if req.tools else ChatShape)

    @_openai_errors
    async def completions(request: Request) -> Response:
        body = parse_json_object(await request.body())
        req = parse_completion_request(body, max_context_tokens=engine.max_context_tokens)
        check_model(req.model)
        if isinstance(req.prompt, str):
            prompt_ids, prompt_text = encode_prompt(engine.tokenizer, req.prompt), req.prompt
        else:
            vocab = len(engine.tokenizer)
            bad = [t for t in req.prompt if not 0 <= t < vocab]
            if bad:
                raise RequestError(400, f"Invalid 'prompt': token ids must be in [0, {vocab}) (got {bad[0]}).",
                                   param="prompt", code="invalid_value")
            prompt_ids = list(req.prompt)
            prompt_text = engine.tokenizer.decode(prompt_ids, skip_special_tokens=True)
        return await start(prompt_ids, req, CompletionShape, prefix_text=prompt_text if req.echo else "")

    async def list_models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @_openai_errors
    async def get_model(request: Request) -> Response:
        check_model(request.path_params["model_id"])
        return JSONResponse(model_card())

    async def health(request: Request) -> Response:
        info = engine.info()
        ready = bool(info.get("ready"))
        body = {"status": "ok" if ready else "unavailable", "model": engine.model_id,
                "jobs_running": slots.in_use, "max_concurrent_jobs": slots.limit,
                "jobs_queued": slots.waiting, "engine": info}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def ring(request: Request) -> Response:
        return JSONResponse(engine.info())

    async def receipts(request: Request) -> Response:
        job_id = job_id_of(request.path_params["job_id"])  # a response's id names its job too
        bundle_of = getattr(engine, "bundle", None)  # engines without receipts have none
        bundle = bundle_of(job_id) if bundle_of is not None else None
        if bundle is None:
            raise RequestError(404, f"no receipt bundle for job `{job_id}`", param="job_id", code="receipts_not_found")
        return JSONResponse(bundle)

    async def receipts_key(request: Request) -> Response:
        checker = getattr(engine, "receipts", None)  # engines without receipts sign nothing
        if checker is None:
            raise RequestError(404, "receipts are off: nothing is signed", code="receipts_off")
        return JSONResponse({"coordinator_public_key": checker.key.public_bytes().hex(), "algorithm": "Ed25519"})

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                           type=kind, code=None))

    async def server_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error serving %s %s", request.method, request.url.path)
        return error_response(RequestError(500, "The server had an error while processing your request.",
                                           type="server_error"))

    routes = [
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", get_model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/ring", ring, methods=["GET"]),
        Route("/v1/receipts/key", _openai_errors(receipts_key), methods=["GET"]),
        Route("/v1/receipts/{job_id}", _openai_errors(receipts), methods=["GET"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error, Exception: server_error},
                    middleware=[Middleware(BodyLimit, max_body_bytes=config.max_body_bytes,
                                           body_timeout_s=config.body_timeout_s)])
    app.state.slots = slots  # the operator's metrics read its slots in use and queue
    return app


async def serve_http(app: Any, host: str, port: int, *, header_timeout_s: float = ApiConfig.header_timeout_s,
                     task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """Serve `app` on host:port until cancelled; reports the bound port (port 0 picks one).
    A connection idle for `header_timeout_s` (from accept, or after a response, to its next
    request's complete headers) is closed: hypercorn's keep-alive timer is the header deadline.
    hypercorn's read_timeout stays off: it would end a long streamed answer whose client
    sends nothing while it reads.

    Error handling: a port in use raises OSError from nursery.start. Resource handling:
    cancelling the caller's scope closes the listener and in-flight connections.
    """
    config = HypercornConfig()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    config.keep_alive_timeout = header_timeout_s
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn_serve, app, config))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))
