"""coordinator.spec.grammar: the JSON-schema mask over our own tokenizer, on paths."""

from __future__ import annotations

import pytest
import torch

from coordinator.errors import SamplingParamError
from coordinator.spec.grammar import json_constraint

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_allowed_after_a_path_is_the_grammars_next_tokens_and_the_state_is_unchanged(tiny_tokenizer):
    # Bug guarded: a verify row masked by the committed state instead of its own draft
    # path, or a path consumed for good (the next row sees it twice). Sound: the grammar
    # {"ok":true|false} allows exactly '{' first, then '"', and after '{"ok":' only 't'
    # or 'f'; asking after a path leaves the committed state where it was.
    state = json_constraint(tiny_tokenizer, SCHEMA).start()
    vocab = 260  # the tiny model pads its vocabulary past the tokenizer's
    first = state.allowed((), vocab)
    assert first.nonzero().flatten().tolist() == ids(tiny_tokenizer, "{")
    after = state.allowed(tuple(ids(tiny_tokenizer, '{"ok":')), vocab)
    assert sorted(after.nonzero().flatten().tolist()) == sorted(ids(tiny_tokenizer, "t") + ids(tiny_tokenizer, "f"))
    assert state.allowed((), vocab).equal(first)
    assert not state.allowed(tuple(ids(tiny_tokenizer, "x")), vocab).any()  # a forbidden path allows nothing
    state.advance(ids(tiny_tokenizer, '{"ok":true}'))
    assert state.allowed((), vocab).nonzero().flatten().tolist() == [tiny_tokenizer.eos_token_id]
    assert not first[259:].any()


def test_a_bad_schema_is_refused_by_name(tiny_tokenizer):
    with pytest.raises(SamplingParamError) as info:
        json_constraint(tiny_tokenizer, {"type": "frob"})
    assert info.value.param == "response_format" and "frob" in info.value.reason
