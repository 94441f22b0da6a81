"""Hidden states to and from the wire dtype: a codec applied at a stage's edges.

f32/f16/bf16 are plain casts; fp8 packs each row with its own f32 scale (shard.wire.fp8).
The stage forward never sees any of this. Knows nothing of messages or peers.
"""

from __future__ import annotations

import torch

from shard.wire.dtypes import ACTIVATION_NAMES, BY_NAME
from shard.wire.fp8 import decode_fp8, encode_fp8


def to_wire(h: torch.Tensor, wire_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """h (T, W) in any float dtype -> (tensor in wire dtype, per-row f32 scales or None)."""
    if wire_dtype not in ACTIVATION_NAMES:
        raise ValueError(f"wire dtype must be one of {ACTIVATION_NAMES}, got {wire_dtype!r}")
    row = BY_NAME[wire_dtype]
    if row.is_fp8:
        q, scales = encode_fp8(h, fmt=wire_dtype.removeprefix("f8_"), scale="row")
        return q.contiguous(), scales
    return h.to(row.torch_dtype).contiguous(), None


def from_wire(t: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of to_wire, into the receiver's compute dtype."""
    if scales is not None:
        return decode_fp8(t, scales, dtype)
    return t.to(dtype)
