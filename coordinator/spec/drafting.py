"""Drafters: what proposes the next round's draft, and the n-gram / prompt-lookup drafter.

A drafter is per request and stateful: it sees the committed context (prompt plus
output) grow and answers `propose(context_ids, budget) -> DraftTree`. The n-gram drafter
finds the longest suffix of the context (n = max_n down to min_n) that occurred earlier
and proposes what followed it; several earlier occurrences become branches of a tree.
Its index is updated incrementally as tokens commit, so a call costs
O(max_n + branches * depth), not O(context).

`GrammarPruned` wraps a drafter so that its drafts keep only what a request's grammar
allows (response_format, forced tool calls).

This module does not know about the target model, logits, acceptance or the ring; model
drafters (EAGLE) live elsewhere.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.source import DraftSource


@dataclass(frozen=True)
class DraftBudget:
    """The most a drafter may propose this round: nodes in total and tree depth, and
    for drafters with calibrated log-probs (EAGLE) the least cumulative log-prob a node
    may have (nodes below it would not pay for their ring time). A chain of K is
    DraftBudget(K, K)."""

    max_nodes: int
    max_depth: int
    min_logprob: float = float("-inf")

    def __post_init__(self) -> None:
        if self.max_nodes < 0 or self.max_depth < 0:
            raise ValueError(f"DraftBudget needs max_nodes, max_depth >= 0, got {self.max_nodes}, {self.max_depth}")

    @classmethod
    def chain(cls, k: int) -> DraftBudget:
        return cls(k, k)


class Drafter(Protocol):
    """Proposes a draft below the last token of `context_ids` within `budget`. `name` is
    the family of its drafts' `DraftTree.source` (`DraftSource.family`): the planner
    sizes each drafter's next draft by that family's acceptance."""

    name: str

    def propose(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree: ...


@dataclass(frozen=True)
class NgramConfig:
    """Prompt-lookup settings. max_branches earlier occurrences become tree branches;
    each n-gram remembers only its latest positions_per_ngram occurrences, which bounds
    memory and lookup time on repetitive text."""

    max_n: int = 4
    min_n: int = 1
    max_branches: int = 4
    positions_per_ngram: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"NgramConfig needs 1 <= min_n <= max_n, got {self.min_n}, {self.max_n}")
        if self.max_branches < 1 or self.positions_per_ngram < 1:
            raise ValueError("NgramConfig needs max_branches >= 1 and positions_per_ngram >= 1")


class NgramDrafter:
    """Prompt-lookup drafter over one request's committed context.

    `propose` indexes whatever `context_ids` adds beyond what it has seen; a context
    that does not extend the seen one (a new request) rebuilds the index.
    """

    name = "ngram"

    def __init__(self, config: NgramConfig = NgramConfig()) -> None:
        self.config = config
        self._context: list[int] = []
        # n-gram -> start positions of what followed it, oldest first.
        self._index: dict[tuple[int, ...], deque[int]] = {}

    def reset(self) -> None:
        self._context.clear()
        self._index.clear()

    def extend(self, tokens: Sequence[int]) -> None:
        """Index newly committed tokens: O(len(tokens) * max_n)."""
        ctx = self._context
        for tok in tokens:
            ctx.append(int(tok))
            end = len(ctx)
            for n in range(self.config.min_n, min(self.config.max_n, end) + 1):
                key = tuple(ctx[end - n : end])
                slot = self._index.get(key)
                if slot is None:
                    slot = self._index[key] = deque(maxlen=self.config.positions_per_ngram)
                slot.append(end)

    def _sync(self, context_ids: Sequence[int]) -> None:
        seen = len(self._context)
        # O(1) check that the context extends the seen one; anything else is a new request.
        if len(context_ids) < seen or (seen and context_ids[seen - 1] != self._context[-1]):
            self.reset()
            seen = 0
        self.extend(context_ids[seen:])

    def propose(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree:
        self._sync(context_ids)
        ctx, end = self._context, len(self._context)
        branches: list[list[int]] = []
        match_n = 0
        for n in range(min(self.config.max_n, end), self.config.min_n - 1, -1):
            slot = self._index.get(tuple(ctx[end - n :]))
            if slot is None:
                continue
            for start in reversed(slot):  # most recent occurrence first
                if start >= end:  # the suffix itself: nothing follows it yet
                    continue
                branch = _continuation(ctx, start, budget.max_depth)
                if branch not in branches:
                    branches.append(branch)
                    match_n = max(match_n, n)
                if len(branches) >= self.config.max_branches:
                    break
            if len(branches) >= self.config.max_branches:
                break
        if not branches or budget.max_nodes == 0 or budget.max_depth == 0:
            return DraftTree.empty(source=DraftSource(self.name, "0"))
        # The evidence is the match length: long matches are accepted far more often.
        return DraftTree.from_branches(branches, budget.max_nodes, source=DraftSource(self.name, str(match_n)))


def _continuation(ctx: list[int], start: int, depth: int) -> list[int]:
    """What followed an occurrence at `start`, `depth` tokens long. A match close to the
    end runs out of context; the text is then periodic with period end - start, so the
    continuation repeats itself."""
    period = len(ctx) - start
    out: list[int] = []
    for j in range(depth):
        out.append(ctx[start + j] if start + j < len(ctx) else out[j - period])
    return out


def prune(tree: DraftTree, allowed_prefix: Callable[[list[int]], int]) -> DraftTree:
    """`tree` without the nodes whose token is not allowed after their path, and their
    subtrees. `allowed_prefix(tokens)`: how many leading tokens of a root-to-leaf path are
    allowed. Kept nodes keep their order, tokens, log-probs and probability rows."""
    keep = [False] * tree.num_nodes
    for leaf_path in tree.paths():
        n = allowed_prefix([int(tree.tokens[i]) for i in leaf_path])
        for i in leaf_path[:n]:
            keep[i] = True
    if all(keep):
        return tree
    kept = [i for i in range(tree.num_nodes) if keep[i]]
    index = {old: new for new, old in enumerate(kept)}
    parents = tree.parents.tolist()
    rows = torch.tensor([0] + [1 + i for i in kept], dtype=torch.int64)  # probs: the root's row, then each kept node's
    return DraftTree(tree.tokens[kept], torch.tensor([index.get(parents[i], -1) for i in kept], dtype=torch.int64),
                     logprobs=None if tree.logprobs is None else tree.logprobs[kept],
                     probs=None if tree.probs is None else tree.probs[rows], sampling=tree.sampling,
                     source=tree.source, merged_from=tree.merged_from)


class GrammarPruned:
    """A drafter whose drafts keep only the nodes the request's grammar allows after the
    context it is asked about (`draft_filter`: coordinator.spec.grammar.DraftFilter; `prompt_len`:
    where the completion starts in that context). The ring then never verifies a token the
    target's grammar mask would refuse; the output is the same, the rows fewer. Everything
    else (name, aux_layers, observe...) is the wrapped drafter's."""

    def __init__(self, inner: Drafter, draft_filter: Any, prompt_len: int) -> None:
        self.inner, self._filter, self._prompt_len = inner, draft_filter, prompt_len

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def propose(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree:
        tree = self.inner.propose(context_ids, budget)
        if not tree.num_nodes:
            return tree
        self._filter.sync(context_ids[self._prompt_len:])
        return prune(tree, self._filter.allowed_prefix)


def grammar_pruned(drafters: list[Drafter], constraint: Any, prompt_len: int) -> list[Drafter]:
    """`drafters` pruned to `constraint`'s grammar (one DraftFilter for all), or as they
    are when the request has none."""
    if constraint is None or not drafters:
        return drafters
    shared = constraint.draft_filter()
    return [GrammarPruned(d, shared, prompt_len) for d in drafters]
