"""Drafting replayed on known text: how many draft tokens greedy verification accepts
where the target's choice at every position is already known.

The training run's offline tau, the benchmarks that hold the text fixed and the planner
replay all walk drafts against a known continuation instead of a ring:

- `accepted_length`: the continuation is the target's own (a greedy answer); past its
  end the target's choice is unknown, so nothing is accepted there.
- `walk` (bench_wire_tau): the text is a reference answer and `greedy` the target's
  choice at each of its positions on some wire; a draft token is accepted when it is the
  target's choice there, and the walk stops at the first miss or once an accepted token
  leaves the reference (the target's next choice off the reference is unknown).
- `simulate_tau`: an EAGLE head drafting at answer positions of captured sequences
  (`coordinator.spec.captured`), each budget's tokens per traversal.
- `replay` (bench_planner): the real n-gram drafter, `draft_round` and planner over a
  fixed answer, each round costing a fixed timing model's `fixed + per_row * (nodes + 1)`
  seconds, which the planner learns as it would from the ring (one round in flight,
  drafting time not charged); `acceptance_by_depth` counts acceptance per draft depth.

This module does not know the ring, the wire, tokenizers or where texts come from.
"""

from __future__ import annotations

from coordinator.spec import adapt
from coordinator.spec.accept import accept_as_committed, accept_greedy_lazy
from coordinator.spec.draft_round import draft_round
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget, NgramDrafter
from coordinator.spec.eagle import EagleDraftConfig, EagleDrafter, EagleHead


def accepted_length(tree: DraftTree, continuation: list[int]) -> int:
    """Draft tokens greedy verification accepts when the target continues with
    `continuation` (past its end the target's choice is unknown: nothing matches -1)."""
    padded = list(continuation[:tree.max_depth]) + [-1] * (tree.max_depth + 1)
    return len(accept_as_committed(tree, padded).nodes)


def walk(tree: DraftTree, root: int, ref: list[int], greedy: list[int]) -> int:
    """Draft tokens accepted below position `root` of the reference `ref` (module
    docstring): the engine's greedy acceptance, with the target's choice at a node that
    left the reference (or ran past the text) unknown, so nothing matches it."""
    depths, toks = tree.depths.tolist(), tree.tokens.tolist()

    def target_choice(row: int) -> int:  # row 0 = the root, row i + 1 = node i
        at = root + (depths[row - 1] if row else 0)  # the text position of that row
        if at >= len(greedy) or (row and toks[row - 1] != ref[at]):
            return -1
        return greedy[at]
    return len(accept_greedy_lazy(tree, target_choice).nodes)


def simulate_tau(head: EagleHead, seqs: list[dict], answer_starts: list[int], budgets: dict[str, DraftBudget],
                 stride: int = 6) -> dict[str, float]:
    """Tokens per traversal (accepted + bonus) of each budget, drafting at every
    `stride`-th answer position of greedy held-out sequences, whose continuation is the
    target's greedy one."""
    sums = {name: 0 for name in budgets}
    rounds = 0
    for seq, start in zip(seqs, answer_starts):
        ids = seq["ids"].tolist()
        drafter = EagleDrafter(head, EagleDraftConfig())
        seen = 0
        for root in range(max(start, 1), len(ids) - 1, stride):
            drafter.observe(ids[seen:root], seq["feats"][seen:root].float())
            seen = root
            for name, budget in budgets.items():
                tree = drafter.propose(ids[:root + 1], budget)
                sums[name] += 1 + accepted_length(tree, ids[root + 1:])
            rounds += 1
    return {name: total / max(rounds, 1) for name, total in sums.items()} | {"rounds": rounds}


def replay(prompt: list[int], answer: list[int], timing: tuple[float, float], policy: DraftBudget | None,
           state: adapt.AdaptState = adapt.AdaptState()) -> tuple[int, float, adapt.AdaptState]:
    """(traversals, model seconds, the planner's state after) to commit `answer` after its
    first token (the prefill's): the planner's shapes from `state` when `policy` is None,
    else that fixed shape every round."""
    fixed_s, per_row_s = timing
    drafter, undrafted, i, traversals, seconds = NgramDrafter(), 0, 1, 0, 0.0
    while i < len(answer):
        context = prompt + answer[:i]
        if policy is None:
            tree, _, _ = draft_round([drafter], context, state, room=len(answer) - i, max_pipeline_depth=1,
                                     undrafted_rounds=undrafted)
        else:
            tree = drafter.propose(context, policy)
        acc = accept_as_committed(tree, answer[i:] + [-1] * (tree.num_nodes + 1))
        round_s = fixed_s + per_row_s * (tree.num_nodes + 1)
        traversals, seconds = traversals + 1, seconds + round_s
        undrafted = 0 if tree.num_nodes else undrafted + 1
        if tree.num_nodes and policy is None:
            state = adapt.apply(adapt.RoundVerified(
                source=tree.source, nodes=tree.num_nodes, tried=acc.tried, accepted=len(acc.nodes),
                traversal_s=round_s, draft_s=0.0, chain=tree.is_chain), state)
        i += min(len(acc.nodes) + 1, len(answer) - i)
    return traversals, seconds, state


DEPTH_BUCKETS = ((1, 1), (2, 2), (3, 4), (5, 8), (9, 16), (17, 24))


def acceptance_by_depth(prompt: list[int], answer: list[int], counts: dict) -> None:
    """Add to `counts[source][bucket] = [accepted, tried]` the walk of a chain of 24 drafted
    at every answer position (the target's choice there is the answer's next token)."""
    drafter, longest = NgramDrafter(), DEPTH_BUCKETS[-1][1]
    for i in range(1, len(answer)):
        tree = drafter.propose(prompt + answer[:i], DraftBudget.chain(longest))
        if not tree.num_nodes:
            continue
        accepted = len(accept_as_committed(tree, answer[i:] + [-1] * (longest + 1)).nodes)
        for depth in range(1, min(accepted + 1, tree.num_nodes) + 1):  # tried: up to the first miss
            bucket = next(b for b, (lo, hi) in enumerate(DEPTH_BUCKETS) if lo <= depth <= hi)
            for key in (str(tree.source), "all"):  # JSON keys: the source as text
                row = counts.setdefault(key, [[0, 0] for _ in DEPTH_BUCKETS])[bucket]
                row[0] += depth <= accepted
                row[1] += 1
