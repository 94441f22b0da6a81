"""The gateway's token counter on a real in-process ring, read while a streamed answer is
still coming and after a stage died under it (issue 21: operators).

Bug guarded: shard_generated_tokens_total counted a job's tokens only when the job ended,
so a scrape during a long generation undercounted; counting them as delivered must not
count them again at the job's end, nor count the committed tokens a resumed job
re-prefills on its new ring. Sound: the ring's head is held (its compute limiter) once the
stream's first chunk is in, so the scrape is taken with the job running and short of its
answer; the tail is then killed, so the job resumes on the survivors; the counter must end
equal to the usage the stream reports, which must be the uninterrupted run's length and
text (the same request served first, not streamed).
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from coordinator.gateway.api import ApiConfig, serve_http
from coordinator.gateway.metrics import GatewayMetrics
from coordinator.gateway.operator import create_gateway
from coordinator.jobs.engine_config import EngineConfig
from tests.e2e.ringkit import memory_for_stages, open_local_ring

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


async def generated(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}["shard_generated_tokens_total"]


async def running(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}["shard_jobs_running"]


def test_tokens_count_while_streamed_and_once_across_a_resume(tiny_llama_store):
    async def main():
        async with open_local_ring(tiny_llama_store, 3, engine=EngineConfig(draft="none", resume_wait_s=5),
                                   node_config={"max_memory_bytes": memory_for_stages(tiny_llama_store, 2)}) as ring:
            ring.engine.model_id = "tiny"
            no_eos = {str(t): -100 for t in ring.engine.eos_token_ids}  # the answer runs to max_tokens
            body = {"model": "tiny", "prompt": [1, 50, 60, 70, 80, 90], "max_tokens": MAX_TOKENS, "temperature": 0,
                    "logit_bias": no_eos}
            async with trio.open_nursery() as nursery:
                port = await nursery.start(serve_http, create_gateway(ring.engine, ApiConfig(), metrics=GatewayMetrics()),
                                           "127.0.0.1", 0)
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as client:
                    with trio.fail_after(180):
                        whole = (await client.post("/v1/completions", json=body)).json()
                        before = await generated(client)
                        events, during = [], None
                        stream_body = {**body, "stream": True, "stream_options": {"include_usage": True}}
                        async with client.stream("POST", "/v1/completions", json=stream_body) as r:
                            async for line in r.aiter_lines():
                                if not line.startswith("data: ") or line == "data: [DONE]":
                                    continue
                                events.append(json.loads(line[len("data: "):]))
                                if during is None and events[-1]["choices"] and events[-1]["choices"][0]["text"]:
                                    head = ring.nodes[ring.node_ids.index(ring.swarm.ring.stages[0][0])]
                                    tail = ring.swarm.ring.stages[-1][0]
                                    async with head.compute_limiter:  # the job stalls short of its answer
                                        during = (await generated(client) - before, await running(client))
                                        ring.kill(tail)  # it resumes on the survivors
                        after = await generated(client) - before
                        survivors = {p for p, _ in ring.swarm.ring.stages}
                nursery.cancel_scope.cancel()
        return whole, events, during, after, tail, survivors

    whole, events, (during, running_then), after, tail, survivors = trio.run(main)
    assert whole["usage"]["completion_tokens"] == MAX_TOKENS
    assert running_then == 1 and 0 < during < MAX_TOKENS
    assert tail not in survivors  # the job finished on a re-formed ring
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS and after == MAX_TOKENS
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole["choices"][0]["text"]
