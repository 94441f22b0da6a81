"""Greedy acceptance reproduces plain greedy decoding token for token.

The "model" is a fixed random function from context to logits (a seeded table indexed by
a hash of the last two tokens), so the greedy reference is exact and cheap. Drafts come
from a perfect drafter (the model itself), a noisy one (random tokens), and the n-gram
drafter, as chains and as trees.
"""

from __future__ import annotations

import random

import pytest
import torch

from coordinator.spec.accept import (
    GreedyRows,
    accept_as_committed,
    accept_greedy,
    accept_greedy_lazy,
    accept_sampling,
    truncate_at_stop,
)
from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget, NgramDrafter
from coordinator.spec.source import DraftSource

VOCAB = 32
EOS = 3
TABLE = torch.randn(VOCAB * VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))  # (V*V, V)


def logits(context: list[int]) -> torch.Tensor:
    """(V,) next-token logits: depends on the last two tokens only."""
    a, b = (context[-2] if len(context) > 1 else 0), context[-1]
    return TABLE[a * VOCAB + b]


def greedy_reference(prompt: list[int], n: int) -> list[int]:
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(int(torch.argmax(logits(ctx))))
    return ctx[len(prompt) :]


def target_rows(context: list[int], tree: DraftTree) -> torch.Tensor:
    """(M+1, V): what the ring returns, the target at the root and at every node."""
    rows = [logits(context)] + [logits(context + tree.path_tokens(i)) for i in range(tree.num_nodes)]
    return torch.stack(rows)


def perfect_chain(context: list[int], k: int, rng: random.Random) -> DraftTree:
    return DraftTree.chain(greedy_reference(context, k))


def noisy_chain(context: list[int], k: int, rng: random.Random) -> DraftTree:
    return DraftTree.chain([rng.randrange(VOCAB) for _ in range(k)])


def mixed_tree(context: list[int], k: int, rng: random.Random) -> DraftTree:
    """Random branches plus, half the time, the true continuation as a later branch, so
    acceptance must find the right sibling at every level."""
    branches = [[rng.randrange(VOCAB) for _ in range(k)] for _ in range(3)]
    if rng.random() < 0.5:
        truth = greedy_reference(context, k)
        cut = rng.randrange(k)
        branches.append(truth[:cut] + [rng.randrange(VOCAB)] * (k - cut) if rng.random() < 0.5 else truth)
    return DraftTree.from_branches(branches, max_nodes=4 * k)


def speculative(prompt: list[int], n: int, draft, k: int = 4, seed: int = 0) -> tuple[list[int], int]:
    rng = random.Random(seed)
    ctx, rounds = list(prompt), 0
    while len(ctx) - len(prompt) < n:
        tree = draft(ctx, k, rng)
        result = accept_greedy(tree, target_rows(ctx, tree))
        assert list(result.tokens[:-1]) == tree.path_tokens(result.last_node)
        ctx += result.tokens
        rounds += 1
    return ctx[len(prompt) : len(prompt) + n], rounds


@pytest.mark.parametrize("draft", [perfect_chain, noisy_chain, mixed_tree], ids=["perfect", "noisy", "tree"])
def test_speculative_equals_greedy(draft):
    # Bug guarded: an off-by-one between target rows and nodes, or a bonus taken from the
    # wrong row, commits a token greedy decoding would not. Sound: the reference is the
    # argmax loop on the same deterministic model.
    prompt = [5, 9, 1]
    out, rounds = speculative(prompt, 40, draft)
    assert out == greedy_reference(prompt, 40)
    if draft is perfect_chain:  # every draft accepted: K + 1 tokens per round
        assert rounds == 8


def test_ngram_drafter_on_repetitive_output_equals_greedy():
    # The n-gram drafter proposes from the context; whatever it proposes, output is exact.
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    drafter = NgramDrafter()
    ctx = list(prompt)
    while len(ctx) - len(prompt) < 30:
        tree = drafter.propose(ctx, DraftBudget(8, 4))
        ctx += accept_greedy(tree, target_rows(ctx, tree)).tokens
    assert ctx[len(prompt) : len(prompt) + 30] == greedy_reference(prompt, 30)


def test_eos_inside_accepted_block_is_truncated():
    # Bug guarded: tokens accepted after EOS leaking to the user. The draft is the true
    # continuation with EOS forced into the middle of the target's greedy choices.
    forced = torch.full((4, VOCAB), -10.0)
    draft = [7, EOS, 8]
    for row, tok in enumerate(draft + [9]):  # target agrees with every draft token, bonus 9
        forced[row, tok] = 10.0
    result = accept_greedy(DraftTree.chain(draft), forced)
    assert result.tokens == (7, EOS, 8, 9)
    assert truncate_at_stop(result.tokens, {EOS}) == ([7, EOS], True)
    assert truncate_at_stop([1, 2], {EOS}) == ([1, 2], False)


def test_first_matching_sibling_is_accepted_and_tried_counts_siblings():
    tree = DraftTree.from_branches([[4, 1], [5, 2], [6, 3]], max_nodes=6)  # nodes: 4 1 5 2 6 3
    rows = torch.zeros(7, VOCAB)
    rows[0, 6] = 1.0  # root wants 6: third sibling (node 4)
    rows[5, 3] = 1.0  # node 4 wants 3: its child (node 5)
    rows[6, 0] = 1.0  # bonus 0
    result = accept_greedy(tree, rows)
    assert result.nodes == (4, 5) and result.tokens == (6, 3, 0)
    assert result.tried == 3 + 1


def test_sampling_at_temperature_zero_equals_greedy():
    # One-hot targets (what sampling.probs gives at temperature 0) must reproduce greedy.
    rng = random.Random(1)
    g = torch.Generator().manual_seed(0)
    ctx = [5, 9, 1]
    for _ in range(20):
        tree = mixed_tree(ctx, 3, rng)
        rows = target_rows(ctx, tree)
        one_hot = torch.nn.functional.one_hot(rows.argmax(-1), VOCAB).double()
        assert accept_sampling(tree, one_hot, g) == accept_greedy(tree, rows)
        ctx += accept_greedy(tree, rows).tokens


def test_rows_must_match_the_tree():
    with pytest.raises(ValueError, match=r"bad target logits: expected \(4, V\), got \(3, 32\)"):
        accept_greedy(DraftTree.chain([1, 2, 3]), torch.zeros(3, VOCAB))


@pytest.mark.parametrize("seed", range(30))
def test_rows_on_demand_accept_the_same_and_compute_little(seed):
    # Guards the engine's LM-head saving: acceptance from rows computed on demand must
    # equal acceptance from all rows, and ask only for the rows it walks (the first-child
    # path in one batch, then one row per step off it).
    rng = random.Random(seed)
    branches = [[rng.randrange(6) for _ in range(rng.randint(1, 5))] for _ in range(rng.randint(1, 4))]
    tree = DraftTree.from_branches(branches, 12)
    logits = torch.randn(tree.num_nodes + 1, 6, generator=torch.Generator().manual_seed(seed))
    asked: list[list[int]] = []

    def logits_of(rows: list[int]) -> torch.Tensor:
        asked.append(list(rows))
        return logits[rows]

    lazy = accept_greedy_lazy(tree, GreedyRows(tree, logits_of))
    assert lazy == accept_greedy(tree, logits)
    first_path = [0]
    node = -1
    while tree.children(node):
        node = tree.children(node)[0]
        first_path.append(node + 1)
    assert asked[0] == first_path and all(len(rows) == 1 for rows in asked[1:])
    assert len(asked) - 1 <= len(lazy.nodes) + 1


@pytest.mark.parametrize("seed", range(40))
def test_each_part_of_a_merged_draft_is_judged_as_if_verified_alone(seed):
    # Guards the hybrid's statistics: after a merged round the engine scores each
    # drafter's own tree against the committed tokens; that must be exactly what greedy
    # verification of that tree alone would have accepted and tried (else the router
    # learns the wrong drafter's acceptance). Sound: accept_greedy on the part is the oracle.
    rng = random.Random(seed)
    parts = [DraftTree.from_branches([[rng.randrange(4) for _ in range(rng.randint(1, 5))]
                                      for _ in range(rng.randint(1, 3))], 10) for _ in range(2)]
    merged, where = DraftTree.merge(parts, source=DraftSource("merged"))
    # One target: a fixed next token per context (path tokens), as a deterministic model gives.
    table: dict[tuple[int, ...], int] = {}

    def choice(path: tuple[int, ...]) -> int:
        return table.setdefault(path, rng.randrange(4))

    def logits_for(tree: DraftTree) -> torch.Tensor:
        rows = [()] + [tuple(tree.path_tokens(i)) for i in range(tree.num_nodes)]
        return torch.nn.functional.one_hot(torch.tensor([choice(r) for r in rows]), 4).float()

    committed = accept_greedy(merged, logits_for(merged)).tokens
    for part in parts:
        assert accept_as_committed(part, committed) == accept_greedy(part, logits_for(part))
