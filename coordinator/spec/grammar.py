"""Constrained decoding: the tokens a JSON schema allows next, from llguidance.

`response_format` json_object / json_schema compiles (llguidance, a maintained Rust
grammar engine with Python bindings; CPU only, driven by our tokenizer and our logits) to
a Constraint held in SamplingParams; each job starts its own GrammarState from it. A
verify row's allowed tokens are the state's after the row's draft path (consumed, then
rolled back), so the target distribution at every row is masked to the grammar and a
draft token the grammar forbids is never accepted: drafts are checked, not trusted, and
output stays exactly the masked target's. The state advances by what a round committed.
Drafts are pruned before they are sent (`DraftFilter`, applied by
coordinator.spec.drafting.GrammarPruned), so the ring spends no rows on tokens the
grammar forbids; output is the same either way, since acceptance never takes them.

It does not know about rounds, jobs or HTTP; the gateway builds Constraints.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from coordinator.errors import SamplingParamError

ANY_OBJECT_SCHEMA = {"type": "object"}  # response_format json_object



def _llguidance():
    """llguidance, imported on first use: its import is ~1.2 s of a gateway's start (and so
    of a restart's time to first token), and a gateway may never constrain a request."""
    import llguidance.hf  # noqa: F401 (binds the hf submodule on the package)
    import llguidance
    return llguidance

@dataclass(frozen=True)
class Constraint:
    """A compiled-and-checked grammar for one tokenizer; immutable, shared by choices."""

    grammar: str  # llguidance's grammar text (from the schema)
    schema: str  # canonical JSON text of the schema
    tokenizer: Any = field(compare=False, repr=False)  # llguidance.LLTokenizer

    def start(self) -> GrammarState:
        return GrammarState(_llguidance().LLMatcher(self.tokenizer, self.grammar))

    def draft_filter(self) -> DraftFilter:
        return DraftFilter(self)


_tokenizers: dict[int, Any] = {}  # id(hf tokenizer) -> LLTokenizer (built once; vocabularies are big)


def json_constraint(hf_tokenizer: Any, schema: dict[str, Any], *, wrap: tuple[str, str] = ("", ""),
                    param: str = "response_format") -> Constraint:
    """The Constraint for output matching `schema` (a JSON Schema), between the literal
    texts `wrap` (a tool-call format's tags), or SamplingParamError naming what llguidance
    refused in it (as `param`)."""
    lltok = _tokenizers.get(id(hf_tokenizer))
    if lltok is None:
        lltok = _tokenizers[id(hf_tokenizer)] = _llguidance().hf.from_tokenizer(hf_tokenizer)
    # Compact JSON: a flexible-whitespace grammar lets a weak model pad forever.
    compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
    text = json.dumps(compact, sort_keys=True, separators=(",", ":"))
    try:
        if wrap == ("", ""):
            grammar = _llguidance().LLMatcher.grammar_from_json_schema(text)
        else:
            grammar = _llguidance().LLMatcher.grammar_from_lark(
                f"start: {json.dumps(wrap[0])} body {json.dumps(wrap[1])}\nbody: %json {text}")
    except ValueError as exc:
        raise SamplingParamError(param, schema, f"is not a usable JSON schema: {exc}") from exc
    problem = _llguidance().LLMatcher.validate_grammar(grammar, lltok)
    if problem:
        raise SamplingParamError(param, schema, f"is not a usable JSON schema: {problem}")
    return Constraint(grammar, text, lltok)


class GrammarState:
    """One job's place in its grammar: the committed tokens consumed so far."""

    def __init__(self, matcher: Any) -> None:
        self._matcher = matcher

    def allowed(self, path: Sequence[int], vocab: int) -> torch.Tensor:
        """(vocab,) bool: the tokens the grammar allows after the committed ones and then
        `path` (a draft path). A path the grammar forbids allows nothing after its first
        forbidden token: acceptance never reaches such a row, since the row above it was
        masked so that the forbidden token could not be chosen."""
        m = self._matcher
        consumed = m.try_consume_tokens(list(path)) if path else 0
        try:
            if consumed < len(path):
                return torch.zeros(vocab, dtype=torch.bool)
            words = torch.frombuffer(bytearray(m.compute_bitmask()), dtype=torch.int32)  # (ceil(V'/32),)
        finally:
            if consumed:
                m.rollback(consumed)
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # (W, 32), bit i of word w = token 32w + i
        allowed = bits.flatten().bool()
        out = torch.zeros(vocab, dtype=torch.bool)  # ids past the tokenizer's (model padding) are never allowed
        n = min(vocab, allowed.shape[0])
        out[:n] = allowed[:n]
        return out

    def advance(self, tokens: Sequence[int]) -> None:
        """Consume committed tokens (those past a stop are never asked for again)."""
        self._matcher.try_consume_tokens(list(tokens))


class DraftFilter:
    """How much of a draft path the grammar allows, for a job's drafters: a matcher of its
    own (the job's GrammarState belongs to acceptance), kept at the generated tokens it was
    last asked about. A context that differs from that (a round drafted ahead assumes tokens
    that may not commit) rolls the matcher back to the common prefix, then consumes the rest;
    a context the grammar cannot consume allows no draft after it."""

    def __init__(self, constraint: Constraint) -> None:
        self._constraint = constraint
        self._matcher = _llguidance().LLMatcher(constraint.tokenizer, constraint.grammar)
        self._consumed: list[int] = []  # generated tokens the matcher has consumed
        self._blocked = False  # the last context went past what the grammar allows

    def sync(self, generated: Sequence[int]) -> None:
        """Put the matcher after `generated` (this completion's tokens, committed or assumed)."""
        done, common = self._consumed, 0
        limit = min(len(done), len(generated))
        while common < limit and done[common] == generated[common]:
            common += 1
        if common < len(done):
            self._matcher.rollback(len(done) - common)
            del done[common:]
        if self._matcher.is_error():  # never expected (rollbacks stay within what it consumed): start over
            self._matcher = _llguidance().LLMatcher(self._constraint.tokenizer, self._constraint.grammar)
            done.clear()
            common = 0
        rest = [int(t) for t in generated[common:]]
        consumed = self._matcher.try_consume_tokens(rest) if rest else 0
        done += rest[:consumed]
        self._blocked = consumed < len(rest)

    def allowed_prefix(self, path: Sequence[int]) -> int:
        """How many leading tokens of `path` the grammar allows after the synced context
        (validated without being consumed)."""
        return 0 if self._blocked or not path else self._matcher.validate_tokens([int(t) for t in path])


def start_grammar(constraint: Constraint | None) -> GrammarState | None:
    return None if constraint is None else constraint.start()
