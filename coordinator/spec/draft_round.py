"""One round's draft: each drafter proposes within the shape the planner gives it, and
the router keeps the draft likely to commit the most tokens per second of ring time.

A drafter with calibrated log-probs (`confidence = True`, EAGLE) drafts a generous tree
and keeps the likeliest nodes that pay for their ring rows (`confidence.size_by_confidence`),
or a fixed tree when one is pinned; the others draft the shape `adapt.plan` picks from
the acceptance of the evidence their draft names (an n-gram draft its match length), and
are asked every round, since a long match can pay where their average says none does.
Several drafters (hybrid) are routed per round among their own drafts and the merge of
all of them (one tree, verified in one traversal: when the drafters disagree, whichever
is right commits its tokens). A confident drafter that drafts after a draft it cannot
improve on (a long, trusted n-gram match) is not asked at all: by its recent rounds and
drafting time it could not pay for the time (`routing.side_draft_can_pay`). A round sent
ahead of the one in the ring (`draft_ahead`) is a chain sized the same way, on its own
evidence.

This module does not know the ring, frames or the wire: it sees the job's drafters, its
committed tokens, the planner's state and how much context is left.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from coordinator.spec import adapt, confidence, routing
from coordinator.spec.draft_tree import ChildSampling, DraftTree
from coordinator.spec.drafting import DraftBudget, Drafter
from coordinator.spec.source import DraftSource

# When the planner finds drafting not worth it, a small probe draft every few rounds keeps
# the acceptance estimate fresh (text changes; a drafter that missed early may fit later).
PROBE_EVERY_ROUNDS = 8
PROBE_NODES = 2
MERGED_SOURCE = DraftSource("merged")  # the source of a merged draft; its parts keep their own


def draft_round(drafters: Sequence[Drafter], committed: Sequence[int], state: adapt.AdaptState, *, room: int,
                max_pipeline_depth: int, undrafted_rounds: int, fixed_tree: tuple[int, int] | None = None
                ) -> tuple[DraftTree, float, tuple[str, ...]]:
    """(the draft to verify next, seconds spent drafting, the drafters not asked because
    they could not pay). `room`: draft nodes the context still has space for;
    `max_pipeline_depth`: most rounds the engine keeps in flight (1: none sent ahead)."""
    # Only a drafter that needs no target features (n-gram) can draft a round ahead.
    ahead = any(not getattr(d, "aux_layers", ()) for d in drafters)
    config = adapt.AdaptConfig(max_pipeline_depth=max_pipeline_depth if ahead else 1)
    candidates, skipped = [], []
    for drafter in drafters:
        t0 = time.perf_counter()
        confident = getattr(drafter, "confidence", False)
        floor, probe = float("-inf"), False
        if confident and candidates and not fixed_tree and not side_draft_pays(drafter, candidates, state, config):
            skipped.append(drafter.name)
            continue
        if confident:
            nodes, depth = fixed_tree or (config.confident_nodes, config.confident_depth)
            if not fixed_tree:
                floor = confidence.confidence_floor(state, family_of(drafter), config)
        else:
            shape = adapt.plan(state, config, source=family_of(drafter))
            wanted = shape.nodes > 0
            probe = not wanted and undrafted_rounds >= PROBE_EVERY_ROUNDS
            # Where the drafter's average says no draft pays, still look at its evidence
            # (a small draft; an n-gram lookup is nearly free): a long match can pay where
            # the average, pulled down by short ones, does not.
            nodes, depth = (shape.nodes, shape.depth) if wanted else (PROBE_NODES, PROBE_NODES)
        budget = DraftBudget(max(0, min(nodes, room)), max(0, min(depth, room)), floor)
        tree = drafter.propose(committed, budget) if budget.max_nodes else DraftTree.empty()
        if tree.num_nodes and not confident and not probe:
            # The draft names its evidence (an n-gram draft its match length): draft again
            # in the shape that evidence's own acceptance asks for, when it differs from
            # the drafter's average (1-token matches fare far worse than 4-token ones).
            own = evidence_shape(state, config, tree.source, wanted)
            if own is None:
                tree = DraftTree.empty()
            elif own != (nodes, depth):
                tree = drafter.propose(committed, DraftBudget(min(own[0], room), min(own[1], room)))
        draft_s = time.perf_counter() - t0
        if not tree.num_nodes:
            continue
        if confident and not fixed_tree:  # keep the likeliest nodes that pay for their rows
            m, expected = confidence.size_by_confidence(tree, state, draft_s, config)
            if m:
                candidates.append(routing.DraftCandidate(tree.keep_likeliest(m), draft_s, expected))
        else:
            candidates.append(routing.DraftCandidate(tree, draft_s))
    if not candidates:
        return DraftTree.empty(), 0.0, tuple(skipped)
    drafted_s = sum(c.draft_s for c in candidates)
    if len(candidates) > 1 and all(c.tree.sampling is ChildSampling.GREEDY for c in candidates):
        merged = merged_candidate(drafters, candidates, drafted_s, state, config)
        if merged.tree.num_nodes <= room:
            candidates.append(merged)
    best = candidates[routing.route(candidates, state, config)] if len(candidates) > 1 else candidates[0]
    return best.tree, drafted_s, tuple(skipped)


def evidence_shape(state: adapt.AdaptState, config: adapt.AdaptConfig, source: DraftSource,
                   wanted: bool = False) -> tuple[int, int] | None:
    """(nodes, depth) that a draft's own evidence (`source`, e.g. ngram:3) asks for, or
    None when its record says no draft pays. At least one node when the drafter's average
    wanted a draft or the evidence has no record yet: evidence judged only by drafts never
    sent would keep a low estimate for good (measured: n-gram drafted half as many rounds)."""
    own = adapt.plan(state, config, source=source)
    if own.nodes == 0 and not wanted and source in state.acceptance:
        return None
    return max(own.nodes, 1), max(own.depth, 1)


def draft_ahead(drafter: Drafter, assumed: Sequence[int], state: adapt.AdaptState, *, room: int,
                max_pipeline_depth: int) -> tuple[int, DraftTree] | None:
    """A round to send ahead, as (root token, chain below it): the root is the drafter's
    guess of the bonus token that follows `assumed` (the committed context, then every
    chain in flight as if accepted whole), and the chain is as long as a fresh round on
    the guess's own evidence would get, not as long as the round before it (a short match
    must not cap every round sent after it while the pipeline stays full). None when there
    is nothing worth sending: no chain guessed, or evidence whose record says no draft
    pays. `room`: draft nodes the context has left below the root."""
    config = adapt.AdaptConfig(max_pipeline_depth=max_pipeline_depth, kinds=(adapt.DraftKind.CHAIN,))
    room = min(config.max_chain, room)
    guess = drafter.propose(assumed, DraftBudget.chain(room + 1)) if room > 0 else DraftTree.empty()
    if guess.num_nodes < 2 or not guess.is_chain:
        return None
    own = evidence_shape(state, config, guess.source)
    if own is None:
        return None
    tokens = guess.tokens.tolist()
    return tokens[0], DraftTree.chain(tokens[1 : 1 + min(own[0], len(tokens) - 1)], source=guess.source)


def side_draft_pays(drafter: Drafter, candidates: Sequence[routing.DraftCandidate], state: adapt.AdaptState,
                    config: adapt.AdaptConfig) -> bool:
    """Whether `drafter` (confident, drafting after the others) can still beat the best
    draft so far, judged by its recent rounds (`routing.side_draft_can_pay`); True until it
    has a record."""
    stats, draft_s = state.acceptance.get(family_of(drafter)), getattr(drafter, "propose_s", None)
    if stats is None or draft_s is None:
        return True
    best = candidates[routing.route(candidates, state, config)]
    return routing.side_draft_can_pay(best, 1.0 + stats.accepted, draft_s, state, config)


def merged_candidate(drafters: Sequence[Drafter], candidates: Sequence[routing.DraftCandidate], draft_s: float,
                     state: adapt.AdaptState, config: adapt.AdaptConfig) -> routing.DraftCandidate:
    """The drafters' drafts as one tree, with its expected tokens from each part's own
    per-node estimates (confidence for confident drafters, the rank model otherwise)."""
    merged, where = DraftTree.merge([c.tree for c in candidates], source=MERGED_SOURCE)
    reach = [confidence.confident_reach(c.tree, state, config) if is_confident(drafters, c.tree.source)
             else adapt.rank_reach(c.tree, adapt.acceptance_rate(state, c.tree.source, config)) for c in candidates]
    expected = routing.merged_expected_tokens(reach, where, merged.num_nodes)
    return routing.DraftCandidate(merged, draft_s, expected)


def is_confident(drafters: Sequence[Drafter], source: DraftSource) -> bool:
    """Whether the drafter behind `source` reports log-probs that estimate acceptance."""
    return any(getattr(d, "confidence", False) and d.name == source.family for d in drafters)


def family_of(drafter: Drafter) -> DraftSource:
    """The source that stands for all of `drafter`'s drafts (the pool of every drafter
    for one without a name)."""
    return DraftSource(getattr(drafter, "name", ""))
