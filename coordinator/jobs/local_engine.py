"""LocalEngine: a whole causal LM in this process, one token per forward.

The single-machine engine behind `shard-coord serve` without a ring, and the oracle that
ring output is compared against. Each job owns a KV cache and a seed; forwards
run in a worker thread so the event loop keeps serving other requests. This module does
not know about stages, the wire, drafters or HTTP; stopping rules live in engine.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import torch
import trio

from coordinator.jobs.engine import eos_ids_of
from coordinator.spec.grammar import start_grammar
from coordinator.spec.sampling import SamplingParams, job_seed, sample
from coordinator.spec.target import TokenLogprob, token_logprob


class LocalJob:
    """One request's cache, generator and timings. Not shared between tasks."""

    def __init__(self, engine: LocalEngine, prompt_ids: list[int], params: SamplingParams) -> None:
        self._engine, self._prompt_ids, self._params = engine, prompt_ids, params
        self._seed = job_seed(params.seed)
        self._grammar = start_grammar(params.constraint)
        self.token_logprobs: list[TokenLogprob] = []  # one per generated token, when asked
        self._cache: Any = None
        self._opened_s = time.perf_counter()
        self._ttft_s: float | None = None
        self._traversals = 0
        self._committed = 0
        self._closed = False
        engine.open_jobs += 1

    def _forward_and_sample(self, ids: list[int], position: int, generated: list[int]) -> int:
        """Runs in a worker thread: feed `ids` after the cache, sample the token at `position`
        (after `generated`, this completion's tokens so far)."""
        model = self._engine.model
        with torch.inference_mode():  # grad mode is thread-local: set it in this thread
            if self._cache is None:
                self._cache = self._engine.new_cache()
            out = model(torch.tensor([ids]), cache=self._cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[0, -1]  # (V,)
            allowed = self._grammar.allowed((), logits.shape[-1]) if self._grammar is not None else None
            token = sample(logits, self._params, self._seed, position, generated, allowed)
            if self._grammar is not None:
                self._grammar.advance([token])
            if self._params.logprobs is not None:
                self.token_logprobs.append(token_logprob(logits, token, self._params.logprobs))
            return token

    async def next_tokens(self) -> AsyncIterator[list[int]]:
        feed = self._prompt_ids
        position = len(self._prompt_ids)  # tokens in the cache once `feed` is in
        generated: list[int] = []
        while not self._closed and position < self._engine.max_context_tokens:
            token = await trio.to_thread.run_sync(self._forward_and_sample, feed, position, generated)
            generated.append(token)
            self._traversals += 1
            if self._ttft_s is None:
                self._ttft_s = time.perf_counter() - self._opened_s
            self._committed += 1
            feed = [token]
            position += 1
            yield [token]

    def stats(self) -> dict[str, Any]:
        decode_traversals = max(self._traversals - 1, 0)
        return {
            "engine": "local",
            "traversals": self._traversals,
            "committed_tokens": self._committed,
            # The prefill traversal commits the first token; decode ones one each.
            "tokens_per_traversal": (self._committed - 1) / decode_traversals if decode_traversals else None,
            "ttft_s": self._ttft_s,
            "elapsed_s": time.perf_counter() - self._opened_s,
            "ring_epoch": None,
            "drafter": None,
        }

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.open_jobs -= 1
        self._cache = None


class LocalEngine:
    """Engine over an in-process transformers causal LM (any family transformers runs)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_id: str,
        max_context_tokens: int | None = None,
    ) -> None:
        self.model = model.train(False)  # inference mode: no dropout
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.max_context_tokens = int(max_context_tokens or model.config.max_position_embeddings)
        self.eos_token_ids = eos_ids_of(tokenizer, getattr(model.generation_config, "eos_token_id", None))
        self.open_jobs = 0

    @classmethod
    def from_pretrained(cls, path: str, *, gguf_file: str | None = None, model_id: str | None = None,
                        max_context_tokens: int | None = None) -> LocalEngine:
        """Load a local HF directory (safetensors), or `gguf_file` inside it, in float32 on
        CPU. Never downloads: a missing path fails instead of reaching the network."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        kwargs: dict[str, Any] = {"local_files_only": True}
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        tokenizer = AutoTokenizer.from_pretrained(path, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        return cls(model, tokenizer, model_id=model_id or str(path), max_context_tokens=max_context_tokens)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    async def open_job(self, prompt_ids: list[int], params: SamplingParams) -> LocalJob:
        return LocalJob(self, prompt_ids, params)

    def info(self) -> dict[str, Any]:
        return {
            "ready": True,
            "engine": "local",
            "model": self.model_id,
            "max_context_tokens": self.max_context_tokens,
            "open_jobs": self.open_jobs,
            "stages": [],
        }

