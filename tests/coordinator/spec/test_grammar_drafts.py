"""Drafts pruned to a request's grammar (coordinator.spec.grammar.DraftFilter,
coordinator.spec.drafting.prune / GrammarPruned)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from coordinator.spec.draft_tree import ChildSampling, DraftTree
from coordinator.spec.drafting import DraftBudget, GrammarPruned, NgramDrafter, grammar_pruned, prune
from coordinator.spec.grammar import json_constraint

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@st.composite
def trees(draw):
    m = draw(st.integers(1, 12))
    parents = [draw(st.integers(-1, i - 1)) for i in range(m)]
    tokens = draw(st.lists(st.integers(0, 9), min_size=m, max_size=m))
    return DraftTree(torch.tensor(tokens), torch.tensor(parents), logprobs=-torch.rand(m),
                     probs=torch.rand(m + 1, 10), sampling=ChildSampling.IID)


@given(trees(), st.sets(st.integers(0, 9)))
def test_prune_keeps_exactly_the_nodes_whose_path_is_allowed(tree, banned):
    # Bug guarded: a forbidden node kept (the ring verifies it for nothing), an allowed one
    # dropped (fewer tokens per traversal), a subtree kept under a dropped parent, or rows
    # of probs/log-probs shifted against their nodes. Sound: the rule "allowed while no
    # token on the path is banned" is checked per node against the pruned tree's own paths.
    def allowed_prefix(path):
        return next((i for i, t in enumerate(path) if t in banned), len(path))

    out = prune(tree, allowed_prefix)
    want = [i for i in range(tree.num_nodes) if not set(tree.path_tokens(i)) & banned]
    assert [out.path_tokens(j) for j in range(out.num_nodes)] == [tree.path_tokens(i) for i in want]
    assert out.logprobs.tolist() == tree.logprobs[want].tolist()
    assert out.probs.equal(tree.probs[[0] + [1 + i for i in want]]) and out.sampling is tree.sampling


def test_filter_follows_the_context_back_and_forth(tiny_tokenizer):
    # Bug guarded: a filter stuck on an assumed context after a round drafted ahead was
    # discarded (it would prune by tokens that never committed), or one that lets drafts
    # through after a context the grammar cannot take. Sound: after '{"ok":' only t/f may
    # follow; rolled back to '{' a quote may; after a forbidden context nothing may.
    f = json_constraint(tiny_tokenizer, SCHEMA).draft_filter()
    f.sync(ids(tiny_tokenizer, '{"ok":'))
    assert f.allowed_prefix(ids(tiny_tokenizer, "true}")) == len(ids(tiny_tokenizer, "true}"))
    assert f.allowed_prefix(ids(tiny_tokenizer, '"x')) == 0
    f.sync(ids(tiny_tokenizer, "{"))
    assert f.allowed_prefix(ids(tiny_tokenizer, '"ok":t')) == len(ids(tiny_tokenizer, '"ok":t'))
    f.sync(ids(tiny_tokenizer, "{x"))
    assert f.allowed_prefix(ids(tiny_tokenizer, '"')) == 0
    f.sync(ids(tiny_tokenizer, '{"o'))
    assert f.allowed_prefix(ids(tiny_tokenizer, 'k":false}')) == len(ids(tiny_tokenizer, 'k":false}'))


def test_a_pruned_ngram_drafter_proposes_only_what_the_grammar_allows(tiny_tokenizer):
    # The n-gram drafter copies what followed an earlier occurrence: here a spaced JSON
    # text the compact grammar forbids after its first tokens. Pruned, the draft stops
    # where the grammar does; the drafter's own attributes are still there.
    prompt = ids(tiny_tokenizer, 'say {"ok": true} ')
    constraint = json_constraint(tiny_tokenizer, SCHEMA)
    [drafter] = grammar_pruned([NgramDrafter()], constraint, len(prompt))
    assert isinstance(drafter, GrammarPruned) and drafter.name == "ngram"
    context = prompt + ids(tiny_tokenizer, '{"ok":')
    raw = drafter.inner.propose(context, DraftBudget.chain(6))
    pruned = drafter.propose(context, DraftBudget.chain(6))
    assert raw.tokens.tolist()[:1] == ids(tiny_tokenizer, " ") and pruned.num_nodes == 0  # '{"ok": ' has a space
    assert grammar_pruned([drafter.inner], None, 0) == [drafter.inner]


def test_a_filter_whose_matcher_broke_starts_over(tiny_tokenizer):
    # Bug guarded: a matcher left in llguidance's error state (a rollback past what it holds)
    # answering 0 for every path from then on, silently ending all drafting for the job.
    # Sound: the error state is made the one way llguidance has (rolling back too far); the
    # next sync must answer as a fresh filter does.
    f = json_constraint(tiny_tokenizer, SCHEMA).draft_filter()
    f.sync(ids(tiny_tokenizer, '{"ok":'))
    f._matcher.rollback(100)  # more than the 5 tokens it consumed: llguidance's error state
    f.sync(ids(tiny_tokenizer, '{"ok":'))
    assert f.allowed_prefix(ids(tiny_tokenizer, "true}")) == len(ids(tiny_tokenizer, "true}"))
