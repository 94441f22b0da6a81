"""Draft chains and trees as data: tokens, parents, depths, positions, ancestor mask.

A draft of M nodes hangs below the *root*, the last committed token (whose target row
the ring computes in the same round). Nodes are stored in topological order
(`parents[i] < i`, -1 for a child of the root), so one forward pass over the nodes in
index order is causal. Siblings share a position: position = root_position + depth,
with depth 1 for the root's children. A chain is the tree whose parents are i-1.

The tree also records how each node's children were chosen (`ChildSampling`), because
speculative sampling needs the proposal distribution every child was drawn from.
`keep_likeliest` prunes a GREEDY tree to its likeliest nodes by draft log-prob; `merge`
unites several drafters' GREEDY trees into one (hybrid rounds verify them together).

This module does not know about models, logits of the target, the wire, or which
drafter made a tree beyond its `source` (`coordinator.spec.source`); it never touches
the network.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch

from coordinator.errors import DraftShapeError
from coordinator.spec.source import ALL_SOURCES, DraftSource


class ChildSampling(enum.Enum):
    """How a node's children were chosen; acceptance needs each child's proposal.

    GREEDY: deterministic picks (top-k, n-gram lookup); each child's proposal is a
        point mass on itself, so no draft distribution is needed.
    IID: children drawn independently from the parent's draft distribution q.
    WITHOUT_REPLACEMENT: child i drawn from q with children 0..i-1 zeroed, renormalised.
    """

    GREEDY = "greedy"
    IID = "iid"
    WITHOUT_REPLACEMENT = "without_replacement"


@dataclass(frozen=True, eq=False)
class DraftTree:
    """M draft nodes below the root. Row r of `probs` (and of the target rows the ring
    returns) is the root for r = 0 and node r-1 otherwise."""

    tokens: torch.Tensor  # (M,) int64 token ids
    parents: torch.Tensor  # (M,) int64; -1 = child of the root; parents[i] < i
    logprobs: torch.Tensor | None = None  # (M,) float: log q(token_i | path to its parent)
    probs: torch.Tensor | None = None  # (M+1, V) float: q at the root and at each node
    sampling: ChildSampling = ChildSampling.GREEDY
    source: DraftSource = field(default=ALL_SOURCES)  # which drafter and evidence, e.g. ngram:3
    merged_from: tuple["DraftTree", ...] = ()  # the drafts a merged tree unites, in merge order

    def __post_init__(self) -> None:
        if self.tokens.dim() != 1 or self.tokens.dtype != torch.int64:
            raise DraftShapeError("tokens", "(M,) int64", f"{tuple(self.tokens.shape)} {self.tokens.dtype}")
        m = self.tokens.shape[0]
        if self.parents.shape != (m,) or self.parents.dtype != torch.int64:
            raise DraftShapeError("parents", f"({m},) int64", f"{tuple(self.parents.shape)} {self.parents.dtype}")
        index = torch.arange(m)
        if m and not bool(((self.parents >= -1) & (self.parents < index)).all()):
            raise DraftShapeError("parents", "-1 <= parents[i] < i (topological order)", self.parents.tolist())
        if self.logprobs is not None and self.logprobs.shape != (m,):
            raise DraftShapeError("logprobs", f"({m},)", tuple(self.logprobs.shape))
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != m + 1):
            raise DraftShapeError("probs", f"({m + 1}, V)", tuple(self.probs.shape))
        if self.sampling is not ChildSampling.GREEDY and self.probs is None:
            raise DraftShapeError("probs", f"a (M+1, V) tensor for {self.sampling.value} children", None)

    # -- constructors ---------------------------------------------------------------

    @classmethod
    def empty(cls, source: DraftSource = ALL_SOURCES) -> DraftTree:
        """No draft: the round verifies the root alone and commits one token."""
        none = torch.zeros(0, dtype=torch.int64)
        return cls(tokens=none, parents=none.clone(), source=source)

    @classmethod
    def chain(
        cls,
        tokens: Sequence[int] | torch.Tensor,
        *,
        logprobs: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        sampling: ChildSampling = ChildSampling.GREEDY,
        source: DraftSource = ALL_SOURCES,
    ) -> DraftTree:
        """A chain of K tokens: node i's parent is i-1."""
        t = torch.as_tensor(tokens, dtype=torch.int64).reshape(-1)
        parents = torch.arange(t.shape[0], dtype=torch.int64) - 1
        return cls(t, parents, logprobs=logprobs, probs=probs, sampling=sampling, source=source)

    @classmethod
    def from_branches(cls, branches: Sequence[Sequence[int]], max_nodes: int,
                      source: DraftSource = ALL_SOURCES) -> DraftTree:
        """Merge token sequences into a trie (shared prefixes become one node), earlier
        branches first, stopping at `max_nodes`. Siblings keep first-seen order, so the
        first branch is tried first. Children are GREEDY picks."""
        tokens: list[int] = []
        parents: list[int] = []
        child_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for branch in branches:
            node = -1
            for tok in branch:
                nxt = child_of.get((node, tok))
                if nxt is None:
                    if len(tokens) >= max_nodes:
                        break
                    nxt = len(tokens)
                    tokens.append(int(tok))
                    parents.append(node)
                    child_of[(node, tok)] = nxt
                node = nxt
        return cls(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64), source=source)

    @classmethod
    def merge(cls, trees: Sequence[DraftTree], source: DraftSource) -> tuple[DraftTree, list[list[int]]]:
        """One tree holding every path of `trees` (GREEDY ones): nodes with the same
        token under the same parent become one, and an earlier tree's children are tried
        before a later one's. Returns it with, per input tree, the merged index of each of
        its nodes. The merged tree keeps no log-probs (its nodes come from different
        drafters); `merged_from` keeps the inputs, so each can be judged on its own."""
        tokens: list[int] = []
        parents: list[int] = []
        child_of: dict[tuple[int, int], int] = {}  # (merged parent, token) -> merged node
        where: list[list[int]] = []
        for tree in trees:
            if tree.sampling is not ChildSampling.GREEDY:
                raise DraftShapeError("sampling", "GREEDY children to merge", tree.sampling.value)
            mine: list[int] = []
            for tok, p in zip(tree.tokens.tolist(), tree._parent_list):  # parents precede children
                key = (mine[p] if p >= 0 else -1, tok)
                if key not in child_of:
                    child_of[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(key[0])
                mine.append(child_of[key])
            where.append(mine)
        merged = cls(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
                     source=source, merged_from=tuple(trees))
        return merged, where

    # -- structure ------------------------------------------------------------------

    @property
    def num_nodes(self) -> int:
        return int(self.tokens.shape[0])

    @cached_property
    def _parent_list(self) -> list[int]:
        return self.parents.tolist()

    @cached_property
    def _children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]  # slot 0 = root
        for i, p in enumerate(self._parent_list):
            kids[p + 1].append(i)
        return tuple(tuple(k) for k in kids)

    def children(self, node: int) -> tuple[int, ...]:
        """Children of `node` (-1 = root) in the order they were proposed."""
        return self._children[node + 1]

    @cached_property
    def depths(self) -> torch.Tensor:
        """(M,) int64: 1 for the root's children, parent's depth + 1 below."""
        d: list[int] = []
        for p in self._parent_list:
            d.append(1 if p < 0 else d[p] + 1)
        return torch.tensor(d, dtype=torch.int64)

    @property
    def is_chain(self) -> bool:
        """Each node's parent is the node before it (the root's child first)."""
        return self._parent_list == list(range(-1, self.num_nodes - 1))

    @property
    def max_depth(self) -> int:
        return int(self.depths.max()) if self.num_nodes else 0

    def sibling_ranks(self) -> list[int]:
        """Each node's index among its siblings (0 = tried first)."""
        ranks = [0] * self.num_nodes
        for kids in self._children:
            for r, k in enumerate(kids):
                ranks[k] = r
        return ranks

    def positions(self, root_position: int) -> torch.Tensor:
        """(M,) int64 sequence positions: siblings share root_position + depth."""
        return self.depths + root_position

    def ancestor_mask(self, include_root: bool = False) -> torch.Tensor:
        """(M, M) bool, [i, j] True iff j is i or an ancestor of i (what node i may
        attend to inside the draft). With include_root, (M+1, M+1) with the root first:
        every node also sees the root, and the root sees only itself."""
        m = self.num_nodes
        mask = torch.eye(m + 1, dtype=torch.bool)  # row/col 0 = root
        for i, p in enumerate(self._parent_list):
            mask[i + 1] |= mask[p + 1]  # parent's row already holds its ancestors (p < i)
        return mask if include_root else mask[1:, 1:]

    def path(self, node: int) -> list[int]:
        """Node indices from the root's child down to `node` inclusive ([] for -1)."""
        out: list[int] = []
        while node >= 0:
            out.append(node)
            node = self._parent_list[node]
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        toks = self.tokens.tolist()
        return [toks[i] for i in self.path(node)]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path as node indices, leaves in index order."""
        return [self.path(i) for i in range(self.num_nodes) if not self.children(i)]

    def cumulative_logprobs(self) -> torch.Tensor:
        """(M,) sum of draft log-probs along each node's path (needs `logprobs`)."""
        if self.logprobs is None:
            raise DraftShapeError("logprobs", "a (M,) tensor", None)
        out = self.logprobs.clone().double()
        for i, p in enumerate(self._parent_list):
            if p >= 0:
                out[i] += out[p]
        return out

    def keep_likeliest(self, m: int) -> DraftTree:
        """The m nodes with the highest cumulative draft log-prob (needs `logprobs`), in
        their original order. A child never beats its parent (log-probs <= 0; a tie goes
        to the lower index, the parent), so the kept nodes form a tree. GREEDY trees only:
        dropping sampled siblings could keep a later draw without an earlier one, which
        speculative sampling cannot verify exactly."""
        if self.sampling is not ChildSampling.GREEDY:
            raise DraftShapeError("sampling", "GREEDY children to prune", self.sampling.value)
        if m >= self.num_nodes:
            return self
        cum = self.cumulative_logprobs().tolist()
        keep = sorted(sorted(range(self.num_nodes), key=lambda i: (-cum[i], i))[:m])
        index = {old: new for new, old in enumerate(keep)}
        parents = self._parent_list
        return DraftTree(self.tokens[keep], torch.tensor([index[parents[i]] if parents[i] >= 0 else -1 for i in keep],
                                                         dtype=torch.int64),
                         logprobs=self.logprobs[keep], source=self.source)

