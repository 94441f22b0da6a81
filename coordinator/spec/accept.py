"""Verification: which draft nodes the target accepts, and the bonus token after them.

Input rows follow the draft's layout: row 0 is the target at the root (the last
committed token), row i+1 the target at draft node i. Greedy acceptance reproduces
plain greedy decoding token for token; speculative sampling makes every committed token
exactly target-distributed, for chains and for multi-draft trees.

This module does not know how the target rows were computed, about temperature or
top-p (callers pass `sampling.probs(...)` rows), stop strings, or the ring.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from coordinator.spec.draft_tree import ChildSampling, DraftTree
from coordinator.errors import DraftShapeError


@dataclass(frozen=True)
class Acceptance:
    """One round's outcome: the accepted nodes root-to-leaf, the committed tokens
    (their tokens plus one bonus token), and how many draft nodes were tried (for
    acceptance statistics: a chain tries accepted + 1 unless fully accepted)."""

    nodes: tuple[int, ...]
    tokens: tuple[int, ...]
    tried: int

    @property
    def last_node(self) -> int:
        """The node whose target row gave the bonus token (-1 = root)."""
        return self.nodes[-1] if self.nodes else -1


def _check_rows(tree: DraftTree, rows: torch.Tensor, what: str) -> None:
    if rows.dim() != 2 or rows.shape[0] != tree.num_nodes + 1:
        raise DraftShapeError(what, f"({tree.num_nodes + 1}, V)", tuple(rows.shape))
    if tree.probs is not None and tree.probs.shape[1] != rows.shape[1]:
        raise DraftShapeError(f"{what} vocabulary", tree.probs.shape[1], rows.shape[1])


def accept_greedy(tree: DraftTree, target_logits: torch.Tensor) -> Acceptance:
    """Walk from the root: take the target's argmax at the current node; if a child
    carries that token, accept it and descend, else stop. The bonus is the argmax at
    the last accepted node, so the committed tokens are exactly what greedy decoding
    would emit (ties go to the lowest id, as in `sampling.greedy_token`)."""
    _check_rows(tree, target_logits, "target logits")
    best = torch.argmax(target_logits, dim=-1).tolist()  # (M+1,) one argmax per row
    return accept_greedy_lazy(tree, best.__getitem__)


def accept_greedy_lazy(tree: DraftTree, target_choice: Callable[[int], int]) -> Acceptance:
    """`accept_greedy` with the target's argmax asked for row by row (row 0 = the root,
    row i+1 = node i): only the rows of the accepted path and the bonus token's are
    asked for, so a caller can compute rows on demand."""
    toks = tree.tokens.tolist()
    node, nodes, tried = -1, [], 0
    while True:
        want = target_choice(node + 1)
        kids = tree.children(node)
        hit = next((r for r, k in enumerate(kids) if toks[k] == want), None)
        tried += len(kids) if hit is None else hit + 1
        if hit is None:
            break
        node = kids[hit]
        nodes.append(node)
    return Acceptance(tuple(nodes), tuple(toks[n] for n in nodes) + (target_choice(node + 1),), tried)


def accept_as_committed(tree: DraftTree, committed: Sequence[int]) -> Acceptance:
    """The outcome greedy acceptance of `tree` would have had in a round that committed
    `committed` (accepted tokens then the bonus): used to judge each drafter's part of a
    merged draft on its own nodes. At temperature 0 the target chose exactly these tokens
    along the accepted path, and a part's walk never leaves that path, so this equals
    `accept_greedy` on the part; with sampling it scores the part against the draws."""
    depths = tree.depths.tolist()
    return accept_greedy_lazy(tree, lambda row: committed[0 if row == 0 else depths[row - 1]])


class TargetChoices:
    """The target's token at verify rows, computed on demand by `choose(rows) -> tokens`
    (one per row): at first the root and the draft's first-child path in one batch (the
    rows acceptance walks when the draft is right; children come likeliest first), then
    any other row alone. A tree of M nodes then costs about its accepted length in
    LM-head rows instead of M + 1. Pass it to `accept_greedy_lazy`."""

    def __init__(self, tree: DraftTree, choose: Callable[[list[int]], Sequence[int]]) -> None:
        self._choose, self._chosen = choose, {}
        rows, node = [0], -1
        while kids := tree.children(node):
            node = kids[0]
            rows.append(node + 1)
        self._compute(rows)

    def _compute(self, rows: list[int]) -> None:
        self._chosen.update(zip(rows, self._choose(rows)))

    def __call__(self, row: int) -> int:
        if row not in self._chosen:
            self._compute([row])
        return self._chosen[row]


class GreedyRows(TargetChoices):
    """The target's argmax at verify rows, from `logits_of(rows) -> (len(rows), V)`."""

    def __init__(self, tree: DraftTree, logits_of: Callable[[list[int]], torch.Tensor]) -> None:
        super().__init__(tree, lambda rows: torch.argmax(logits_of(rows), dim=-1).tolist())


def row_positions(tree: DraftTree, root_slot: int) -> list[int]:
    """(M+1,) the sequence position each verify row decides: the root's row the token
    after the root (root_slot + 1), node i's row the token after node i."""
    return [root_slot + 1] + [root_slot + 1 + d for d in tree.depths.tolist()]


def row_paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """(M+1,) the draft tokens between the root and each verify row's position: none for
    the root's row, node i's path (its ancestors' tokens, then its own) for node i's."""
    toks, paths = tree.tokens.tolist(), [()]
    for node, parent in enumerate(tree.parents.tolist()):
        paths.append(paths[parent + 1] + (toks[node],))  # parents come first (topological order)
    return paths


# Sampled acceptance (what jobs use at temperature > 0) is `accept_greedy_lazy` with
# `TargetChoices` whose choice at a row is the token plain sampling would draw there:
# the row's target distribution inverted at the uniform of the position it decides
# (coordinator.spec.sampling.sample). Every committed token x_t = F_t^-1(u_t), with F_t
# the target CDF given the committed history and u_t a uniform that depends on the seed
# and t alone, so x_t ~ p_t exactly, and the text is the same whatever was drafted: a
# draft decides how many of these tokens a traversal commits, never which. For drafts
# picked deterministically (n-gram lookups, EAGLE's top-k: ChildSampling.GREEDY) the
# chance that a node's children {x1..xk} hold the draw is p(x1) + ... + p(xk), the same
# as recursive rejection sampling's (`accept_sampling`), so nothing is lost; for drafts
# sampled from q, rejection sampling would accept more (sum of min(p, q)) but its text
# would depend on the drafter.


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Speculative sampling over a chain or tree (recursive rejection sampling).

    `target_probs` (M+1, V) are the target distributions at the root and each node.
    At temperature 0 they are one-hot and this reduces to `accept_greedy`.
    """
    _check_rows(tree, target_probs, "target probs")
    toks = tree.tokens.tolist()
    greedy_picks = tree.sampling is ChildSampling.GREEDY
    node, nodes, tried = -1, [], 0
    while True:
        p = target_probs[node + 1].double()  # (V,) target at this node
        q = None if greedy_picks else tree.probs[node + 1].double()  # (V,) draft at this node
        accepted = None
        for child in tree.children(node):
            x = toks[child]
            tried += 1
            # 1) Child x was drawn from a proposal r: a point mass for GREEDY picks, q for
            #    IID draws, q minus the earlier siblings for draws without replacement.
            #    Accepting with prob min(1, p(x)/r(x)) and otherwise drawing from
            #    norm(max(0, p - r)) emits exactly p (Leviathan et al.; Chen et al.).
            px, rx = float(p[x]), 1.0 if greedy_picks else float(q[x])
            if not rx > 0:
                raise DraftShapeError(f"draft probability of node {child} (token {x})", "> 0", rx)
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * rx < px:
                accepted = child
                break
            # 2) Rejected: the remaining siblings must emit the residual, so it becomes the
            #    target. It depends on r but not on which x was drawn, so by induction over
            #    the siblings (the last fallback being a draw from the residual) the node
            #    emits p. For a point mass the residual is p with x removed.
            if greedy_picks:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = torch.clamp(p - q, min=0.0)
            total = float(residual.sum())
            if total > 0:  # total == 0 needs p == r on the support: rejection had prob 0
                p = residual / total
            # 3) Without replacement the next sibling was drawn from q with x removed,
            #    renormalised; x has no residual mass left either (rejected: p(x) <= r(x)).
            if tree.sampling is ChildSampling.WITHOUT_REPLACEMENT:
                q = q.clone()
                q[x] = 0.0
                mass = float(q.sum())
                if mass > 0:
                    q = q / mass
        if accepted is None:
            bonus = _draw(p, generator)
            return Acceptance(tuple(nodes), tuple(toks[n] for n in nodes) + (bonus,), tried)
        node = accepted
        nodes.append(node)


def _draw(p: torch.Tensor, generator: torch.Generator) -> int:
    """One index from a (V,) distribution by inverting its CDF: one uniform draw, and an
    entry with zero mass is never returned (its CDF step is empty)."""
    cdf = torch.cumsum(p, dim=0)  # (V,)
    u = float(torch.rand((), generator=generator, dtype=torch.float64)) * float(cdf[-1])
    index = int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype), right=True))
    if index >= p.shape[0]:  # u rounded up to the total: take the last entry with mass
        index = int(torch.nonzero(p).max())
    return index


def truncate_at_stop(tokens: Sequence[int], stop_ids: Collection[int]) -> tuple[list[int], bool]:
    """Committed tokens up to and including the first stop id (e.g. EOS), and whether
    one was found. A round may accept past EOS; everything after it must be dropped."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return list(tokens[: i + 1]), True
    return list(tokens), False
