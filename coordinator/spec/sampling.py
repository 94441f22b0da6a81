"""Sampling: the target distribution a request asks for, and drawing one token from it.

Pure functions on logits. `probs` is the single definition of "the distribution the user
asked for" (temperature, then top-k, then top-p); `sample` draws from it, and speculative
sampling compares drafts against it. This module does not know about tokenizers, stop
strings, jobs or the ring; it never touches the network.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from coordinator.errors import SamplingParamError
from coordinator.spec.grammar import Constraint
from coordinator.spec.penalties import LogitRules, apply_rules

# OpenAI's documented ranges; top_k is the common extension (0 = disabled).
MAX_TEMPERATURE = 2.0
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs



def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """What a request asks of the sampler and the stopping rule. The only defaults.

    temperature 0 means greedy (argmax, ties to the lowest id). top_k 0 and top_p 1
    disable those filters. max_tokens None means "until the context is full". seed None
    means fresh entropy per job; an int makes the job's text reproducible, whatever the
    drafter (each position's draw is a function of the seed and the position alone).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    rules: LogitRules = LogitRules()  # penalties and logit_bias, applied before all of the above
    logprobs: int | None = None  # None: none reported; k: each token's logprob and the top k
    constraint: Constraint | None = None  # response_format's grammar; masks every target row

    def __post_init__(self) -> None:
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise SamplingParamError("temperature", self.temperature, f"must be a number in [0, {MAX_TEMPERATURE}]")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise SamplingParamError("top_p", self.top_p, "must be a number in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise SamplingParamError("top_k", self.top_k, "must be an integer >= 0 (0 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            raise SamplingParamError("seed", self.seed, "must be a 64-bit integer or null")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise SamplingParamError("max_tokens", self.max_tokens, "must be an integer >= 1 or null")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingParamError("top_logprobs", self.logprobs, f"must be an integer in [0, {MAX_TOP_LOGPROBS}]")
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingParamError("stop", self.stop, f"must be a tuple of at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise SamplingParamError("stop", s, f"each stop string must be 1..{MAX_STOP_CHARS} characters")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """The params of each of a request's n choices: a seeded request's choice i is seeded
    seed + i, so choice 0 is what the same request with n = 1 gives; unseeded choices
    each draw fresh entropy."""
    if params.seed is None:
        return [params] * n
    return [dataclasses.replace(params, seed=(params.seed + i) % 2**64) for i in range(n)]


def job_seed(seed: int | None) -> int:
    """The 64-bit seed a job's draws come from: the request's, or fresh OS entropy if None."""
    return (secrets.randbits(64) if seed is None else seed) % 2**64


_MASK64 = 2**64 - 1


def _splitmix64(x: int) -> int:
    """One step of SplitMix64 (Steele et al. 2014): a bijective 64-bit mix whose outputs
    pass BigCrush; used as a counter-based generator (no state to carry or replay)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_at(seed: int, position: int) -> float:
    """The uniform in [0, 1) that decides the token at `position` (its index in the
    job's token sequence, prompt included) of a job seeded `seed`.

    A pure function of (seed, position): the token a job samples at a position does not
    depend on how many draws came before it, so plain decoding and every drafter (which
    change how many positions one traversal decides, never which uniform decides each)
    sample the same text. 53 bits: the float64 mantissa.
    """
    return (_splitmix64(_splitmix64(seed % 2**64) ^ position) >> 11) * 2.0**-53


def draw(p: torch.Tensor, u: float) -> int:
    """The index a (V,) distribution `p` gives the uniform `u` by inverting its CDF (in
    float64): exactly p-distributed for a uniform u, and an entry with zero mass is never
    returned (its CDF step is empty)."""
    cdf = torch.cumsum(p.double(), dim=0)  # (V,)
    index = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
    if index >= p.shape[0]:  # u * total rounded up to the total: take the last entry with mass
        index = int(torch.nonzero(p).max())
    return index


def greedy_token(logits: torch.Tensor) -> int:
    """Argmax over the last dim of a (V,) tensor; torch.argmax returns the first maximum,
    so ties go to the lowest id (the same rule transformers' greedy search uses)."""
    return int(torch.argmax(logits, dim=-1))


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The target distribution: (..., V) logits -> (..., V) float32 probabilities.

    Order: temperature, then top-k, then top-p (nucleus) on the tempered distribution,
    then renormalise. At temperature 0 it is the one-hot of the greedy token, so
    speculative sampling at temperature 0 reduces to greedy acceptance.
    """
    logits = logits.float()
    if params.greedy:
        out = torch.zeros_like(logits)
        return out.scatter_(-1, torch.argmax(logits, dim=-1, keepdim=True), 1.0)
    scaled = logits / params.temperature  # (..., V)
    vocab = scaled.shape[-1]
    filters = 0 < params.top_k < vocab or params.top_p < 1.0
    if filters and logits.dim() == 1 and (p := _filtered_by_prefix(logits, scaled, params)) is not None:
        return p
    # One ranking for both filters, by the raw logits with ties to the lower id (stable
    # sort): the same order argmax uses, so the greedy token always survives, even when
    # float32 rounding makes its tempered probability equal to a neighbour's.
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices  # (..., V)
    if 0 < params.top_k < vocab:
        scaled = scaled.scatter(-1, order[..., params.top_k :], float("-inf"))
    p = torch.softmax(scaled, dim=-1)  # (..., V)
    if params.top_p < 1.0:
        sorted_p = p.gather(-1, order)  # (..., V), in ranking order
        # Mass strictly before each entry; keep entries whose preceding mass < top_p, i.e.
        # the smallest prefix whose mass reaches top_p. The first entry is always kept.
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < params.top_p)
        p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum(dim=-1, keepdim=True)


# The ranking's head that _filtered_by_prefix sorts first (then 8x that once, if too short).
PREFIX_START = 1024
# A prefix must reach top_p by this much more than float32 rounding of the mass before
# an entry past it could take off, for the entries past it to be surely dropped.
PREFIX_MARGIN = 1e-5


def _filtered_by_prefix(logits: torch.Tensor, scaled: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
    """`probs` for one (V,) row with top-k / top-p on, bitwise the same, without sorting the
    whole vocabulary (a stable sort of SmolLM2's 49152 logits was ~15% of the gateway's
    time at 16 sampled streams, issue 21): the entries >= the M-th largest logit are the
    full ranking's first entries, and a stable sort of them (in id order) ranks them as
    the full sort does (ties to the lower id); torch's CPU cumsum accumulates in order, so
    its prefix is the full cumsum's. None when no prefix up to a quarter of the vocabulary
    holds the top-k and reaches top_p (the caller sorts everything), or on NaN logits."""
    vocab = logits.shape[0]
    if bool(torch.isnan(logits).any()):
        return None
    m = max(PREFIX_START, params.top_k if 0 < params.top_k < vocab else 0)
    while m <= vocab // 4:
        # The m-th largest logit, ties counted (what topk(m).values.min() is): kthvalue finds
        # it in 0.28 ms against topk's 0.59 on SmolLM2's 49152 at m = 1024 (dev VM, alone);
        # a whole sampled row (top-p 0.95) 0.92-1.05 against 0.99-1.10 ms, alternated.
        threshold = torch.kthvalue(logits, vocab - m + 1).values
        ids = torch.nonzero(logits >= threshold).squeeze(1)  # every tie at the threshold too, in id order
        order = ids[torch.sort(logits[ids], descending=True, stable=True).indices]  # the full ranking's head
        masked = scaled
        if 0 < params.top_k < vocab:
            masked = torch.full_like(scaled, float("-inf"))
            masked[order[: params.top_k]] = scaled[order[: params.top_k]]
        p = torch.softmax(masked, dim=-1)
        if params.top_p >= 1.0:
            return p / p.sum(dim=-1, keepdim=True)
        sorted_p = p[order]
        cum = torch.cumsum(sorted_p, dim=-1)
        if float(cum[-1]) >= params.top_p + PREFIX_MARGIN:
            keep = torch.zeros_like(p, dtype=torch.bool)
            keep[order] = (cum - sorted_p) < params.top_p
            p = torch.where(keep, p, torch.zeros_like(p))
            return p / p.sum(dim=-1, keepdim=True)
        m *= 8
    return None


def sample(logits: torch.Tensor, params: SamplingParams, seed: int, position: int, generated: Sequence[int] = (),
           allowed: torch.Tensor | None = None) -> int:
    """The token at `position` from its (V,) logits row, after the request's penalties and
    biases for `generated` (this completion's tokens before `position`) and its grammar's
    `allowed` (V,) mask: greedy at temperature 0, else `probs` inverted at
    `uniform_at(seed, position)`. Speculative acceptance draws every row the same way
    (coordinator.spec.target.accept_round)."""
    if params.rules.active:
        logits = apply_rules(logits, params.rules, generated)
    if allowed is not None and not bool(allowed.any()):
        # Only a row below a draft token the grammar forbids allows nothing; acceptance never
        # reaches it (the row above could not choose that token), so any answer will do.
        return greedy_token(logits)
    if allowed is not None:
        logits = logits.float().masked_fill(~allowed, float("-inf"))
    if params.greedy:
        return greedy_token(logits)
    return draw(probs(logits, params), uniform_at(seed, position))
