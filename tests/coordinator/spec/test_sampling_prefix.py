"""`probs` with top-k / top-p sorts only the ranking's head (coordinator.spec.sampling).

Bug guarded (issue 21): a stable sort of the whole vocabulary per sampled row was ~15% of
the gateway's time at 16 sampled streams. The shortcut must give the very same
probabilities as the full sort (seeded sampling draws from them: one bit off can change
a token), with ties, flat rows whose nucleus is most of the vocabulary (the fallback),
top-k past the prefix, and both filters together.
"""

from __future__ import annotations

import pytest
import torch

from coordinator.spec import sampling
from coordinator.spec.sampling import SamplingParams, probs

PARAMS = [
    SamplingParams(temperature=0.8, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=40),
    SamplingParams(temperature=0.7, top_k=2000, top_p=0.9),  # top-k past the first prefix
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=1.0, top_k=3, top_p=0.999),
]


def full_sort(logits: torch.Tensor, params: SamplingParams, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(sampling, "_filtered_by_prefix", lambda *a: None)
        return probs(logits, params)


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("scale", [0.3, 2.0, 8.0])  # flat (nucleus of thousands: fallback) to peaked
@pytest.mark.parametrize("ties", [False, True])
def test_prefix_probs_equal_the_full_sort_bitwise(params, scale, ties, monkeypatch):
    g = torch.Generator().manual_seed(int(scale * 10) + ties)
    for vocab in (49152, 5000):
        x = torch.randn(vocab, generator=g) * scale
        if ties:
            x = torch.round(x * 2) / 2  # many equal logits: ties go to the lower id
        assert torch.equal(probs(x, params), full_sort(x, params, monkeypatch))


def test_the_prefix_is_taken_on_a_peaked_row_and_left_on_a_flat_one():
    g = torch.Generator().manual_seed(0)
    p = SamplingParams(temperature=0.8, top_p=0.95)
    peaked = torch.randn(49152, generator=g) * 8
    flat = torch.randn(49152, generator=g) * 0.1
    assert sampling._filtered_by_prefix(peaked, peaked / 0.8, p) is not None
    assert sampling._filtered_by_prefix(flat, flat / 0.8, p) is None


def test_nan_logits_take_the_full_sort():
    x = torch.randn(4096)
    x[7] = float("nan")
    assert sampling._filtered_by_prefix(x, x, SamplingParams(temperature=1.0, top_p=0.9)) is None
