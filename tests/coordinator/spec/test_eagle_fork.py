"""EagleDrafter.fork: a job starting from a kept job's first tokens (the prefix cache).

Bugs guarded: a forked drafter whose committed pairs, last feature or drafts differ from a
drafter that observed the same tokens itself (pairs copied short, the n-th feature taken
from the wrong token, the pair count off by one); a fork past what was observed, or from a
drafter that kept no features, succeeding on wrong state; the source changed by its fork.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.spec.drafting import DraftBudget
from coordinator.spec.eagle import EagleDrafter
from tests.coordinator.spec.test_eagle import TARGET, aux_rows, same_tree, tiny_head


def test_a_fork_drafts_as_a_drafter_that_observed_the_tokens_itself():
    ids = torch.randint(0, TARGET.vocab_size, (14,), generator=torch.Generator().manual_seed(5)).tolist()
    aux = aux_rows(14, 4)
    head = tiny_head()
    source = EagleDrafter(head, keep_features=True)
    source.observe(ids[:5], aux[:5])
    source.observe(ids[5:12], aux[5:12])
    before = source.cache.k[:, :11].clone()
    forked = source.fork(8)
    forked.observe(ids[8:13], aux[8:13])
    itself = EagleDrafter(head)
    itself.observe(ids[:8], aux[:8])
    itself.observe(ids[8:13], aux[8:13])
    assert forked._committed_pairs == itself._committed_pairs == 12 and forked._tokens == itself._tokens
    torch.testing.assert_close(forked.cache.k[:, :12], itself.cache.k[:, :12], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(forked._last_feat, itself._last_feat, rtol=1e-5, atol=1e-5)
    budget = DraftBudget(12, 4)
    assert same_tree(forked.propose(ids[:14], budget), itself.propose(ids[:14], budget))
    assert torch.equal(source.cache.k[:, :11], before) and source.observed_tokens == 12


def test_forks_past_what_was_observed_or_without_features_are_refused():
    ids, aux = list(range(6)), aux_rows(6, 4)
    source = EagleDrafter(tiny_head(), keep_features=True)
    source.observe(ids, aux)
    with pytest.raises(ValueError, match="fork of 7 tokens"):
        source.fork(7)
    plain = EagleDrafter(tiny_head())
    plain.observe(ids, aux)
    with pytest.raises(ValueError, match="kept no features"):
        plain.fork(3)
