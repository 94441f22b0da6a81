"""The target's token at each verify row of a round, and the logprobs it reports.

One rule for every row, whatever drafted the round: the row's logits, the request's
penalties for the tokens before it (its own draft path included), then the argmax or the
seeded draw at the row's position (coordinator.spec.sampling.sample); a draft child is
accepted iff it carries that token (coordinator.spec.accept). The logprobs reported for a
committed token come from the same LM-head row that chose it: the model's own
log-softmax, before penalties, temperature and top-k/top-p (vLLM's default, "raw").

Pure: the caller passes `logits_of(rows) -> (len(rows), V)`; no trio, no ring.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from coordinator.spec.accept import Acceptance, TargetChoices, accept_greedy_lazy, row_paths, row_positions
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.grammar import GrammarState
from coordinator.spec.sampling import SamplingParams, sample


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the `top` most likely tokens at its position."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


def token_logprob(logits: torch.Tensor, token: int, top_n: int) -> TokenLogprob:
    """`token`'s entry from a (V,) logits row, with the row's `top_n` best (ties to the lower id)."""
    logp = torch.log_softmax(logits.double(), dim=-1)  # (V,)
    order = torch.sort(logp, descending=True, stable=True).indices[:top_n].tolist()
    return TokenLogprob(token, float(logp[token]), tuple((t, float(logp[t])) for t in order))


def accept_round(tree: DraftTree, logits_of: Callable[[list[int]], torch.Tensor], params: SamplingParams, seed: int,
                 root_slot: int, generated: Sequence[int],
                 grammar: GrammarState | None = None) -> tuple[Acceptance, list[TokenLogprob]]:
    """Accept a verified round whose root sits at `root_slot`, after `generated` (this
    completion's committed tokens): the Acceptance and, when the request asked for
    logprobs, one TokenLogprob per committed token (the root's row, then each accepted
    node's). LM-head rows are computed only along the walk (TargetChoices). `grammar`
    (the job's, at `generated`) masks each row after its path and advances by the commit."""
    positions = row_positions(tree, root_slot)
    paths = row_paths(tree) if params.rules.history_matters or grammar else [()] * (tree.num_nodes + 1)
    before = tuple(generated)
    reported: dict[int, TokenLogprob] = {}

    def choose(rows: list[int]) -> list[int]:
        out = []
        for r, logits in zip(rows, logits_of(rows)):
            allowed = grammar.allowed(paths[r], logits.shape[-1]) if grammar is not None else None
            token = sample(logits, params, seed, positions[r], before + paths[r], allowed)
            if params.logprobs is not None:
                reported[r] = token_logprob(logits, token, params.logprobs)
            out.append(token)
        return out

    acc = accept_greedy_lazy(tree, TargetChoices(tree, choose))
    if grammar is not None:
        grammar.advance(acc.tokens)
    if params.logprobs is None:
        return acc, []
    return acc, [reported[r] for r in [0] + [1 + n for n in acc.nodes]]
