"""Tool calling: `tools` go to the model's chat template, and calls come back parsed.

The model's own template renders the tool definitions (and earlier calls and results in
the messages), so every model is prompted the way it was trained. Its reply is read for
calls in the two formats open models write: Hermes-style `<tool_call>{json}</tool_call>`
blocks (Qwen 2.5/3, Hermes, SmolLM3) and a bare JSON call or list of calls (Llama 3.x's
`{"name": ..., "parameters": ...}`). tool_choice "required" or a named function constrains
the reply to one such call (coordinator.spec.grammar). A template that has no tools is refused with a 400,
since it would silently drop them. It does not know engines, jobs or HTTP framing.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from typing import Any

from coordinator.errors import RequestError
from coordinator.gateway.responses import ChatShape
from coordinator.gateway.tool_stream import ToolCallStream
from coordinator.spec.grammar import Constraint, json_constraint

TOOL_CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def check_template_takes_tools(tokenizer: Any, model: str) -> None:
    """400 unless the model's chat template reads a `tools` variable."""
    template = tokenizer.chat_template
    sources = template.values() if isinstance(template, dict) else [template or ""]
    if not any("tools" in source for source in sources):
        raise RequestError(400, f"The model `{model}` has a chat template without tool support, so `tools` would be "
                                "ignored; send the request without tools, or serve a model whose template has them.",
                           param="tools", code="tools_not_supported")


def forced_call_constraint(tokenizer: Any, tools: Sequence[dict[str, Any]], forced: str) -> Constraint:
    """tool_choice "required" (a call to any of `tools`) or a function's name: the reply is
    constrained to one call, as the template's model writes calls (Hermes tags when the
    template has them, else a bare JSON call), its arguments to the function's schema."""
    options = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}
               for f in (t["function"] for t in tools) if forced == "required" or f["name"] == forced]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    template = tokenizer.chat_template
    hermes = any("<tool_call>" in source for source in (template.values() if isinstance(template, dict) else [template or ""]))
    return json_constraint(tokenizer, schema, wrap=("<tool_call>", "</tool_call>") if hermes else ("", ""),
                           param="tool_choice")


def _call(obj: object) -> dict[str, Any] | None:
    """An OpenAI tool_call from one parsed call object, or None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    text = args if isinstance(args, str) else json.dumps(args)
    return {"id": "call_" + secrets.token_hex(12), "type": "function", "function": {"name": obj["name"], "arguments": text}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content left once calls are taken out, or None if nothing is left; the calls)."""
    blocks = TOOL_CALL_BLOCK.findall(text)
    if blocks:
        calls = []
        for block in blocks:
            try:
                call = _call(json.loads(block))
            except json.JSONDecodeError:
                call = None
            if call is None:
                return text, []  # a malformed block: hand the text back as it is
            calls.append(call)
        rest = TOOL_CALL_BLOCK.sub("", text).strip()
        return rest or None, calls
    try:
        parsed = json.loads(text.strip())
    except json.JSONDecodeError:
        return text, []
    calls = [_call(o) for o in (parsed if isinstance(parsed, list) else [parsed])]
    if calls and all(c is not None for c in calls):
        return None, calls  # type: ignore[return-value]
    return text, []


class ToolChatShape(ChatShape):
    """chat.completion bodies whose text is read for tool calls; streamed, as OpenAI streams
    them (coordinator.gateway.tool_stream)."""

    streamer = ToolCallStream

    @staticmethod
    def whole_choice(index: int, text: str, fin: Any, logprobs: dict[str, Any] | None) -> dict[str, Any]:
        content, calls = parse_tool_calls(text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        finish = "tool_calls" if calls else fin.finish_reason
        return {"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs}
