"""Draft trees as data: structure helpers against brute force, best-first growth."""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.spec.draft_tree import ChildSampling, DraftTree
from coordinator.spec.source import DraftSource
from coordinator.errors import DraftShapeError


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


def test_keep_likeliest_keeps_a_tree_of_the_best_paths():
    #        root
    #      a(-0.1)      b(-1.0)
    #   c(-0.2) d(0.0)   e(-0.1)
    tree = DraftTree(torch.tensor([10, 20, 30, 40, 50]), torch.tensor([-1, -1, 0, 0, 1]),
                     logprobs=torch.tensor([-0.1, -1.0, -0.2, 0.0, -0.1]), source=DraftSource("eagle", "tree"))
    # Cumulative: a -0.1, b -1.0, c -0.3, d -0.1 (ties its parent: the parent goes first), e -1.1.
    two = tree.keep_likeliest(2)
    assert two.tokens.tolist() == [10, 40] and two.parents.tolist() == [-1, 0]
    three = tree.keep_likeliest(3)
    assert three.tokens.tolist() == [10, 30, 40] and three.parents.tolist() == [-1, 0, 0]
    four = tree.keep_likeliest(4)
    assert four.tokens.tolist() == [10, 20, 30, 40] and four.parents.tolist() == [-1, -1, 0, 0]
    assert four.logprobs.tolist() == pytest.approx([-0.1, -1.0, -0.2, 0.0]) and four.source == DraftSource("eagle", "tree")
    assert tree.keep_likeliest(9) is tree
    sampled = DraftTree(tree.tokens, tree.parents, logprobs=tree.logprobs, probs=torch.ones(6, 4) / 4,
                        sampling=ChildSampling.WITHOUT_REPLACEMENT)
    with pytest.raises(DraftShapeError, match="bad sampling: expected GREEDY children to prune"):
        sampled.keep_likeliest(2)


def paths_of(tree: DraftTree) -> set[tuple[int, ...]]:
    return {tuple(tree.path_tokens(i)) for i in range(tree.num_nodes)}


@settings(max_examples=60, deadline=None)
@given(st.lists(trees(), min_size=1, max_size=3))
def test_merge_holds_every_path_once_and_maps_each_part(parts):
    # Bug guarded: a hybrid round verifies the merge of several drafters' trees; a lost
    # path would hide a drafter's right guess, a duplicated (parent, token) child would
    # waste a ring row, and a wrong map would credit the wrong drafter with its accepted
    # nodes. Sound: paths compared as token tuples, recomputed by walking parents.
    merged, where = DraftTree.merge(parts, source=DraftSource("merged"))
    assert merged.merged_from == tuple(parts) and merged.source == DraftSource("merged")
    assert paths_of(merged) == set().union(*(paths_of(p) for p in parts))
    assert len(paths_of(merged)) == merged.num_nodes  # no two nodes share a path
    for part, mine in zip(parts, where):
        assert len(mine) == part.num_nodes
        for i, j in enumerate(mine):
            assert merged.path_tokens(j) == part.path_tokens(i)
    # the first part's children are tried first
    if parts[0].num_nodes:
        assert merged.children(-1)[0] == where[0][parts[0].children(-1)[0]]


def test_merge_refuses_sampled_children():
    sampled = DraftTree.chain([1, 2], probs=torch.full((3, 4), 0.25), sampling=ChildSampling.IID)
    with pytest.raises(DraftShapeError, match="GREEDY children to merge"):
        DraftTree.merge([DraftTree.chain([1]), sampled], source=DraftSource("merged"))
