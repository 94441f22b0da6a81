"""A ring job's rounds on the wire: the frames it sends and the rows it reads back.

A prefill chunk feeds committed tokens; a verify frame carries a root token and its draft
as one attention tree; either may carry the previous round's commit (which accepted
nodes' K/V move next to the root). A Result hands back the tail's hidden rows and, for
drafters that read the target's features, its aux rows; a round's result (Verified) hands
those aux rows to the drafters that read them. Pure but for the drafters it feeds: this
module does not know rings, streams, round numbering or receipts (the job numbers and
sends the frames).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coordinator.spec.draft_tree import DraftTree
from shard.activations import from_wire
from shard.wire.messages import Forward, Result


@dataclass(frozen=True)
class Verified:
    """A round's result from the tail, ready for acceptance."""

    tree: DraftTree  # the draft it verified, below the root
    rows: torch.Tensor  # (M+1, H) f32 hidden rows: the root, then each draft node
    traversal_s: float
    draft_s: float
    queued_behind: float  # rounds of this job it queued behind (adapt.queued_share)
    fed: list  # (first position, token ids, (T, k*H) aux rows) of prefill chunks it fed
    tree_aux: torch.Tensor | None  # (M+1, k*H) aux rows of its verify frame (EAGLE)
    pipelined: bool  # sent ahead, before the round it built on was verified


def chunk_frame(job_id: str, epoch: int, nonce: bytes, start: int, ids: Sequence[int], *, decode: bool,
                commit: tuple[Sequence[int], int], aux_layers: tuple[int, ...]) -> Forward:
    """Committed tokens `ids` at positions start.. (a prefill chunk, or one decode token
    when `decode`), carrying `commit` (slots to gather, first destination)."""
    src, dst = commit
    return Forward(
        job_id=job_id, epoch=epoch, round=0, nonce=nonce, phase="decode" if decode else "prefill", ctx_len=start,
        commit_src=tuple(src), commit_dst=dst, want_aux_layers=aux_layers,
        positions=torch.arange(start, start + len(ids)), tokens=torch.tensor(ids),
    )


def verify_frame(job_id: str, epoch: int, nonce: bytes, root: int, root_token: int, tree: DraftTree, *,
                 commit: tuple[Sequence[int], int] = ((), 0), aux_layers: tuple[int, ...] = ()) -> Forward:
    """The root (at slot `root`) plus the draft: frame parent -1 for the root (it sees
    the context), draft parent + 1 below it; siblings share a position."""
    src, dst = commit
    parents = torch.tensor([-1] + [p + 1 if p >= 0 else 0 for p in tree.parents.tolist()], dtype=torch.int32)  # (1+M,)
    return Forward(
        job_id=job_id, epoch=epoch, round=0, nonce=nonce, phase="verify",
        ctx_len=root, commit_src=tuple(src), commit_dst=dst, tree_parents=parents,
        want_aux_layers=aux_layers, positions=torch.cat([torch.tensor([root]), tree.positions(root)]),
        tokens=torch.tensor([root_token, *tree.tokens.tolist()]),
    )


def commit_move(root_slot: int, accepted_nodes: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """(slots to gather, first destination) that the next frame carries: the accepted
    nodes' K/V move next to the root (no extra round trip); a chain's accepted prefix is
    already in place, so nothing moves."""
    src = tuple(root_slot + 1 + n for n in accepted_nodes)
    in_place = src == tuple(range(root_slot + 1, root_slot + 1 + len(src)))
    return ((), 0) if in_place else (src, root_slot + 1)


def hidden_rows(result: Result, n: int) -> torch.Tensor:
    """The tail's last `n` hidden rows, (n, H) in f32; the output head makes them logits."""
    return from_wire(result.hidden, result.hidden_scale, torch.float32)[-n:]


def aux_rows(result: Result) -> torch.Tensor | None:
    """The target's features at the layers the drafters asked for, (T, k*H) in f32; None
    when the result carries none."""
    return None if result.aux is None else from_wire(result.aux, result.aux_scale, torch.float32)


def observe_round(drafters: Sequence, got: Verified, acc, committed: Sequence[int], root_slot: int) -> None:
    """Hand drafters that read the target's features (EAGLE) the aux rows of every token a
    round committed (`acc`, coordinator.spec.accept.Acceptance): its prefill chunks whole,
    then the root and the accepted path."""
    sinks = [d for d in drafters if getattr(d, "aux_layers", ())]
    if not sinks:
        return
    batches = list(got.fed)
    if got.tree_aux is not None:
        rows = [0] + [1 + n for n in acc.nodes]
        ids = [committed[root_slot]] + [int(got.tree.tokens[n]) for n in acc.nodes]
        batches.append((root_slot, ids, got.tree_aux[rows]))
    for start, ids, aux in batches:
        for d in sinks:
            # After a resume the ring re-prefills tokens a drafter already saw: skip those.
            skip = d.observed_tokens - start
            if skip < len(ids):
                d.observe(ids[max(skip, 0):], aux[max(skip, 0):])
