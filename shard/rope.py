"""Rotary position embeddings: inverse frequencies per rope type, and cos/sin tables.

Knows the rope variants the supported families' configs use (default, linear, llama3,
yarn, Phi-3's longrope). Does not know layers, caches or the wire. Maths follows each variant's paper / reference
config semantics so our stage matches transformers to fp32 rounding.
"""

from __future__ import annotations

import math

import torch

from shard.arch import ModelConfig
from shard.errors import PositionError
from shard.errors import UnsupportedModelError


def inverse_frequencies(cfg: ModelConfig, *, long: bool = False) -> tuple[torch.Tensor, float]:
    """Return (inv_freq (head_dim/2,) f32, attention_scale) for the config's rope type;
    `long` picks longrope's long-context factors."""
    dim = cfg.head_dim
    base = cfg.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # (D/2,)
    kind = cfg.rope_type
    if kind == "default":
        return inv_freq, 1.0
    if kind == "longrope":
        return _longrope(cfg, long)
    factor = cfg.rope_param("factor")
    if kind == "linear":
        # Positions are divided by `factor`, which is the same as dividing frequencies.
        return inv_freq / factor, 1.0
    orig_max = cfg.rope_param("original_max_position_embeddings", float(cfg.max_position_embeddings))
    if kind == "llama3":
        # Llama 3.1: long wavelengths are interpolated by `factor`, short ones kept, and the
        # band between is blended linearly in 1/wavelength.
        low = cfg.rope_param("low_freq_factor")
        high = cfg.rope_param("high_freq_factor")
        low_wavelen, high_wavelen = orig_max / low, orig_max / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (orig_max / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled), 1.0
    if kind == "yarn":
        return _yarn(cfg, inv_freq, factor, orig_max)
    raise ValueError(f"rope_type {kind!r} reached the runtime unchecked")


def _yarn(cfg: ModelConfig, inv_freq: torch.Tensor, factor: float, orig_max: float) -> tuple[torch.Tensor, float]:
    # YaRN: dimensions that rotate many times within the original context extrapolate,
    # slow ones interpolate by `factor`, with a linear ramp between; attention logits are
    # rescaled by 0.1 ln(factor) + 1 (applied to cos and sin, as the reference does).
    dim = cfg.head_dim
    base = cfg.rope_theta
    beta_fast = cfg.rope_param("beta_fast", 32.0)
    beta_slow = cfg.rope_param("beta_slow", 1.0)
    attention_scale = cfg.rope_param("attention_factor", 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig_max / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    interpolated = inv_freq / factor
    return interpolated * (1 - extrapolation_weight) + inv_freq * extrapolation_weight, attention_scale


def _longrope(cfg: ModelConfig, long: bool) -> tuple[torch.Tensor, float]:
    # LongRoPE (Phi-3): a rescale factor per frequency, short ones within the original
    # context and long ones past it; attention logits grow by sqrt(1 + ln(s) / ln(orig))
    # for the context extension s = max_position_embeddings / orig (applied to cos and sin).
    dim = cfg.head_dim
    orig_max = cfg.rope_param("original_max_position_embeddings")
    factor = cfg.rope_param("factor", cfg.max_position_embeddings / orig_max)
    default_scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig_max))
    attention_scale = cfg.rope_param("attention_factor", default_scale)
    ext = torch.tensor(cfg.rope_factors("long_factor" if long else "short_factor"), dtype=torch.float32)  # (D/2,)
    if ext.shape != (dim // 2,):
        raise UnsupportedModelError("length of longrope factors", ext.shape[0], dim // 2)
    return 1.0 / (ext * cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), attention_scale


class RotaryTable:
    """cos/sin for positions [0, capacity), grown on demand; indexed by absolute position.
    Never grown past the model's max_position_embeddings: a position there raises
    PositionError before anything is allocated (a peer's 2^40 once asked for 4.4 TB)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", *,
                 long: bool = False) -> None:
        self.inv_freq, self.scale = inverse_frequencies(cfg, long=long)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_positions = cfg.max_position_embeddings
        self.cos = torch.empty(0, cfg.head_dim, dtype=dtype, device=self.device)
        self.sin = self.cos
        # LongRoPE switches to its long factors for a whole frame once the frame reaches
        # past the original context: per forward, as transformers and vLLM do, so a frame
        # matches their forward over the same positions (earlier frames keep their keys).
        self.long: RotaryTable | None = None
        if cfg.rope_type == "longrope" and not long:
            self.long = RotaryTable(cfg, dtype, device, long=True)
            self.long_from = int(cfg.rope_param("original_max_position_embeddings"))

    def _grow(self, need: int) -> None:
        """Make positions [0, need) addressable, doubling, up to max_positions."""
        if need > self.max_positions:
            raise PositionError(self.max_positions, need - 1)
        capacity = min(max(need, 2 * self.cos.shape[0], 256), self.max_positions)
        pos = torch.arange(capacity, dtype=torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # (P, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
        self.cos = (emb.cos() * self.scale).to(self.dtype).to(self.device)
        self.sin = (emb.sin() * self.scale).to(self.dtype).to(self.device)

    def lookup(self, positions: torch.Tensor, reach: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (T,) int -> cos, sin each (T, D). `reach`: the end of the frame these
        positions are a piece of (longrope picks its factors by the whole frame's)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if self.long is not None and max(need, reach) > self.long_from:
            return self.long.lookup(positions)
        if need > self.cos.shape[0]:
            self._grow(need)
        idx = positions.to(self.device, torch.long)
        return self.cos[idx], self.sin[idx]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (heads, T, D); cos/sin (T, D). Rotates pairs (i, i + D/2), as Llama checkpoints expect."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
