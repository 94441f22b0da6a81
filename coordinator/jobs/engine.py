"""The Engine interface the HTTP layer talks to, and the one generation loop all engines share.

An engine turns prompt token ids into a stream of committed token ids (`Job.next_tokens`
yields blocks: a speculative engine commits several per traversal). Everything about
turning that stream into a response lives here, once: chat templating, the context bound,
EOS / stop strings / max_tokens (exact even inside a multi-token block) and incremental
detokenisation. This module does not know HTTP, JSON, the ring, or how logits are made.

Token accounting (documented once, used by `usage`): `completion_tokens` counts the tokens
the model generated for this response up to and including the token that ended it (an
EOS token, or the token that completed a stop string); tokens an engine committed after
that point in the same block are discarded and not counted. EOS text is never emitted.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import jinja2
import trio

from coordinator.spec.sampling import SamplingParams
from coordinator.spec.target import TokenLogprob
from coordinator.errors import EmptyPromptError, JobFailedError, PromptFormatError, PromptTooLongError

FinishReason = Literal["stop", "length"]







@runtime_checkable
class Job(Protocol):
    """One request's generation state inside an engine (KV caches, sampler RNG...)."""

    def next_tokens(self) -> AsyncIterator[list[int]]:
        """Committed token ids, one non-empty block per traversal, until the context is
        full (then it ends). The consumer stops early by closing the job. A job opened with
        `params.logprobs` set also has `token_logprobs`: one TokenLogprob per committed
        token, appended before the block that holds it is yielded."""
        ...

    def stats(self) -> dict[str, Any]:
        """JSON-safe figures for the response's `shard` object: traversals,
        tokens_per_traversal, ttft_s, ring_epoch, drafter mix... (engine-specific keys)."""
        ...

    async def aclose(self) -> None:
        """Free the job's resources everywhere; idempotent; safe to call under cancellation
        only when shielded (the generation loop shields it)."""
        ...


@runtime_checkable
class Engine(Protocol):
    model_id: str
    tokenizer: Any  # transformers.PreTrainedTokenizerBase
    max_context_tokens: int
    eos_token_ids: frozenset[int]

    async def open_job(self, prompt_ids: list[int], params: SamplingParams) -> Job:
        """Start generating after `prompt_ids`. Raises NotReadyError when it cannot."""
        ...

    def info(self) -> dict[str, Any]:
        """JSON-safe state for /health and /v1/ring; must include "ready": bool."""
        ...


def eos_ids_of(tokenizer: Any, generation_eos: int | Iterable[int] | None = None) -> frozenset[int]:
    """EOS ids from the tokenizer plus the model's generation config (which may list several)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if isinstance(generation_eos, int):
        ids.add(generation_eos)
    elif generation_eos is not None:
        ids.update(int(i) for i in generation_eos)
    return frozenset(ids)


def encode_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> list[int]:
    """Render messages (and `tools`, OpenAI function definitions, when given) with the
    tokenizer's chat template plus the assistant prompt, and tokenise. The template adds
    any BOS itself, so no special tokens are added again."""
    try:
        text = tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, add_generation_prompt=True,
                                             tokenize=False)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:  # incl. the template's raise_exception
        raise PromptFormatError(str(exc)) from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Tokenise a raw completion prompt the way the tokenizer would by default (with BOS)."""
    return list(tokenizer.encode(prompt, add_special_tokens=True))


class IncrementalDetokenizer:
    """Token ids in, new text out, without re-decoding the whole output each step.

    Decodes a sliding window: text(window + new) minus text(window), so merges across the
    boundary (leading spaces, multi-byte characters) come out right. It is seeded with the
    prompt's last few tokens so the first output token's leading space is what the full
    decode would show. Text ending in U+FFFD (an incomplete UTF-8 sequence) is held back
    until the next token completes it.
    """

    PROMPT_CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-self.PROMPT_CONTEXT_TOKENS :])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """What is held back, less a trailing incomplete character: the output ended
        (max_tokens, EOS, the context) part-way through a multi-byte character, so the
        bytes it has are not text, and U+FFFD would be a character the model never wrote.
        (A model that really writes U+FFFD as its very last token loses it: the decoded
        text cannot tell the two apart.)"""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :].rstrip("\ufffd")


class StopMatcher:
    """Finds the first stop string in streamed text, holding back only what could still
    become one. Invariant: any stop string occurrence lies entirely inside the held text,
    because every suffix that is a proper prefix of a stop string is held back."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit now, whether a stop string was reached)."""
        self._held += text
        hits = [i for i in (self._held.find(s) for s in self._stop) if i >= 0]
        if hits:
            out, self._held = self._held[: min(hits)], ""
            return out, True
        keep = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._held)), keep, -1):
                if self._held.endswith(s[:n]):
                    keep = n
                    break
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out, False

    def flush(self) -> str:
        out, self._held = self._held, ""
        return out


@dataclass(frozen=True)
class TextChunk:
    """New text since the previous chunk, and how many generated tokens it covers."""

    text: str
    completion_tokens: int
    logprobs: tuple[TokenLogprob, ...] = ()  # the tokens consumed since the previous chunk, when asked


@dataclass(frozen=True)
class Finished:
    """Always the last event of a generation."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    stats: dict[str, Any] = field(default_factory=dict)


Event = TextChunk | Finished


def completion_budget(engine: Engine, prompt_tokens: int, params: SamplingParams) -> int:
    """Tokens this request may generate: max_tokens, capped by the room left in the context.
    An empty prompt is refused here, before any job exists (EmptyPromptError)."""
    if prompt_tokens < 1:
        raise EmptyPromptError()
    room = engine.max_context_tokens - prompt_tokens
    if room < 1:
        raise PromptTooLongError(prompt_tokens, engine.max_context_tokens)
    return room if params.max_tokens is None else min(params.max_tokens, room)


class Generation:
    """One open job plus the stopping rules; `events()` is the single generation loop.

    Resource handling: `aclose()` (idempotent, shielded) frees the job; it runs when
    `events()` ends normally and must be called by whoever opened the generation.
    """

    def __init__(self, engine: Engine, job: Job, prompt_ids: list[int], params: SamplingParams, budget: int):
        self.engine, self.job, self.params = engine, job, params
        self.prompt_ids, self.budget = prompt_ids, budget
        self._closed = False

    async def events(self) -> AsyncIterator[Event]:
        """TextChunks (possibly empty text), then one Finished; closes the job before Finished."""
        detok = IncrementalDetokenizer(self.engine.tokenizer, self.prompt_ids)
        stops = StopMatcher(self.params.stop)
        eos = self.engine.eos_token_ids
        n = 0  # generated tokens consumed so far (see the module docstring)
        logprobs = getattr(self.job, "token_logprobs", None) if self.params.logprobs is not None else None
        reported = 0  # of them, how many a chunk carried

        def logprobs_to(n: int) -> tuple[TokenLogprob, ...]:
            nonlocal reported
            out, reported = tuple(logprobs[reported:n]) if logprobs is not None else (), n
            return out

        finish: FinishReason | None = None
        by_stop_string = False
        async for block in self.job.next_tokens():
            pieces: list[str] = []
            for token in block:  # a block may hold several tokens: stop exactly mid-block
                n += 1
                if token in eos:
                    finish = "stop"
                    break
                text, by_stop_string = stops.push(detok.push(token))
                pieces.append(text)
                if by_stop_string:
                    finish = "stop"
                    break
                if n >= self.budget:
                    finish = "length"
                    break
            if finish is not None:
                break
            if any(pieces) or logprobs:
                yield TextChunk("".join(pieces), n, logprobs_to(n))
        else:
            finish, pieces = "length", []  # the job ended: the context is full
        if not by_stop_string:
            # No more tokens will come: release text held as a possible stop-string prefix
            # or an incomplete character, unless it completes a stop string after all.
            text, by_stop_string = stops.push(detok.flush())
            pieces.append(text if by_stop_string else text + stops.flush())
            finish = "stop" if by_stop_string else finish
        if any(pieces) or reported < n and logprobs:
            yield TextChunk("".join(pieces), n, logprobs_to(n))
        await self.aclose()
        yield Finished(finish, len(self.prompt_ids), n, self.job.stats())

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True):
            await self.job.aclose()


async def open_generation(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> Generation:
    """Check the context bound, open a job, and wrap it. Raises PromptTooLongError or the
    engine's NotReadyError before any work starts, so callers can answer with a status."""
    budget = completion_budget(engine, len(prompt_ids), params)
    job = await engine.open_job(list(prompt_ids), params)
    return Generation(engine, job, list(prompt_ids), params, budget)


async def generate_text(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[Event]:
    """Open, stream and close one generation. Use under `contextlib.aclosing` so an early
    exit (client gone) still closes the job."""
    gen = await open_generation(engine, prompt_ids, params)
    try:
        async for event in gen.events():
            yield event
    finally:
        await gen.aclose()


async def collect_text(engine: Engine, prompt_ids: list[int], params: SamplingParams) -> tuple[str, Finished]:
    """The whole completion at once: (text, Finished)."""
    parts: list[str] = []
    async with contextlib.aclosing(generate_text(engine, prompt_ids, params)) as events:
        async for event in events:
            if isinstance(event, TextChunk):
                parts.append(event.text)
            else:
                return "".join(parts), event
    raise JobFailedError("generation ended without a Finished event")
