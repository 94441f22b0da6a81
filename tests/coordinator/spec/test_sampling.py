"""coordinator.spec.sampling: parameter validation, the target distribution, seeded draws."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from coordinator.spec.sampling import SamplingParams, draw, greedy_token, job_seed, probs, sample, uniform_at
from coordinator.errors import SamplingParamError

VOCAB = 12

logits_rows = st.lists(
    st.floats(min_value=-20, max_value=20, allow_nan=False, width=32), min_size=VOCAB, max_size=VOCAB
).map(lambda xs: torch.tensor(xs, dtype=torch.float32))
params_st = st.builds(
    SamplingParams,
    temperature=st.floats(min_value=0.05, max_value=2.0),
    top_p=st.floats(min_value=0.01, max_value=1.0),
    top_k=st.integers(min_value=0, max_value=VOCAB + 3),
)


@given(logits_rows, params_st)
@settings(max_examples=150, deadline=None)
def test_probs_is_a_distribution_whose_support_obeys_top_k_and_top_p(logits, params):
    # Bug guarded: filters that drop everything (NaN after renormalising), keep more than
    # k tokens, or keep more of the nucleus than needed. Sound: checks the definitions.
    p = probs(logits, params)
    assert torch.all(p >= 0) and math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)
    support = int((p > 0).sum())
    if params.top_k:
        assert support <= params.top_k
    # The greedy token always survives every filter.
    assert p[greedy_token(logits)] > 0
    if params.top_p < 1.0:
        # Minimal nucleus: without its smallest member the kept mass (measured on the
        # post-top-k tempered distribution) would fall short of top_p.
        k_only = probs(logits, SamplingParams(temperature=params.temperature, top_k=params.top_k))
        kept = k_only[p > 0]
        assert float(kept.sum() - kept.min()) < params.top_p + 1e-6


@given(logits_rows, params_st)
@settings(max_examples=60, deadline=None)
def test_probs_preserves_the_order_of_logits(logits, params):
    # Bug guarded: temperature or filters reordering tokens (e.g. dividing by a negative or
    # scattering to the wrong ids). Sound: among kept tokens higher logit => higher prob.
    p = probs(logits, params)
    kept = torch.nonzero(p > 0).flatten().tolist()
    for i in kept:
        for j in kept:
            if logits[i] > logits[j]:
                assert p[i] >= p[j]


def test_greedy_is_argmax_with_ties_to_the_lowest_id():
    # Bug guarded: a tie-break that differs from transformers' greedy search, which would
    # make ring output differ from generate(). Sound: ids 3 and 7 tie for the maximum.
    logits = torch.zeros(10)
    logits[3] = logits[7] = 5.0
    params = SamplingParams(temperature=0.0)
    assert sample(logits, params, 0, 0) == 3
    assert probs(logits, params).tolist() == [0.0] * 3 + [1.0] + [0.0] * 6


@given(logits_rows, st.integers(min_value=0, max_value=2**64 - 1))
@settings(max_examples=40, deadline=None)
def test_draws_are_functions_of_seed_and_position_and_stay_in_support(logits, seed):
    # Bug guarded: a draw that depends on how many draws came before it (so a drafter,
    # which changes that, changes the text of a seeded request), or a draw outside the
    # filtered support. Sound: 20 positions drawn forwards and backwards must agree.
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=seed)
    a = [sample(logits, params, seed, pos) for pos in range(20)]
    b = [sample(logits, params, seed, pos) for pos in reversed(range(20))][::-1]
    assert a == b
    support = probs(logits, params) > 0
    assert all(bool(support[t]) for t in a)


def test_uniforms_are_uniform_and_independent_across_seeds_and_positions():
    # Bug guarded: a weak mix (e.g. seed + position) that makes neighbouring seeds or
    # positions share draws. Sound: 20000 uniforms over a seeds x positions grid have
    # mean 1/2 and variance 1/12 within 5 sigma, and (seed, pos) vs (seed + 1, pos - 1)
    # agree no more than chance.
    u = torch.tensor([[uniform_at(s, p) for p in range(200)] for s in range(100)], dtype=torch.float64)
    n = u.numel()
    assert abs(float(u.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u.var()) - 1 / 12) < 0.005
    assert bool(((u >= 0) & (u < 1)).all())
    assert float((u[1:, :-1] - u[:-1, 1:]).abs().min()) > 0  # no shifted copies
    assert job_seed(-1) == 2**64 - 1 and job_seed(None) != job_seed(None)


def test_sampling_frequencies_match_probs():
    # Bug guarded: sample() drawing from something other than probs() (e.g. forgetting the
    # temperature). Sound: 4000 positions, each frequency within 5 sigma of its probability.
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    params = SamplingParams(temperature=0.7, top_k=4)
    p = probs(logits, params)
    n = 4000
    counts = torch.bincount(torch.tensor([sample(logits, params, 1234, pos) for pos in range(n)]), minlength=5)
    for i in range(5):
        sigma = math.sqrt(n * float(p[i]) * (1 - float(p[i]))) + 1e-9
        assert abs(int(counts[i]) - n * float(p[i])) <= 5 * sigma + 1
    assert counts[3] == 0  # the lowest logit is outside top-4


def test_draw_inverts_the_cdf_and_skips_empty_entries():
    # Bug guarded: an off-by-one at the CDF's steps, or a zero-mass entry returned at a
    # boundary. Sound: the CDF of [0.25, 0, 0.75] is [0.25, 0.25, 1].
    p = torch.tensor([0.25, 0.0, 0.75])
    assert [draw(p, u) for u in (0.0, 0.2499, 0.25, 0.9999999)] == [0, 0, 2, 2]


def test_probs_works_on_batches_of_rows():
    # Bug guarded: filters applied along the wrong dim for (N, V) rows, which speculative
    # verification uses. Sound: batched result equals row-by-row result.
    torch.manual_seed(0)
    rows = torch.randn(5, VOCAB)
    params = SamplingParams(temperature=0.8, top_k=6, top_p=0.7)
    batched = probs(rows, params)
    for i in range(5):
        torch.testing.assert_close(batched[i], probs(rows[i], params))


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ("a", "b", "c", "d", "e")}, "stop"),
        ({"stop": ("",)}, "stop"),
        ({"stop": ["x"]}, "stop"),
    ],
)
def test_invalid_params_are_rejected_with_the_param_named(kwargs, param):
    # Bug guarded: nonsense reaching the sampler (NaN probabilities, empty supports).
    # Sound: each case is one bad field; the error must name exactly that field.
    with pytest.raises(SamplingParamError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
