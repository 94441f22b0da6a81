"""Penalties and biases: the request's changes to the model's logits before sampling.

OpenAI's rule, per position: logit[j] - count[j] * frequency_penalty - (count[j] > 0) *
presence_penalty + logit_bias[j], where count[j] is how often token j was generated
earlier in this completion (the prompt does not count, as in OpenAI's and vLLM's
servers). Applied to the target's rows before `sampling.probs`, so speculative
acceptance compares drafts against the penalised distribution and drafts stay lossless.

Pure: it does not know about drafts, jobs or HTTP.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coordinator.errors import SamplingParamError

MAX_PENALTY = 2.0  # OpenAI's range for both penalties: [-2, 2]
MAX_BIAS = 100.0  # OpenAI's logit_bias range: [-100, 100]
MAX_BIASED_TOKENS = 300  # OpenAI's limit on logit_bias entries


@dataclass(frozen=True)
class LogitRules:
    """What a request adds to the logits; all zero / empty changes nothing."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise SamplingParamError(name, value, f"must be a number in [-{MAX_PENALTY}, {MAX_PENALTY}]")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_BIASED_TOKENS:
            raise SamplingParamError("logit_bias", self.logit_bias, f"must map at most {MAX_BIASED_TOKENS} token ids")
        for token, bias in self.logit_bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise SamplingParamError("logit_bias", token, "keys must be token ids (integers >= 0)")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                    or not -MAX_BIAS <= bias <= MAX_BIAS:
                raise SamplingParamError("logit_bias", bias, f"values must be numbers in [-{MAX_BIAS}, {MAX_BIAS}]")

    @property
    def active(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def history_matters(self) -> bool:
        """Whether a row's logits depend on the tokens generated before it."""
        return bool(self.presence_penalty or self.frequency_penalty)


def apply_rules(logits: torch.Tensor, rules: LogitRules, generated: Sequence[int]) -> torch.Tensor:
    """(V,) logits -> (V,) float32 logits with the penalties for `generated` (the tokens
    this completion generated before the row's position) and the biases applied. Bias
    ids past the vocabulary are ignored (the gateway checks them against the tokenizer)."""
    out = logits.float().clone()
    vocab = out.shape[-1]
    if rules.history_matters and generated:
        counts = torch.bincount(torch.tensor(list(generated), dtype=torch.long), minlength=vocab)[:vocab].float()  # (V,)
        out -= counts * rules.frequency_penalty + (counts > 0).float() * rules.presence_penalty
    for token, bias in rules.logit_bias:
        if token < vocab:
            out[token] += bias
    return out
