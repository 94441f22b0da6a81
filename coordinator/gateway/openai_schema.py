"""OpenAI request bodies -> validated frozen dataclasses, and OpenAI's error shape.

Every field a client sends is type-checked and range-checked here with an exact message
naming it; unknown top-level fields are ignored and listed (`ignored`) for the response's
Warning header, as vLLM does, so clients that send newer fields keep working. This module does not know about
engines, tokenizers, HTTP servers or the model's name; the HTTP layer checks the model
id and the prompt length (which needs the tokenizer).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from coordinator.spec.penalties import LogitRules
from coordinator.spec.sampling import MAX_STOP_STRINGS, SamplingParams
from coordinator.errors import RequestError, SamplingParamError

MAX_BODY_BYTES = 4 * 1024 * 1024
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})
# OpenAI's /v1/completions default; chat completions default to "until the context is full".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
MAX_CHOICES = 8  # n: each choice is a job of its own, and takes a job slot
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound on the legacy completions' logprobs



def _invalid_type(name: str, expected: str, value: object) -> RequestError:
    got = "null" if value is None else type(value).__name__
    return RequestError(
        400, f"Invalid type for '{name}': expected {expected}, but got {got} instead.", param=name, code="invalid_type"
    )


def _invalid_value(name: str, reason: str, value: object) -> RequestError:
    return RequestError(400, f"Invalid '{name}': {reason} (got {value!r}).", param=name, code="invalid_value")


def _unsupported(name: str, reason: str) -> RequestError:
    return RequestError(400, f"Unsupported value for '{name}': {reason}.", param=name, code="unsupported_value")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says why not."""
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(413, f"Request body is {len(raw)} bytes; the limit is {MAX_BODY_BYTES}.", code="body_too_large")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise RequestError(400, f"We could not parse the JSON body of your request: {exc}.", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise RequestError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


class _Fields:
    """Reads typed optional fields from one body and remembers which names it consumed."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body, self.seen = body, set()

    def get(self, name: str) -> Any:
        self.seen.add(name)
        return self.body.get(name)

    def required_str(self, name: str) -> str:
        if name not in self.body:
            raise RequestError(400, f"Missing required parameter: '{name}'.", param=name, code="missing_required_parameter")
        value = self.get(name)
        if not isinstance(value, str):
            raise _invalid_type(name, "a string", value)
        return value

    def bool_(self, name: str, default: bool) -> bool:
        value = self.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _invalid_type(name, "a boolean", value)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _invalid_type(name, "a decimal", value)
        return float(value)

    def int_(self, name: str, default: int | None) -> int | None:
        value = self.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid_type(name, "an integer", value)
        return value

    def unknown(self) -> tuple[str, ...]:
        """Fields no parser read: ignored, and named in a response header (as vLLM does)."""
        return tuple(sorted(set(self.body) - self.seen))


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[dict[str, Any], ...] = ()  # an assistant's earlier calls, arguments as objects
    tool_call_id: str | None = None  # a tool message: the call it answers

    def as_template_dict(self) -> dict[str, Any]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


@dataclass(frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    n: int = 1  # choices, each its own job (choice i seeded seed + i)
    ignored: tuple[str, ...] = ()  # unknown top-level fields
    json_schema: dict[str, Any] | None = None  # response_format's schema (json_object: any object)
    tools: tuple[dict[str, Any], ...] = ()  # function definitions for the chat template (tool_choice "none": none)
    forced_tool: str | None = None  # tool_choice: "required" (any tool) or the function named; None: the model decides


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]
    params: SamplingParams
    stream: bool
    include_usage: bool
    echo: bool
    n: int = 1
    ignored: tuple[str, ...] = ()


def _content_text(i: int, content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _unsupported(f"messages[{i}].content", "only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise _invalid_type(f"messages[{i}].content", "a string or an array of text parts", content)


def _messages(value: object) -> tuple[ChatMessage, ...]:
    if not isinstance(value, list):
        raise _invalid_type("messages", "an array", value)
    if not value:
        raise _invalid_value("messages", "must contain at least one message", value)
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise _invalid_type(f"messages[{i}]", "an object", m)
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
        if extra:
            raise _unsupported(f"messages[{i}]", f"fields {extra} are not supported")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise _invalid_value(f"messages[{i}].role", f"must be one of {sorted(CHAT_ROLES)}", role)
        calls = _tool_calls(i, m.get("tool_calls")) if role == "assistant" else ()
        if "content" not in m and not calls:
            raise RequestError(
                400, f"Missing required parameter: 'messages[{i}].content'.", param=f"messages[{i}].content",
                code="missing_required_parameter",
            )
        call_id = m.get("tool_call_id")
        if role == "tool" and not isinstance(call_id, str):
            raise _invalid_type(f"messages[{i}].tool_call_id", "a string", call_id)
        content = "" if m.get("content") is None and calls else _content_text(i, m.get("content"))
        out.append(ChatMessage(role, content, calls, call_id if role == "tool" else None))
    return tuple(out)


def _tool_calls(i: int, value: object) -> tuple[dict[str, Any], ...]:
    """An assistant message's calls as chat templates read them: arguments as objects."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise _invalid_type(f"messages[{i}].tool_calls", "an array", value)
    out = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _invalid_type(f"messages[{i}].tool_calls[{j}].function", "an object with a name", fn)
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            pass  # the template shows it as the text it is
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return tuple(out)


def _tools(f: _Fields) -> tuple[tuple[dict[str, Any], ...], str | None]:
    """`tools` as the chat template wants them (() when absent or tool_choice is "none"),
    and the call tool_choice forces: "required", a function's name, or None."""
    tools, choice = f.get("tools"), f.get("tool_choice")
    f.get("parallel_tool_calls")  # accepted: a template decides how many calls a reply holds
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise _invalid_value("tool_choice", "needs 'tools'", choice)
        return (), None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise _invalid_type("tools", "an array of {'type': 'function', 'function': {'name': ...}}", tools)
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto", "none", "required"):
        forced = "required" if choice == "required" else None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and choice["function"].get("name") in names:
        forced = choice["function"]["name"]
    else:
        raise _invalid_value("tool_choice", f"must be 'none', 'auto', 'required' or a function of tools {names}", choice)
    return ((), None) if choice == "none" else (tuple(tools), forced)


def _response_format(value: object) -> dict[str, Any] | None:
    """The JSON schema the output must match: None for text, any object for json_object."""
    if value is None or value == {"type": "text"}:
        return None
    if not isinstance(value, dict):
        raise _invalid_type("response_format", "an object", value)
    if value.get("type") == "json_object":
        return {"type": "object"}
    if value.get("type") == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise _invalid_type("response_format.json_schema", "an object with a 'schema' object", spec)
        return spec.get("schema", {})
    raise _invalid_value("response_format", "type must be 'text', 'json_object' or 'json_schema'", value.get("type"))


def _stop(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        if len(value) > MAX_STOP_STRINGS:
            raise _invalid_value("stop", f"at most {MAX_STOP_STRINGS} stop sequences are allowed", value)
        return tuple(value)
    raise _invalid_type("stop", "a string or an array of strings", value)


def _logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} map (JSON keys are strings) as sorted (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _invalid_type("logit_bias", "an object mapping token ids to numbers", value)
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        if not key.strip().isdigit():
            raise _invalid_value("logit_bias", "keys must be token ids", key)
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _invalid_type(f"logit_bias.{key}", "a number", bias)
        pairs[int(key)] = float(bias)
    return tuple(sorted(pairs.items()))


def _common(f: _Fields, *, max_tokens: int | None, max_context_tokens: int,
            logprobs: int | None) -> tuple[SamplingParams, bool, bool, int]:
    """Fields chat and completions share: sampling, stopping, streaming, choices."""
    if max_tokens is not None and max_tokens > max_context_tokens:
        raise _invalid_value("max_tokens", f"must be at most the model's context of {max_context_tokens} tokens", max_tokens)
    n = f.int_("n", 1)
    if not 1 <= n <= MAX_CHOICES:
        raise _invalid_value("n", f"must be an integer in [1, {MAX_CHOICES}]", n)
    try:
        rules = LogitRules(f.number("presence_penalty", 0.0), f.number("frequency_penalty", 0.0),
                           _logit_bias(f.get("logit_bias")))
    except SamplingParamError as exc:
        raise _invalid_value(exc.param, exc.reason, exc.value) from exc
    user = f.get("user")
    if user is not None and not isinstance(user, str):
        raise _invalid_type("user", "a string", user)
    stream = f.bool_("stream", False)
    options = f.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise _invalid_value("stream_options", "only {'include_usage': bool} is supported", options)
    include_usage = bool((options or {}).get("include_usage", False))
    try:
        params = SamplingParams(
            temperature=f.number("temperature", 1.0),
            top_p=f.number("top_p", 1.0),
            top_k=f.int_("top_k", 0),
            seed=f.int_("seed", None),
            max_tokens=max_tokens,
            stop=_stop(f.get("stop")),
            rules=rules,
            logprobs=logprobs,
        )
    except SamplingParamError as exc:
        raise _invalid_value(exc.param, exc.reason, exc.value) from exc
    return params, stream, include_usage, n


def parse_chat_request(body: dict[str, Any], *, max_context_tokens: int) -> ChatRequest:
    f = _Fields(body)
    model = f.required_str("model")
    if "messages" not in body:
        raise RequestError(400, "Missing required parameter: 'messages'.", param="messages", code="missing_required_parameter")
    messages = _messages(f.get("messages"))
    max_tokens = f.int_("max_completion_tokens", None)
    if max_tokens is None:
        max_tokens = f.int_("max_tokens", None)
    else:
        f.get("max_tokens")
    top = f.int_("top_logprobs", None)
    if top is not None and not f.bool_("logprobs", False):
        raise _invalid_value("top_logprobs", "needs 'logprobs': true", top)
    logprobs = (0 if top is None else top) if f.bool_("logprobs", False) else None
    json_schema = _response_format(f.get("response_format"))
    params, stream, include_usage, n = _common(f, max_tokens=max_tokens, max_context_tokens=max_context_tokens,
                                               logprobs=logprobs)
    tools, forced = _tools(f)
    if forced is not None and json_schema is not None:
        raise _unsupported("tool_choice", "a forced tool call and response_format cannot both shape one reply")
    return ChatRequest(model, messages, params, stream, include_usage, n, f.unknown(), json_schema, tools, forced)


def _prompt(value: object) -> str | tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, str):
        if not value:
            raise _invalid_value("prompt", "must not be empty", value)
        return value
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return tuple(value)
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        raise _unsupported("prompt", "batches of several prompts are not supported")
    raise _invalid_type("prompt", "a string or a non-empty array of token ids", value)


def parse_completion_request(body: dict[str, Any], *, max_context_tokens: int) -> CompletionRequest:
    f = _Fields(body)
    model = f.required_str("model")
    if "prompt" not in body:
        raise RequestError(400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter")
    prompt = _prompt(f.get("prompt"))
    max_tokens = f.int_("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
    echo = f.bool_("echo", False)
    logprobs = f.int_("logprobs", None)
    if logprobs is not None and not 0 <= logprobs <= MAX_COMPLETION_LOGPROBS:
        raise _invalid_value("logprobs", f"must be an integer in [0, {MAX_COMPLETION_LOGPROBS}]", logprobs)
    if f.get("suffix") is not None:
        raise _unsupported("suffix", "suffix is not supported")
    if f.int_("best_of", 1) != 1:
        raise _unsupported("best_of", "only best_of=1 is supported")
    params, stream, include_usage, n = _common(f, max_tokens=max_tokens, max_context_tokens=max_context_tokens,
                                               logprobs=logprobs)
    return CompletionRequest(model, prompt, params, stream, include_usage, echo, n, f.unknown())
