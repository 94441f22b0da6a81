"""Tool calls read from a streaming reply (coordinator.gateway.tool_stream): whatever the
chunking, the deltas add up to what the whole reply parses to (coordinator.gateway.tools)."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from coordinator.gateway.tool_stream import ToolCallStream
from coordinator.gateway.tools import parse_tool_calls

HERMES = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
TEXTS = [
    HERMES,
    '<tool_call>{"name": "a", "arguments": {"x": [1, {"y": "}"}]}}</tool_call>\n<tool_call>{"arguments": {"q": "\\"hi\\""}, "name": "b"}</tool_call>',
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',  # Llama 3.x, bare
    '[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"k": 2}}]',
    '<tool_call>{"name": "s", "arguments": "{\\"k\\": 1}"}</tool_call>',  # arguments as a JSON string
    '<tool_call>{"name": "n"}</tool_call> and then some words',
    "Plain text with a < sign and <tool but no call.",
    '{"title": "not a call", "n": 1}',  # JSON content, not a call
    '<tool_call>{"oops": </tool_call>',  # a malformed block: content
]


def replay(text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, object]], list[dict]]:
    """Feed `text` cut at `cuts`; (content, [(name, arguments)], deltas) as a client accumulates them."""
    ids = (f"call_{i}" for i in itertools.count())
    reader = ToolCallStream(new_id=lambda: next(ids))
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in reader.feed(text[a:b])] + reader.finish()
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc["function"].get("name") or ""
            call["arguments"] += tc["function"].get("arguments") or ""
    out = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return content or None, out, deltas


def whole(text: str) -> tuple[str | None, list[tuple[str, object]]]:
    content, calls = parse_tool_calls(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize("text", TEXTS)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
def test_any_chunking_adds_up_to_the_whole_replys_parse(text, cuts):
    # Bug guarded: a call split across chunks lost, doubled or sent with broken arguments; a
    # tag's text leaking into content; content that is JSON taken for a call. Sound: the
    # whole-reply parser is the reference, and hypothesis cuts the text anywhere.
    content, calls, deltas = replay(text, cuts)
    want_content, want_calls = whole(text)
    assert calls == want_calls
    if calls:  # content beside calls: the words around the tags (the whole reply strips its ends)
        assert (content or "").split() == (want_content or "").split()
    else:
        assert content == want_content
    assert "<tool_call" not in (content or "") or not calls


def test_deltas_follow_openais_order():
    # A call's first delta has its id, type and name and empty arguments; the rest carry
    # only arguments; content sent before the tag never includes a piece of it.
    _, _, deltas = replay(HERMES, list(range(1, len(HERMES))))  # one character at a time
    assert "".join(d.get("content", "") for d in deltas) == "Sure. "
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert calls[0] == {"index": 0, "id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}
    assert all(set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"} for tc in calls[1:])
    assert len(calls) > 10  # arguments streamed as written, not held to the end


def test_content_is_not_held_longer_than_a_possible_tag():
    reader = ToolCallStream()
    assert reader.feed("Hello <tool") == [{"content": "Hello "}]
    assert reader.feed("box is here") == [{"content": "<toolbox is here"}]
    assert reader.finish() == [] and not reader.called
