"""Verification: which draft nodes the target accepts, and the bonus token after them.

Input rows follow the draft's layout: row 0 is the target at the root (the last
committed token), row i+1 the target at draft node i. Greedy acceptance reproduces
plain greedy decoding token for token; speculative sampling makes every committed token
exactly target-distributed, for chains and for multi-draft trees.

This module does not know how the target rows were computed, about temperature or
top-p (callers pass `sampling.probs(...)` rows), stop strings, or the ring.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from coordinator.draft_tree import ChildSampling, DraftShapeError, DraftTree


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
    toks = tree.tokens.tolist()
    node, nodes, tried = -1, [], 0
    while True:
        want = best[node + 1]
        kids = tree.children(node)
        hit = next((r for r, k in enumerate(kids) if toks[k] == want), None)
        tried += len(kids) if hit is None else hit + 1
        if hit is None:
            break
        node = kids[hit]
        nodes.append(node)
    return Acceptance(tuple(nodes), tuple(toks[n] for n in nodes) + (best[node + 1],), tried)


def accept_sampling(tree: DraftTree, target_probs: torch.Tensor, generator: torch.Generator) -> Acceptance:
    """Speculative sampling over a chain or tree (recursive rejection sampling).

    `target_probs` (M+1, V) are the target distributions at the root and each node.
    At temperature 0 they are one-hot and this reduces to `accept_greedy`.
    """
    _check_rows(tree, target_probs, "target probs")
    toks = tree.tokens.tolist()
    node, nodes, tried = -1, [], 0
    while True:
        p = target_probs[node + 1].double()  # (V,) target at this node
        q = tree.probs[node + 1].double() if tree.probs is not None else None  # (V,) draft here
        accepted = None
        for child in tree.children(node):
            x = toks[child]
            tried += 1
            # 1) Child x was drawn from proposal r (a point mass for GREEDY picks, q for
            #    IID draws, q minus earlier siblings for draws without replacement).
            #    Accepting with prob min(1, p(x)/r(x)) and otherwise drawing from
            #    norm(max(0, p - r)) yields exactly p (Leviathan et al. / Chen et al.).
            r = _proposal(tree.sampling, q, x, p.shape[0])
            if not r[x] > 0:
                raise DraftShapeError(f"draft probability of node {child} (token {x})", "> 0", float(r[x]))
            if float(torch.rand((), generator=generator, dtype=torch.float64)) * r[x] < p[x]:
                accepted = child
                break
            # 2) Rejected: the next sibling must reproduce the residual, so it becomes the
            #    target. The residual depends on r but not on x, so by induction over the
            #    siblings each step emits the current target and the whole node emits p.
            residual = torch.clamp(p - r, min=0.0)
            total = residual.sum()
            if total > 0:  # total == 0 needs p == r on the support: rejection had prob 0
                p = residual / total
            # 3) Without replacement, the next child was drawn from q with x removed; x
            #    also has zero residual mass now (it was rejected, so p(x) <= r(x)).
            if tree.sampling is ChildSampling.WITHOUT_REPLACEMENT:
                q = q.clone()
                q[x] = 0.0
                q = q / q.sum() if q.sum() > 0 else q
        if accepted is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Acceptance(tuple(nodes), tuple(toks[n] for n in nodes) + (bonus,), tried)
        node = accepted
        nodes.append(node)


def _proposal(sampling: ChildSampling, q: torch.Tensor | None, token: int, vocab: int) -> torch.Tensor:
    if sampling is ChildSampling.GREEDY:
        point = torch.zeros(vocab, dtype=torch.float64)
        point[token] = 1.0
        return point
    return q


def truncate_at_stop(tokens: Sequence[int], stop_ids: Collection[int]) -> tuple[list[int], bool]:
    """Committed tokens up to and including the first stop id (e.g. EOS), and whether
    one was found. A round may accept past EOS; everything after it must be dropped."""
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return list(tokens[: i + 1]), True
    return list(tokens), False
