"""One round's draft: each drafter proposes within the shape the planner gives it, and
the router keeps the draft likely to commit the most tokens per second of ring time.

A drafter with calibrated log-probs (`confidence = True`, EAGLE) drafts a generous tree
and keeps the likeliest nodes that pay for their ring rows (`adapt.size_by_confidence`),
or a fixed tree when one is pinned; the others draft the shape `adapt.plan` picks from
their acceptance. Several drafters (hybrid) are routed per round.

This module does not know the ring, frames or the wire: it sees the job's drafters, its
committed tokens, the planner's state and how much context is left.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from coordinator import adapt
from coordinator.draft_tree import DraftTree
from coordinator.drafting import DraftBudget, Drafter

# When the planner finds drafting not worth it, a small probe draft every few rounds keeps
# the acceptance estimate fresh (text changes; a drafter that missed early may fit later).
PROBE_EVERY_ROUNDS = 8
PROBE_NODES = 2


def draft_round(drafters: Sequence[Drafter], committed: Sequence[int], state: adapt.AdaptState, *, room: int,
                pipeline: bool, undrafted_rounds: int, fixed_tree: tuple[int, int] | None = None
                ) -> tuple[DraftTree, float]:
    """(the draft to verify next, seconds spent drafting). `room`: draft nodes the
    context still has space for; `pipeline`: whether rounds may be sent ahead."""
    # Only a drafter that needs no target features (n-gram) can draft a round ahead.
    ahead = pipeline and any(not getattr(d, "aux_layers", ()) for d in drafters)
    config = adapt.AdaptConfig() if ahead else adapt.AdaptConfig(max_pipeline_depth=1)
    candidates = []
    for drafter in drafters:
        t0 = time.perf_counter()
        confident = getattr(drafter, "confidence", False)
        floor = float("-inf")
        if confident:
            nodes, depth = fixed_tree or (config.confident_nodes, config.confident_depth)
            if not fixed_tree:
                floor = adapt.confidence_floor(state, drafter.name, config)
        else:
            shape = adapt.plan(state, config, source=getattr(drafter, "name", adapt.ALL_SOURCES))
            nodes, depth = shape.nodes, shape.depth
            if nodes == 0 and undrafted_rounds >= PROBE_EVERY_ROUNDS:
                nodes = depth = PROBE_NODES
        budget = DraftBudget(max(0, min(nodes, room)), max(0, min(depth, room)), floor)
        tree = drafter.propose(committed, budget) if budget.max_nodes else DraftTree.empty()
        draft_s = time.perf_counter() - t0
        if not tree.num_nodes:
            continue
        if confident and not fixed_tree:  # keep the likeliest nodes that pay for their rows
            m, expected = adapt.size_by_confidence(tree, state, draft_s, config)
            if m:
                candidates.append(adapt.DraftCandidate(tree.keep_likeliest(m), draft_s, expected))
        else:
            candidates.append(adapt.DraftCandidate(tree, draft_s))
    if not candidates:
        return DraftTree.empty(), 0.0
    best = candidates[adapt.route(candidates, state)] if len(candidates) > 1 else candidates[0]
    return best.tree, sum(c.draft_s for c in candidates)


def is_confident(drafters: Sequence[Drafter], source: str) -> bool:
    """Whether the drafter behind `source` reports log-probs that estimate acceptance."""
    family = source.split(":")[0]
    return any(getattr(d, "confidence", False) and d.name == family for d in drafters)
