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


def test_a_verify_row_below_a_forbidden_draft_token_is_answered_without_nans(tiny_tokenizer):
    # Bug guarded: TargetChoices computes the first-child path's rows eagerly, so a row below
    # a draft token the grammar forbids is sampled with every logit masked (softmax of all
    # -inf is NaN). Sound: such a row allows nothing; it must still give a token id, at any
    # temperature, and the walk above it never accepts the forbidden token.
    from coordinator.spec.draft_tree import DraftTree
    from coordinator.spec.sampling import SamplingParams
    from coordinator.spec.target import accept_round

    x, brace = ids(tiny_tokenizer, "x")[0], ids(tiny_tokenizer, "{")[0]
    tree = DraftTree.from_branches([[x, brace]], 8)  # a chain: "x" (forbidden), then "{"
    logits = torch.zeros(3, 260)
    logits[:, x] = 5.0  # the model would like "x" everywhere
    for temperature in (0.0, 1.0):
        acc, _ = accept_round(tree, lambda rows: logits[rows], SamplingParams(temperature=temperature), 7, 4, [],
                              json_constraint(tiny_tokenizer, SCHEMA).start())
        assert acc.nodes == () and acc.tokens == (brace,)
