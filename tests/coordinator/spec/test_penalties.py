"""Penalties and logit_bias (coordinator.spec.penalties) as OpenAI documents them."""

from __future__ import annotations

import pytest
import torch

from coordinator.errors import SamplingParamError
from coordinator.spec.penalties import LogitRules, apply_rules
from coordinator.spec.sampling import SamplingParams, sample


def test_penalties_follow_openais_formula_and_count_only_generated_tokens():
    # Bug guarded: the presence penalty applied per occurrence (it is once per token), the
    # frequency penalty not scaled by the count, or the bias lost. Sound: token 1 was
    # generated twice, token 2 once, token 3 never; the expected row is the formula
    # logit - count * 0.5 - (count > 0) * 0.25 + bias worked by hand.
    logits = torch.zeros(5)
    rules = LogitRules(presence_penalty=0.25, frequency_penalty=0.5, logit_bias=((3, 2.0), (4, -100.0), (9, 5.0)))
    out = apply_rules(logits, rules, [1, 2, 1])
    assert out.tolist() == [0.0, -1.25, -0.75, 2.0, -100.0]
    assert logits.tolist() == [0.0] * 5  # the caller's row is untouched


def test_rules_change_what_sample_picks_greedy_and_sampled():
    # Sound: token 0 leads by 1.0; a frequency penalty of 2 on one earlier 0 drops it
    # below token 1, and a bias of -100 makes a token unreachable at any seed.
    logits = torch.tensor([1.0, 0.0, -1.0])
    greedy = SamplingParams(temperature=0.0, rules=LogitRules(frequency_penalty=2.0))
    assert sample(logits, greedy, 0, 5, ()) == 0 and sample(logits, greedy, 0, 5, (0,)) == 1
    banned = SamplingParams(temperature=1.0, rules=LogitRules(logit_bias=((0, -100.0),)))
    assert all(sample(logits, banned, 7, pos) != 0 for pos in range(200))


@pytest.mark.parametrize("kwargs, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
    ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
])
def test_out_of_range_rules_are_refused_by_name(kwargs, param):
    with pytest.raises(SamplingParamError) as info:
        LogitRules(**kwargs)
    assert info.value.param == param
