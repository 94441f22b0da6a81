"""n choices, logprobs and ignored fields through the gateway (issue 23), with the official
`openai` client against the real server over the tiny llama's LocalEngine."""

from __future__ import annotations

import math

import torch
import trio

from coordinator.gateway.api import create_app
from coordinator.jobs.engine import encode_chat
from tests.coordinator.gateway.test_api_http import CHAT, HELLO, asgi, openai_client, served, sse_events


def ask(app, calls):
    async def fn(base_url):
        return await trio.to_thread.run_sync(calls, openai_client(base_url))

    return served(app, fn)


def test_n_choices_are_seeded_per_choice_and_stream_by_index(local_engine):
    # Bug guarded: n > 1 refused, choices sharing one seed (n identical texts), or streamed
    # chunks of different choices mixed up. Sound: choice 0 of a seeded n=3 request must be
    # the n=1 answer for that seed, choice 1 the n=1 answer for seed + 1, and the streamed
    # chunks, grouped by index, the whole response's texts.
    app = create_app(local_engine)
    body = dict(model="tiny-llama", messages=HELLO, max_tokens=12, temperature=1.0, seed=5)

    def calls(client):
        three = client.chat.completions.create(n=3, **body)
        alone = [client.chat.completions.create(**{**body, "seed": s}) for s in (5, 6)]
        chunks = list(client.chat.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **body))
        return three, alone, chunks

    three, alone, chunks = ask(app, calls)
    texts = [c.message.content for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts[:2] == [a.choices[0].message.content for a in alone]
    assert len(set(texts)) > 1
    # The prompt counts once; the completions add up (choices 0 and 1 are the ones alone).
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert three.usage.completion_tokens >= alone[0].usage.completion_tokens + alone[1].usage.completion_tokens + 1
    streamed = ["", "", ""]
    for c in chunks:
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
    assert chunks[-1].usage.completion_tokens == three.usage.completion_tokens
    assert local_engine.open_jobs == 0


def test_chat_and_completion_logprobs_come_from_the_model_row_that_chose_each_token(local_engine, tiny_llama,
                                                                                    tiny_tokenizer):
    # Bug guarded: logprobs refused, or reported from a row other than the one that chose
    # the token. Sound: at temperature 0 the chosen token is the row's argmax, so it is
    # the first of the top logprobs; the first token's logprob equals transformers'
    # log_softmax of the prompt's last row (the oracle), and every entry is a logprob.
    app = create_app(local_engine)
    prompt_ids = encode_chat(tiny_tokenizer, HELLO)
    with torch.no_grad():
        first_row = torch.log_softmax(tiny_llama.model(torch.tensor([prompt_ids])).logits[0, -1].double(), dim=-1)

    def calls(client):
        chat = client.chat.completions.create(model="tiny-llama", messages=HELLO, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3)
        comp = client.completions.create(model="tiny-llama", prompt="The quick", max_tokens=5, temperature=0, logprobs=2)
        streamed = list(client.completions.create(model="tiny-llama", prompt="The quick", max_tokens=5, temperature=0,
                                                  logprobs=2, stream=True))
        return chat, comp, streamed

    chat, comp, streamed = ask(app, calls)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == entry.logprob
        assert entry.bytes == list(entry.token.encode())
    assert math.isclose(content[0].logprob, float(first_row.max()), abs_tol=1e-4)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert all(len(top) <= 2 and max(top.values()) == got for top, got in zip(lp.top_logprobs, lp.token_logprobs))
    assert lp.text_offset[0] == 0
    streamed_logprobs = [x for c in streamed if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs]
    assert streamed_logprobs == lp.token_logprobs


def test_unknown_fields_are_ignored_and_named_in_a_warning_header(scripted):
    # Bug guarded (issue 23): agent clients sending newer fields (metadata, store, ...) got a
    # 400. Sound: the same request with and without the fields answers the same text.
    engine = scripted(["ok"])
    extra = {"metadata": {"a": "b"}, "store": False, "frobnicate": 1}

    async def fn(c):
        plain = await c.post(CHAT, json={"model": "scripted", "messages": HELLO})
        return plain, await c.post(CHAT, json={"model": "scripted", "messages": HELLO, **extra})

    plain, extended = asgi(create_app(engine), fn)
    assert extended.status_code == 200 and "warning" not in plain.headers
    assert extended.headers["warning"] == '299 shard "Ignored unknown fields: frobnicate, metadata, store"'
    assert extended.json()["choices"] == plain.json()["choices"]


def test_a_bug_mid_stream_still_ends_the_stream_with_an_error_event(scripted):
    # Bug guarded (issue 23): an unexpected exception while streaming left the client a 200
    # with an empty body and no end. Sound: the scripted second block holds a None where a
    # token id must be, which the detokeniser cannot decode (a TypeError, not ours).
    engine = scripted(["ab"])
    engine.blocks.append([None])
    r = asgi(create_app(engine), lambda c: c.post(CHAT, json={"model": "scripted", "messages": HELLO, "stream": True}))
    events = sse_events(r.text)
    assert r.status_code == 200 and events[-1]["error"]["type"] == "server_error", events
    assert engine.jobs[0].closed
