"""Draft trees as data: structure helpers against brute force, best-first growth."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.draft_tree import ChildSampling, DraftShapeError, DraftTree, Expansion, grow_best_first


@st.composite
def trees(draw) -> DraftTree:
    m = draw(st.integers(0, 24))
    parents = [draw(st.integers(-1, i - 1)) for i in range(m)]
    tokens = draw(st.lists(st.integers(0, 99), min_size=m, max_size=m))
    return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64))


def ancestors(parents: list[int], i: int) -> set[int]:
    out = set()
    while i >= 0:
        out.add(i)
        i = parents[i]
    return out


@settings(max_examples=60, deadline=None)
@given(trees(), st.integers(0, 1000))
def test_structure_matches_brute_force(tree, root_position):
    # Bug guarded: a mask that lets a node see a sibling's branch (or hides its parent)
    # silently corrupts every tree verification. Sound: recomputed by walking parents.
    parents = tree.parents.tolist()
    m = tree.num_nodes
    mask = tree.ancestor_mask()
    full = tree.ancestor_mask(include_root=True)
    assert mask.shape == (m, m) and full.shape == (m + 1, m + 1)
    for i in range(m):
        anc = ancestors(parents, i)
        assert {j for j in range(m) if mask[i, j]} == anc
        assert int(tree.depths[i]) == len(anc)
        assert int(tree.positions(root_position)[i]) == root_position + len(anc)
        assert tree.path(i) == sorted(anc)
    assert bool(full[:, 0].all()) and not bool(full[0, 1:].any())
    assert torch.equal(full[1:, 1:], mask)
    # Every node lies on some root-to-leaf path; leaves are exactly the childless nodes.
    assert {n for p in tree.paths() for n in p} == set(range(m))
    assert all(not tree.children(p[-1]) for p in tree.paths())


def test_chain_is_a_tree_with_parents_i_minus_1():
    chain = DraftTree.chain([4, 5, 6])
    assert chain.parents.tolist() == [-1, 0, 1]
    assert chain.depths.tolist() == [1, 2, 3] and chain.paths() == [[0, 1, 2]]
    assert torch.equal(chain.ancestor_mask(), torch.tril(torch.ones(3, 3, dtype=torch.bool)))


def test_branches_merge_shared_prefixes_within_budget():
    tree = DraftTree.from_branches([[1, 2, 3], [1, 2, 4], [5, 6]], max_nodes=5)
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, -1]
    assert tree.sibling_ranks() == [0, 0, 0, 1, 1]


def test_invalid_structure_is_rejected_with_fields():
    with pytest.raises(DraftShapeError) as err:
        DraftTree(torch.tensor([1, 2]), torch.tensor([1, -1]))
    assert err.value.what == "parents" and err.value.actual == [1, -1]
    with pytest.raises(DraftShapeError, match="bad probs"):
        DraftTree.chain([1], sampling=ChildSampling.IID)


def sorted_expander(width: int, seed: int):
    """Deterministic top-`width` candidates per node, log-probs sorted descending."""
    calls = []

    def expand(node: int, path: list[int]) -> Expansion:
        calls.append(node)
        g = torch.Generator().manual_seed(seed * 1000 + len(path) * 37 + sum(path))
        lp = torch.log_softmax(torch.randn(16, generator=g), -1)
        top = torch.topk(lp, width)
        return Expansion(top.indices.tolist(), top.values.tolist())

    return expand, calls


def all_cumulative(expand, depth: int, path=(), base=0.0) -> list[float]:
    """Cumulative log-probs of every node of the full tree to `depth` (brute force)."""
    if len(path) == depth:
        return []
    exp = expand(-1, list(path))
    out = []
    for tok, lp in zip(exp.tokens, exp.logprobs):
        out.append(base + lp)
        out += all_cumulative(expand, depth, path + (tok,), base + lp)
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 20), st.integers(1, 4), st.integers(1, 3), st.integers(0, 50))
def test_best_first_keeps_the_most_probable_nodes(max_nodes, max_depth, width, seed):
    # Bug guarded: a frontier that is not best-first (or expands leaves needlessly).
    # Sound: with sorted candidates any prefix-closed set's best M is the global top M of
    # the full tree, computed here by enumeration.
    expand, calls = sorted_expander(width, seed)
    tree = grow_best_first(expand, max_nodes, max_depth)
    brute = sorted(all_cumulative(sorted_expander(width, seed)[0], max_depth), reverse=True)[:max_nodes]
    got = sorted(tree.cumulative_logprobs().tolist(), reverse=True)
    assert got == pytest.approx(brute, abs=1e-5)
    assert tree.max_depth <= max_depth
    assert all(a >= b - 1e-6 for a, b in zip(tree.cumulative_logprobs().tolist(), tree.cumulative_logprobs().tolist()[1:]))
    # Lazy expansion: each node at most once, never one at max_depth.
    assert len(calls) == len(set(calls)) <= tree.num_nodes + 1
    assert all(c < 0 or int(tree.depths[c]) < max_depth for c in calls)


def test_best_first_keeps_a_prefix_of_each_nodes_draws():
    # Bug guarded: keeping draw 3 of a node without draw 2 (unsorted without-replacement
    # draws) breaks exact speculative sampling. Draw 2 is improbable but draw 3 is likely.
    q = torch.full((8,), 0.1)

    def expand(node, path):
        return Expansion([1, 2, 3], [math.log(0.5), math.log(0.01), math.log(0.4)], probs=q)

    tree = grow_best_first(expand, max_nodes=3, max_depth=1, sampling=ChildSampling.WITHOUT_REPLACEMENT)
    assert tree.tokens.tolist() == [1, 2, 3]  # 3 only after 2, although 2 scores lower
    tree = grow_best_first(expand, max_nodes=2, max_depth=2, sampling=ChildSampling.WITHOUT_REPLACEMENT)
    assert tree.tokens.tolist() == [1, 1] and tree.parents.tolist() == [-1, 0]
    assert torch.equal(tree.probs[0], q) and torch.equal(tree.probs[1], q)


def test_keep_likeliest_keeps_a_tree_of_the_best_paths():
    #        root
    #      a(-0.1)      b(-1.0)
    #   c(-0.2) d(0.0)   e(-0.1)
    tree = DraftTree(torch.tensor([10, 20, 30, 40, 50]), torch.tensor([-1, -1, 0, 0, 1]),
                     logprobs=torch.tensor([-0.1, -1.0, -0.2, 0.0, -0.1]), source="eagle:tree")
    # Cumulative: a -0.1, b -1.0, c -0.3, d -0.1 (ties its parent: the parent goes first), e -1.1.
    two = tree.keep_likeliest(2)
    assert two.tokens.tolist() == [10, 40] and two.parents.tolist() == [-1, 0]
    three = tree.keep_likeliest(3)
    assert three.tokens.tolist() == [10, 30, 40] and three.parents.tolist() == [-1, 0, 0]
    four = tree.keep_likeliest(4)
    assert four.tokens.tolist() == [10, 20, 30, 40] and four.parents.tolist() == [-1, -1, 0, 0]
    assert four.logprobs.tolist() == pytest.approx([-0.1, -1.0, -0.2, 0.0]) and four.source == "eagle:tree"
    assert tree.keep_likeliest(9) is tree
