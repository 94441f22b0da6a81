"""Tool calls read from a reply as it streams, sent as OpenAI's `tool_calls` deltas.

OpenAI streams a call as a first delta with its index, id, type and function name (and
empty arguments), then its arguments in fragments that concatenate to the JSON text; clients
(the `openai` library's stream helper, agent frameworks) accumulate them by index. The
model writes calls in the formats coordinator.gateway.tools parses whole: Hermes
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, or a bare JSON call (or a
list of them) as the whole reply. `ToolCallStream` re-reads the text so far on every chunk
(replies are bounded by max_tokens) and sends only what is settled: content up to any text
that could still open a `<tool_call>` tag, a call once its name string has closed, its
arguments as far as the model has written them (a JSON string of arguments once it closes).
What it sent is never taken back: a block that closes malformed after its name was sent
ends as streamed (the whole response parses it back as content instead). Content after
the first call is held and sent, stripped, at the end. Pure: text in, delta dicts out.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # OpenAI/Hermes, Llama 3.x
CALL_KEYS = ("name", *ARGUMENT_KEYS)


@dataclass
class PartialCall:
    """One call as far as its text goes."""

    name: str | None = None
    args: str | None = None  # the arguments' JSON text so far (whole once args_done)
    args_done: bool = False
    closed: bool = False  # the call's object has ended
    not_a_call: bool = False  # its first key, or its shape, says it is something else


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def scan_value(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i], or None if the text ends inside it.
    Assumes well-formed JSON; a malformed value ends wherever its brackets balance."""
    if i >= len(s):
        return None
    if s[i] == '"':
        j = i + 1
        while j < len(s):
            if s[j] == "\\":
                j += 2
                continue
            if s[j] == '"':
                return j + 1
            j += 1
        return None
    if s[i] in "{[":
        depth, j, in_str = 0, i, False
        while j < len(s):
            c = s[j]
            if in_str:
                if c == "\\":
                    j += 1
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # a number or a literal: ends at a delimiter, which must have arrived
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None


def parse_partial_call(s: str, i: int = 0) -> tuple[PartialCall, int | None]:
    """The call object starting at s[i] (after whitespace) as far as it goes, and where it
    ends (None while open)."""
    call = PartialCall()
    i = _skip_ws(s, i)
    if i >= len(s):
        return call, None
    if s[i] != "{":
        call.not_a_call = True
        return call, None
    i += 1
    first = True
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return call, None
        if s[i] == "}":
            call.closed = True
            if call.args is None and call.name is not None:
                call.args, call.args_done = "{}", True
            return call, i + 1
        if s[i] == ",":
            i = _skip_ws(s, i + 1)
        key_end = scan_value(s, i)
        if key_end is None or s[i] != '"':
            call.not_a_call = call.not_a_call or (i < len(s) and s[i] != '"')
            return call, None
        key = json.loads(s[i:key_end])
        if first and key not in CALL_KEYS:
            call.not_a_call = True
            return call, None
        first = False
        i = _skip_ws(s, key_end)
        if i >= len(s) or s[i] != ":":
            return call, None
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return call, None
        end = scan_value(s, i)
        if key == "name":
            if end is not None and s[i] == '"':
                call.name = json.loads(s[i:end])
        elif key in ARGUMENT_KEYS and call.args is None:
            if s[i] == '"':  # arguments written as a JSON string: sent once it closes, decoded
                call.args, call.args_done = (json.loads(s[i:end]), True) if end is not None else (None, False)
            else:
                call.args, call.args_done = s[i:end if end is not None else len(s)], end is not None
        if end is None:
            return call, None
        i = end


def _partial_prefix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _calls(text: str, mode: str) -> tuple[list[PartialCall], str]:
    """The calls in `text` so far and the content around them after the first (held)."""
    calls: list[PartialCall] = []
    if mode == "bare":
        i = _skip_ws(text, 0)
        if text[i] == "{":
            return [parse_partial_call(text, i)[0]], ""
        i += 1  # a list of calls
        while True:
            call, end = parse_partial_call(text, i)
            calls.append(call)
            if end is None:
                return calls, ""
            i = _skip_ws(text, end)
            if i >= len(text) or text[i] != ",":
                return calls, ""
            i += 1
    start, rest = text.find(OPEN), []
    while start >= 0:
        inner = start + len(OPEN)
        close = text.find(CLOSE, inner)
        call = parse_partial_call(text[: close if close >= 0 else len(text)], inner)[0]
        calls.append(call)
        if close < 0:
            break
        nxt = text.find(OPEN, close)
        rest.append(text[close + len(CLOSE): nxt if nxt >= 0 else len(text)])
        start = nxt
    return calls, "".join(rest)


class ToolCallStream:
    """One choice's reply fed chunk by chunk; each call returns the deltas now settled."""

    def __init__(self, new_id: Callable[[], str] = lambda: "call_" + secrets.token_hex(12)) -> None:
        self.text = ""
        self.mode: str | None = None  # "content", "hermes" (a tag opened), "bare" (the reply is JSON)
        self.sent_content = 0  # characters of text sent as content
        self.sent: list[tuple[str, int]] = []  # per call sent: (id, characters of its arguments sent)
        self.new_id = new_id

    @property
    def called(self) -> bool:
        return bool(self.sent)

    def feed(self, chunk: str) -> list[dict[str, Any]]:
        self.text += chunk
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas left once the reply is complete."""
        out = self._advance(final=True)
        if not self.sent:  # no call after all: the text is content, as the whole response has it
            out += self._content(len(self.text))
        elif self.mode == "hermes":
            _, rest = _calls(self.text, "hermes")
            if rest.strip():
                out.append({"content": rest.strip()})
        return out

    def _content(self, end: int) -> list[dict[str, Any]]:
        if end <= self.sent_content:
            return []
        piece, self.sent_content = self.text[self.sent_content:end], end
        return [{"content": piece}]

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.mode is None:
            head = self.text.lstrip()
            if not head:
                return out
            self.mode = "bare" if head[0] in "{[" else "content"
        if self.mode == "content":
            tag = self.text.find(OPEN, self.sent_content)
            if tag < 0:
                return self._content(len(self.text) - (0 if final else _partial_prefix(self.text, OPEN)))
            out += self._content(tag)
            self.mode = "hermes"
        calls, _ = _calls(self.text, self.mode)
        if self.mode == "bare" and not self.sent and any(c.not_a_call for c in calls):
            self.mode = "content"  # JSON, but not a call: content from the start
            return out + self._advance(final)
        for index, call in enumerate(calls):
            if call.name is None or call.not_a_call:
                break  # calls are sent in order: a later one waits for this one's name
            if index == len(self.sent):
                self.sent.append((self.new_id(), 0))
                out.append({"tool_calls": [{"index": index, "id": self.sent[index][0], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            call_id, done = self.sent[index]
            if call.args is not None and len(call.args) > done:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": call.args[done:]}}]})
                self.sent[index] = (call_id, len(call.args))
        return out
