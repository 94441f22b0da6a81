"""Fixtures for the API and generation tests: a LocalEngine over the tiny llama, and a
scripted engine whose token blocks, readiness and pacing a test controls exactly."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from coordinator.errors import JobFailedError, NotReadyError
from coordinator.jobs.local_engine import LocalEngine
from coordinator.spec.sampling import SamplingParams


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama.path)


@pytest.fixture(scope="session")
def local_engine(tiny_llama, tiny_tokenizer) -> LocalEngine:
    return LocalEngine(tiny_llama.model, tiny_tokenizer, model_id="tiny-llama")


class ScriptedJob:
    """Yields the engine's scripted blocks; the engine's gate holds every block after the
    first (a job stuck mid-generation); `fail_after` blocks it raises JobFailedError."""

    def __init__(self, engine: ScriptedEngine, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine, self.prompt_ids, self.params = engine, prompt_ids, params
        self.closed = False
        self.closed_event = trio.Event()
        self.blocks_sent = 0

    async def next_tokens(self) -> AsyncIterator[list[int]]:
        for block in self.engine.blocks:
            if self.engine.gate is not None and self.blocks_sent >= 1:
                await self.engine.gate.wait()
            if self.engine.fail_after is not None and self.blocks_sent >= self.engine.fail_after:
                raise JobFailedError("stage 1 vanished and no standby holds its layers")
            self.blocks_sent += 1
            yield list(block)

    def stats(self) -> dict[str, Any]:
        return {"engine": "scripted", "traversals": self.blocks_sent}

    async def aclose(self) -> None:
        self.closed = True
        self.closed_event.set()


class ScriptedEngine:
    """An Engine whose output is a fixed list of token blocks (several tokens per block, as
    a speculative ring commits them). `gate` (a trio.Event) holds blocks after the first."""

    def __init__(self, tokenizer: Any, blocks: list[list[int]], *, max_context_tokens: int = 64,
                 ready: bool = True, fail_after: int | None = None) -> None:
        self.model_id = "scripted"
        self.tokenizer = tokenizer
        self.max_context_tokens = max_context_tokens
        self.eos_token_ids = frozenset({tokenizer.eos_token_id})
        self.blocks, self.ready, self.fail_after = blocks, ready, fail_after
        self.gate: trio.Event | None = None
        self.jobs: list[ScriptedJob] = []

    async def open_job(self, prompt_ids: list[int], params: SamplingParams) -> ScriptedJob:
        if not self.ready:
            raise NotReadyError("no ring: 0 of 30 layers are served")
        job = ScriptedJob(self, prompt_ids, params)
        self.jobs.append(job)
        return job

    def info(self) -> dict[str, Any]:
        return {"ready": self.ready, "engine": "scripted", "stages": [{"layers": [0, 30]}]}

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture
def scripted(tiny_tokenizer):
    """`scripted(blocks_or_text_blocks, **kw) -> ScriptedEngine`; str blocks are tokenised."""

    def make(blocks: list, **kw: Any) -> ScriptedEngine:
        engine = ScriptedEngine(tiny_tokenizer, [], **kw)
        engine.blocks = [engine.ids(b) if isinstance(b, str) else list(b) for b in blocks]
        return engine

    return make
