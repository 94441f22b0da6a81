"""The HTTP gateway: OpenAI shapes, statuses and connection lifetime.

Two clients: httpx over the ASGI app in-process (fast, exact bodies), and the official
`openai` client (sync, in a worker thread) against the real hypercorn server on loopback.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import torch
import trio

from coordinator.gateway.api import ApiConfig, create_app, serve_http
from coordinator.jobs.engine import encode_chat

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HELLO = [{"role": "user", "content": "hello"}]


def asgi(app, fn: Callable[[httpx.AsyncClient], Awaitable[Any]]) -> Any:
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await fn(client)

    return trio.run(main)


def served(app, fn: Callable[[str], Awaitable[Any]]) -> Any:
    """Run the real server on 127.0.0.1:<free port> for the duration of fn(base_url)."""

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            with trio.fail_after(30):
                result = await fn(f"http://127.0.0.1:{port}")
            nursery.cancel_scope.cancel()
            return result

    return trio.run(main)


def openai_client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=20)


def sse_events(body: str) -> list[Any]:
    """Parse `data: ...` events; asserts the framing OpenAI clients rely on."""
    blocks = [b for b in body.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b[len("data: "):] if b == "data: [DONE]" else json.loads(b[len("data: "):]) for b in blocks]


def greedy_reference(tiny_llama, tokenizer, prompt_ids: list[int], max_new_tokens: int) -> str:
    out = tiny_llama.model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=0)[0, len(prompt_ids):].tolist()
    # The random tiny model writes invalid UTF-8; a character cut off by max_tokens is not
    # text (IncrementalDetokenizer.flush), so the reference drops a trailing U+FFFD too.
    return tokenizer.decode(out, skip_special_tokens=True).rstrip("\ufffd")


def test_openai_client_chat_and_completions_equal_greedy_generate(local_engine, tiny_llama, tiny_tokenizer):
    # Bug guarded: the HTTP path changing what the model generates (template, detokenising,
    # stop handling, SSE framing). Sound: transformers generate() on the same prompt ids is
    # the reference, through the unmodified openai client, whole and streamed.
    app = create_app(local_engine)
    chat_ref = greedy_reference(tiny_llama, tiny_tokenizer, encode_chat(tiny_tokenizer, HELLO), 10)
    prompt = "The quick brown"
    completion_ref = greedy_reference(tiny_llama, tiny_tokenizer, tiny_tokenizer.encode(prompt), 10)

    def calls(base_url: str):
        client = openai_client(base_url)
        whole = client.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=10, temperature=0)
        chunks = list(client.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=10, temperature=0,
                                                     stream=True, stream_options={"include_usage": True}))
        comp = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10, temperature=0)
        comp_chunks = list(client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=10,
                                                     temperature=0, stream=True))
        models = client.models.list()
        return whole, chunks, comp, comp_chunks, models

    async def fn(base_url):
        return await trio.to_thread.run_sync(calls, base_url)

    whole, chunks, comp, comp_chunks, models = served(app, fn)
    assert [m.id for m in models.data] == ["tiny-llama"]
    assert whole.choices[0].message.content == chat_ref
    assert whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens == len(encode_chat(tiny_tokenizer, HELLO))
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    assert whole.model_extra["shard"]["engine"] == "local"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat_ref
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert comp.choices[0].text == completion_ref
    assert "".join(c.choices[0].text for c in comp_chunks) == completion_ref


def test_two_concurrent_requests_both_complete(local_engine):
    # Bug guarded: a shared cache/generator or a blocking forward serialising or mixing
    # jobs. Sound: two seeded requests in parallel equal the same requests run alone.
    app = create_app(local_engine)
    body = dict(model="tiny-llama", messages=HELLO, max_tokens=12, temperature=1.0)

    async def fn(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
            alone = [(await client.post(CHAT, json=dict(body, seed=s))).json() for s in (1, 2)]
            together: dict[int, Any] = {}

            async def one(seed):
                together[seed] = (await client.post(CHAT, json=dict(body, seed=seed))).json()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(one, 1)
                nursery.start_soon(one, 2)
            return alone, [together[1], together[2]]

    alone, together = served(app, fn)
    text = [r["choices"][0]["message"]["content"] for r in alone]
    assert [r["choices"][0]["message"]["content"] for r in together] == text
    assert local_engine.open_jobs == 0


BAD_REQUESTS = [
    # (path, raw body or json, status, param, fragment of the message)
    (CHAT, b"{not json", 400, None, "could not parse the JSON body"),
    (CHAT, b"[1, 2]", 400, None, "must be a JSON object"),
    (CHAT, {"messages": HELLO}, 400, "model", "Missing required parameter: 'model'"),
    (CHAT, {"model": "scripted"}, 400, "messages", "Missing required parameter: 'messages'"),
    (CHAT, {"model": "scripted", "messages": []}, 400, "messages", "at least one message"),
    (CHAT, {"model": "scripted", "messages": "hi"}, 400, "messages", "expected an array"),
    (CHAT, {"model": "scripted", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role", "must be one of"),
    (CHAT, {"model": "scripted", "messages": HELLO, "temperature": "hot"}, 400, "temperature", "expected a decimal"),
    (CHAT, {"model": "scripted", "messages": HELLO, "temperature": 3}, 400, "temperature", "[0, 2.0]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "top_p": 0}, 400, "top_p", "(0, 1]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "top_k": -2}, 400, "top_k", ">= 0"),
    (CHAT, {"model": "scripted", "messages": HELLO, "n": 0}, 400, "n", "[1, 8]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "n": 9}, 400, "n", "[1, 8]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "top_logprobs": 2}, 400, "top_logprobs", "needs 'logprobs': true"),
    (CHAT, {"model": "scripted", "messages": HELLO, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "[0, 20]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "presence_penalty": 3}, 400, "presence_penalty", "[-2.0, 2.0]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    (CHAT, {"model": "scripted", "messages": HELLO, "logit_bias": {"5": 200}}, 400, "logit_bias", "[-100.0, 100.0]"),
    (CHAT, {"model": "scripted", "messages": HELLO, "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    (CHAT, {"model": "scripted", "messages": HELLO, "max_tokens": 10**12}, 400, "max_tokens", "context of 64"),
    (CHAT, {"model": "scripted", "messages": HELLO, "max_tokens": True}, 400, "max_tokens", "expected an integer"),
    (CHAT, {"model": "scripted", "messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "at most 4"),
    (CHAT, {"model": "scripted", "messages": HELLO, "stream": "yes"}, 400, "stream", "expected a boolean"),
    (CHAT, {"model": "gpt-4", "messages": HELLO}, 404, "model", "The model `gpt-4` does not exist"),
    (CHAT, {"model": "scripted", "messages": [{"role": "user", "content": "x" * 100}]}, 413, "messages", "context is 64 tokens"),
    (COMPLETIONS, {"model": "scripted", "prompt": "x" * 100}, 413, "prompt", "context is 64 tokens"),
    (COMPLETIONS, {"model": "scripted"}, 400, "prompt", "Missing required parameter: 'prompt'"),
    (COMPLETIONS, {"model": "scripted", "prompt": [1, 99999]}, 400, "prompt", "token ids must be in"),
    (COMPLETIONS, {"model": "scripted", "prompt": ["a", "b"]}, 400, "prompt", "batches"),
    (COMPLETIONS, {"model": "scripted", "prompt": "x", "best_of": 2}, 400, "best_of", "best_of=1"),
    (COMPLETIONS, {"model": "scripted", "prompt": "x", "logprobs": 6}, 400, "logprobs", "[0, 5]"),
    (COMPLETIONS, {"model": "scripted", "prompt": ""}, 400, "prompt", "must not be empty"),
    (COMPLETIONS, {"model": "scripted", "prompt": "", "stream": True}, 400, "prompt", "must not be empty"),
    (COMPLETIONS, {"model": "scripted", "prompt": []}, 400, "prompt", "non-empty array"),
]


@pytest.mark.parametrize("path, body, status, param, fragment", BAD_REQUESTS)
def test_invalid_requests_get_the_right_status_and_openai_error_shape(scripted, path, body, status, param, fragment):
    # Bug guarded: bad input reaching the engine (a 500, a hang, or a silently clamped
    # value). Sound: each case differs from a valid request in one field, and the engine
    # must not have opened a job for any of them.
    engine = scripted(["ok"])
    kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = asgi(create_app(engine), lambda c: c.post(path, **kwargs))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param and fragment in err["message"], err
    assert engine.jobs == []


def test_routes_models_health_ring_and_unknown_paths(scripted):
    engine = scripted(["ok"])

    async def fn(c):
        return [await c.get("/v1/models"), await c.get("/v1/models/scripted"), await c.get("/v1/models/nope"),
                await c.get("/health"), await c.get("/v1/ring"), await c.get("/v1/nothing"), await c.get(CHAT)]

    models, model, missing, health, ring, nothing, wrong_method = asgi(create_app(engine), fn)
    assert models.json()["data"][0]["id"] == "scripted" and model.json()["object"] == "model"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert ring.json() == engine.info()
    assert nothing.status_code == 404 and "error" in nothing.json()
    assert wrong_method.status_code == 405 and "error" in wrong_method.json()


def test_no_ring_is_503_on_requests_and_health(scripted):
    # Bug guarded: a not-ready engine answering 500 or hanging. Sound: ready=False engine.
    engine = scripted(["ok"], ready=False)

    async def fn(c):
        return await c.post(CHAT, json={"model": "scripted", "messages": HELLO}), await c.get("/health")

    chat, health = asgi(create_app(engine), fn)
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "no_ring"
    assert health.status_code == 503 and health.json()["engine"]["ready"] is False


def test_stop_and_shard_stats_in_whole_and_streamed_responses(scripted):
    # Bug guarded: stop strings or EOS handled differently streamed vs whole. Sound: the
    # script puts the stop string mid-block; both modes must cut at the same place.
    engine = scripted(["Hi the", "re. STOP no", "pe"])
    body = {"model": "scripted", "messages": HELLO, "stop": "STOP"}

    async def fn(c):
        return await c.post(CHAT, json=body), await c.post(CHAT, json=dict(body, stream=True))

    whole, stream = asgi(create_app(engine), fn)
    assert whole.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "Hi there. "},
                                          "finish_reason": "stop", "logprobs": None}
    assert whole.json()["usage"]["completion_tokens"] == len("Hi there. STOP")
    assert whole.json()["shard"] == {"engine": "scripted", "traversals": 2}
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "Hi there. "
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["shard"]["traversals"] == 2
    assert all(job.closed for job in engine.jobs)


def test_engine_failure_mid_generation_is_503_or_an_sse_error(scripted):
    # Bug guarded: a dead ring turning into a 500 or a stream that ends as if complete.
    engine = scripted(["abc", "def"], fail_after=1)
    body = {"model": "scripted", "prompt": "x"}

    async def fn(c):
        return await c.post(COMPLETIONS, json=body), await c.post(COMPLETIONS, json=dict(body, stream=True))

    whole, stream = asgi(create_app(engine), fn)
    assert whole.status_code == 503 and whole.json()["error"]["code"] == "job_failed"
    events = sse_events(stream.text)
    assert events[0]["choices"][0]["text"] == "abc" and events[-1]["error"]["code"] == "job_failed"
    assert "[DONE]" not in events and all(job.closed for job in engine.jobs)


def test_overload_is_429_and_a_disconnect_mid_stream_closes_the_job(scripted):
    # Bug guarded: unbounded admission, and jobs (remote KV caches) leaking when a client
    # goes away mid-stream. Sound: the gate is never set, so job 1 stays stuck after its
    # first block: only the disconnect can end it, and job 2 must be refused meanwhile.
    engine = scripted(["ab", "cd", "ef"])
    engine.gate = trio.Event()
    app = create_app(engine, ApiConfig(max_concurrent_jobs=1, max_queued_jobs=0))  # no queue: 429 at once
    body = {"model": "scripted", "messages": HELLO, "stream": True}

    async def fn(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
            async with client.stream("POST", CHAT, json=body) as first:
                assert first.status_code == 200
                async for line in first.aiter_lines():
                    if "ab" in line:
                        break
                second = await client.post(CHAT, json=body)
            await engine.jobs[0].closed_event.wait()  # the server noticed the disconnect
            health = (await client.get("/health")).json()
            return second, health

    second, health = served(app, fn)
    assert second.status_code == 429 and second.json()["error"]["code"] == "too_many_concurrent_jobs"
    assert int(second.headers["retry-after"]) >= 1
    assert len(engine.jobs) == 1 and engine.jobs[0].blocks_sent == 1
    assert health["jobs_running"] == 0
