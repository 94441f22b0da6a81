"""tools / tool_choice through the model's chat template, tool_calls parsed back (issue 23),
with the official `openai` client against the real server over a scripted engine."""

from __future__ import annotations

import json

from coordinator.gateway.api import create_app
from coordinator.gateway.tools import parse_tool_calls
from tests.conftest import make_tiny_tokenizer
from tests.coordinator.conftest import ScriptedEngine
from tests.coordinator.gateway.test_api_choices import ask
from tests.coordinator.gateway.test_api_http import CHAT, HELLO, asgi

# A Hermes-style template (Qwen 2.5/3 write calls this way), cut down to what the test reads.
TOOLS_TEMPLATE = (
    "{% if tools %}<s>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{\"name\": \"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}</tool_call>"
    "{% endfor %}{% else %}{{ m['content'] }}{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def tools_engine() -> ScriptedEngine:
    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    engine = ScriptedEngine(tokenizer, [], max_context_tokens=4096)
    engine.blocks = [engine.ids(CALL[:30]), engine.ids(CALL[30:])]
    engine.model_id = "tools-model"
    return engine


def test_tool_calls_round_trip_through_the_template(tiny_tokenizer):
    # Bug guarded (issue 23): `tools` refused with a 400, so agent clients could not run.
    # Sound: the scripted model writes a Hermes-style call; the client must get it as
    # tool_calls (whole and streamed), and the follow-up with the call and its result must
    # reach the model rendered by its own template (the scripted job's prompt shows it).
    engine = tools_engine()
    app = create_app(engine)
    ask_weather = [{"role": "user", "content": "Weather in Paris?"}]

    def calls(client):
        first = client.chat.completions.create(model="tools-model", messages=ask_weather, tools=[WEATHER],
                                               tool_choice="auto", parallel_tool_calls=False)
        chunks = list(client.chat.completions.create(model="tools-model", messages=ask_weather, tools=[WEATHER],
                                                     stream=True))
        call = first.choices[0].message.tool_calls[0]
        follow = [*ask_weather, first.choices[0].message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
        second = client.chat.completions.create(model="tools-model", messages=follow, tools=[WEATHER])
        return first, chunks, second

    first, chunks, second = ask(app, calls)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")
    streamed = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [tc.function.name for tc in streamed if tc.function.name] == ["get_weather"]
    assert json.loads("".join(tc.function.arguments or "" for tc in streamed)) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert second.choices[0].message.tool_calls  # the script answers the same; what matters is the prompt:
    prompt = engine.tokenizer.decode(engine.jobs[-1].prompt_ids)
    assert '"name": "get_weather"' in prompt and CALL in prompt and "<s>tool\n18 C and sunny</s>" in prompt


def test_streamed_tool_calls_arrive_as_openai_streams_them():
    # Bug guarded (issue 23): a streamed call sent as one delta at the very end, so an agent
    # saw nothing until the reply was over, or deltas a client cannot accumulate. Sound: the
    # official client's stream helper accumulates the deltas by index into the final message
    # (it raises on deltas it cannot place), and the raw chunks must show OpenAI's order: the
    # id, type and name first with empty arguments, then the arguments in fragments as the
    # model writes them (the script writes 7 characters a block).
    engine = tools_engine()
    text = "Let me check. " + CALL
    engine.blocks = [engine.ids(text[i:i + 7]) for i in range(0, len(text), 7)]
    app = create_app(engine)
    ask_weather = [{"role": "user", "content": "Weather in Paris?"}]

    def calls(client):
        with client.chat.completions.stream(model="tools-model", messages=ask_weather, tools=[WEATHER]) as stream:
            events = [(e.type, getattr(e, "chunk", None)) for e in stream]
            return events, stream.get_final_completion()

    events, final = ask(app, calls)
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls" and message.content == "Let me check. "
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    deltas = [tc for _, chunk in events if chunk is not None and chunk.choices
              for tc in (chunk.choices[0].delta.tool_calls or [])]
    assert deltas[0].id == call.id and deltas[0].type == "function" and deltas[0].function.name == "get_weather"
    assert deltas[0].function.arguments == "" and len(deltas) >= 3  # the arguments came in fragments
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    kinds = [kind for kind, _ in events]
    assert "tool_calls.function.arguments.delta" in kinds and "tool_calls.function.arguments.done" in kinds
    # Content first, and never the tag's text: the calls' chunks come after the content's.
    content_chunks = [i for i, (_, c) in enumerate(events) if c is not None and c.choices and c.choices[0].delta.content]
    call_chunks = [i for i, (_, c) in enumerate(events) if c is not None and c.choices and c.choices[0].delta.tool_calls]
    assert max(content_chunks) < min(call_chunks)


def test_tools_with_a_template_without_them_is_a_clear_400(scripted):
    # Sound: the tiny tokenizer's template never reads `tools`; silently dropping them
    # would answer as if the client had sent none.
    r = asgi(create_app(scripted(["ok"])), lambda c: c.post(CHAT, json={"model": "scripted", "messages": HELLO,
                                                                         "tools": [WEATHER]}))
    assert r.status_code == 400 and r.json()["error"]["code"] == "tools_not_supported", r.text
    assert "chat template without tool support" in r.json()["error"]["message"]


def test_tool_call_parsing_formats():
    # Hermes blocks with content around them, a bare Llama 3.x call, a list, and text.
    content, calls = parse_tool_calls('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>')
    assert content == "Sure." and json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert parse_tool_calls('{"name": "f", "parameters": {"y": 2}}')[1][0]["function"]["arguments"] == '{"y": 2}'
    assert [c["function"]["name"] for c in parse_tool_calls('[{"name": "a"}, {"name": "b"}]')[1]] == ["a", "b"]
    assert parse_tool_calls("just words") == ("just words", [])
    assert parse_tool_calls("<tool_call>not json</tool_call>") == ("<tool_call>not json</tool_call>", [])


CITY = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}}


def test_required_and_named_tool_choice_force_a_valid_call(tiny_llama):
    # Bug guarded: tool_choice "required" / a named function honoured only if the model
    # felt like it. Sound: the tiny model is random (it never writes a call unconstrained),
    # so a parseable call to the right function with schema-valid arguments at two seeds
    # can only come from the grammar.
    from coordinator.jobs.local_engine import LocalEngine

    tokenizer = make_tiny_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE.replace("{{ t | tojson }}", "{{ t.function.name }}")  # the tiny context is 256
    app = create_app(LocalEngine(tiny_llama.model, tokenizer, model_id="tiny-tools"))
    hello = [{"role": "user", "content": "hi"}]

    def calls(client):
        named = [client.chat.completions.create(model="tiny-tools", messages=hello, tools=[CITY, TIME], max_tokens=80,
                                                tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                temperature=1.0, seed=s) for s in (1, 2)]
        required = client.chat.completions.create(model="tiny-tools", messages=hello, tools=[CITY], max_tokens=80,
                                                  tool_choice="required", temperature=0)
        return named, required

    named, required = ask(app, calls)
    for r in named:
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "get_time" and isinstance(json.loads(call.function.arguments)["utc"], bool)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert required.choices[0].finish_reason == "tool_calls"


def test_a_tool_choice_naming_no_given_tool_is_a_400():
    engine = tools_engine()
    choice = {"type": "function", "function": {"name": "launch"}}
    r = asgi(create_app(engine), lambda c: c.post(CHAT, json={"model": "tools-model", "messages": HELLO, "tools": [WEATHER],
                                                               "tool_choice": choice}))
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    assert engine.jobs == []
