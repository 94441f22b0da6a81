"""Tensor shape rules the wire's messages share: token counts, activations and their fp8
scales, positions within the model's context. Each raises WireError naming the tensor, what
was expected and what came; none allocates. Knows nothing of message kinds or framing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shard.errors import WireError
from shard.wire.dtypes import BY_TORCH, FP8_NAMES
from shard.wire.limits import Limits


def fail_shape(name: str, expected: object, t: torch.Tensor) -> WireError:
    return WireError(f"tensor '{name}' shape", expected, list(t.shape))


def check_tokens_dim(name: str, t: torch.Tensor, limits: Limits) -> int:
    """T of a (T,) or (T, ...) tensor, checked to be in [1, max_tokens_per_frame]."""
    if t.dim() < 1:
        raise fail_shape(name, "rank >= 1", t)
    n = t.shape[0]
    if not (1 <= n <= limits.max_tokens_per_frame):
        raise WireError(f"tensor '{name}' tokens", limits.max_tokens_per_frame, n)
    return n


def check_vector(name: str, t: torch.Tensor | None, n: int) -> None:
    if t is not None and tuple(t.shape) != (n,):
        raise fail_shape(name, [n], t)


def check_nonnegative(name: str, t: torch.Tensor | None) -> None:
    if t is not None and t.numel() and int(t.min()) < 0:
        raise WireError(f"tensor '{name}' values", ">= 0", int(t.min()))


def check_activations(name: str, t: torch.Tensor | None, scale: torch.Tensor | None, n: int, limits: Limits, *, multiple: bool) -> None:
    """t is (n, H) for hidden or (n, k*H), k >= 1, for aux; fp8 rows need a (n,) f32 scale."""
    scale_name = f"{name}_scale"
    if t is None:
        if scale is not None:
            raise WireError(f"tensor '{scale_name}' without '{name}'")
        return
    h = limits.hidden_size
    expected = [n, ("k*H" if h is None else f"k*{h}") if multiple else ("H" if h is None else h)]
    if t.dim() != 2 or t.shape[0] != n:
        raise fail_shape(name, expected, t)
    if h is not None:
        width = t.shape[1]
        bad_width = (width == 0 or width % h != 0) if multiple else width != h
        if bad_width:
            raise fail_shape(name, expected, t)
    is_fp8 = BY_TORCH[t.dtype].name in FP8_NAMES
    if is_fp8 and scale is None:
        raise WireError(f"tensor '{scale_name}' missing for fp8 '{name}'")
    if not is_fp8 and scale is not None:
        raise WireError(f"tensor '{scale_name}' with non-fp8 '{name}'")
    check_vector(scale_name, scale, n)


def check_context(positions: torch.Tensor, ctx_len: int, want_aux_layers: Sequence[int], limits: Limits) -> None:
    """A Forward's positions below the model's context, ctx_len within it, aux layers inside the model."""
    ctx = limits.max_context_tokens
    if ctx is not None:
        top = int(positions.max())
        if top >= ctx:
            raise WireError("tensor 'positions' values", f"< {ctx} (the model's context)", top)
        if ctx_len > ctx:
            raise WireError("field 'ctx_len'", f"<= {ctx} (the model's context)", ctx_len)
    if limits.num_layers is not None:
        bad = [layer for layer in want_aux_layers if layer >= limits.num_layers]
        if bad:
            raise WireError("field 'want_aux_layers' values", f"< {limits.num_layers} (the model's layers)", bad[0])
