"""Pipelined speculation's decisions: which rounds to send ahead, and when they are void.

While a drafted chain is in the ring, a job may send further rounds before it is verified,
each built on the assumption that every round before it is accepted whole with the bonus
token its drafter guesses. These pure functions decide how many rounds may be in flight,
the next round to send (its root slot, root token and chain), whether a round in flight
still matches what was committed, and which rounds a new one queues behind. The job
(coordinator.jobs.ring_job) sends what they decide; a round that turns out void is
ignored, and the next frame overwrites its K/V slots, so a wrong guess costs ring time,
never tokens. This module does not know the ring, frames, the wire or the clock: times
are passed in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from coordinator.spec import adapt
from coordinator.spec.draft_round import draft_ahead
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import Drafter


@dataclass(frozen=True)
class Ahead:
    """A round sent before the one it builds on was verified (pipelined speculation)."""

    round: int
    epoch: int
    tree: DraftTree  # its draft chain, below `root`
    root: int  # slot (= position) of its root token
    root_token: int  # the bonus token it assumed the previous round would commit
    sent_s: float
    draft_s: float
    queued_behind: float  # rounds of this job in flight ahead of it when sent (adapt.queued_share)


@dataclass(frozen=True)
class Planned:
    """The next round to send ahead: its chain below root token `root_token` at slot `root`."""

    root: int
    root_token: int
    tree: DraftTree


def ahead_drafter(drafters: Sequence[Drafter]) -> Drafter | None:
    """The drafter that guesses rounds ahead: only one that needs no target features
    (n-gram) can draft past a round whose features have not come back."""
    return next((d for d in drafters if not getattr(d, "aux_layers", ())), None)


def pipeline_depth(base: DraftTree, state: adapt.AdaptState, max_depth: int) -> int:
    """Most rounds in flight while `base` is awaited, itself included (1: none ahead).
    Only a drafted chain is extended: a tree's accepted path is not known in advance, so
    no bonus token can be guessed after it. Below `max_depth`, the planner's depth for the
    chain's evidence: acceptance and the measured queue a round in flight makes."""
    if max_depth < 2 or not base.num_nodes or not base.is_chain:
        return 1
    config = adapt.AdaptConfig(max_pipeline_depth=max_depth)
    return min(max_depth, adapt.plan(state, config, source=base.source).pipeline_depth)


def assumed_context(committed: Sequence[int], base: DraftTree, base_root: int,
                    ahead: Iterable[Ahead]) -> tuple[list[int], int]:
    """(the context the next round sent ahead assumes, the slot of its root): the committed
    tokens, the awaited chain `base` (root at slot `base_root`), then each round in flight
    after it (its assumed root token and its chain), all as if accepted whole."""
    assumed = [*committed, *base.tokens.tolist()]
    root = base_root + 1 + base.num_nodes
    for a in ahead:
        assumed += [a.root_token, *a.tree.tokens.tolist()]
        root = a.root + 1 + a.tree.num_nodes
    return assumed, root


def next_ahead(drafter: Drafter, committed: Sequence[int], base: DraftTree, base_root: int,
               ahead: Sequence[Ahead], state: adapt.AdaptState, *, depth: int, limit: int) -> Planned | None:
    """The next round to send while `base` is awaited and `ahead` are in flight after it,
    or None: the pipeline holds `depth` rounds already, or the drafter guesses nothing
    worth sending (coordinator.spec.draft_round.draft_ahead sizes the chain on its own
    evidence). `limit`: the context length no round may draft past."""
    if 1 + len(ahead) >= depth:
        return None
    assumed, root = assumed_context(committed, base, base_root, ahead)
    # Room below the guessed root: the context left after the assumed tokens, less the
    # root itself and the bonus token its verification commits.
    guess = draft_ahead(drafter, assumed, state, room=limit - len(assumed) - 2, max_pipeline_depth=depth)
    if guess is None:
        return None
    root_token, tree = guess
    return Planned(root, root_token, tree)


def still_valid(ahead: Ahead, *, epoch: int, committed: Sequence[int], ring_ctx: int,
                pending_src: Sequence[int]) -> bool:
    """Whether a round in flight was built on exactly the context now committed: the same
    ring epoch, its root at the next slot, the ring holding every committed token before
    it (the round it built on was accepted whole), the bonus token it guessed, and no
    accepted nodes left to move (a move it did not carry). Otherwise its result is void."""
    return (ahead.epoch == epoch and ahead.root == len(committed) - 1 == ring_ctx
            and committed[-1] == ahead.root_token and not pending_src)


def queued_rows(rounds: Iterable[Ahead], epoch: int | None = None) -> list[tuple[float, int]]:
    """(sent at, rows) of `rounds` (those on ring `epoch` when given): the queue a round
    sent now waits behind (adapt.queued_share). A discarded round still occupies the ring
    it was sent on until its frames drain; on another ring it costs nothing."""
    return [(a.sent_s, a.tree.num_nodes + 1) for a in rounds if epoch is None or a.epoch == epoch]
