"""fp8 packing of activations for the wire: a codec over tensors, applied outside the model.

encode_fp8 turns a float tensor (..., H) into fp8 values plus one float32 scale per row
(or one shared scale, repeated per row, for comparison); decode_fp8 inverts it. Knows
nothing of frames or messages: the stage and coordinator call it on hidden/aux tensors
and put (q, scales) into the message's `hidden`/`hidden_scale` fields.

Error bound per element. With s the row's scale (amax / fmax), v = x / s lies in
[-fmax, fmax]. An fp8 format with m mantissa bits and smallest normal 2^emin rounds to
nearest, so |rn(v) - v| <= max(2^-(m+1) |v|, 2^(emin-m-1)): half an ulp in the normal
range, half the subnormal step below it. Scaling back by s:
    |decode(encode(x)) - x| <= max(2^-(m+1) |x|, 2^(emin-m-1) s)   (+ f32 rounding, ~2^-23 |x|)
e4m3fn (m=3, emin=-6): 2^-4 |x|, floor 2^-10 s.  e5m2 (m=2, emin=-14): 2^-3 |x|, floor 2^-17 s.
So every element is within 2^-4 (e4m3fn) / 2^-3 (e5m2) of its row's amax; tests check
the tighter per-element form against torch's own fp8 rounding.
"""

from __future__ import annotations

import torch

from shard.wire.dtypes import BY_NAME, DTYPES

FORMATS = tuple(d.name.removeprefix("f8_") for d in DTYPES if d.is_fp8)  # ("e4m3fn", "e5m2")
SCALINGS = ("row", "tensor")
# Smallest positive normal float32: scales never go below it, so x / scale stays finite
# for all-zero and denormal rows alike (the row then quantises to (near) zero).
_MIN_SCALE = torch.finfo(torch.float32).tiny


def fp8_dtype(fmt: str) -> torch.dtype:
    """torch dtype for "e4m3fn" / "e5m2"; ValueError otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format must be one of {FORMATS}, got {fmt!r}")
    return BY_NAME[f"f8_{fmt}"].torch_dtype


def encode_fp8(x: torch.Tensor, fmt: str = "e4m3fn", scale: str = "row") -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise x (..., H) to fp8. Returns (q (..., H) fp8, scales (...,) float32).

    scale="row": each row's scale is its amax / fmax, so each row uses the full fp8 range.
    scale="tensor": one amax over the whole tensor, repeated per row so the wire and
    decode_fp8 see the same shapes either way.
    Raises ValueError for bad arguments or non-finite input (a model that produced
    inf/NaN should fail loudly, not ship NaN codes downstream).
    """
    if scale not in SCALINGS:
        raise ValueError(f"fp8 scale must be one of {SCALINGS}, got {scale!r}")
    dtype = fp8_dtype(fmt)
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"encode_fp8 needs a float tensor of rank >= 1, got {x.dtype} rank {x.dim()}")
    fmax = torch.finfo(dtype).max  # 448 for e4m3fn, 57344 for e5m2
    xf = x.to(torch.float32)
    if x.shape[-1] == 0:
        amax = torch.zeros(x.shape[:-1], dtype=torch.float32, device=x.device)  # (...,)
    else:
        amax = xf.abs().amax(dim=-1)  # (...,); NaN anywhere in a row makes it NaN
    if scale == "tensor":
        amax = (amax.amax() if amax.numel() else amax.new_zeros(())).expand(amax.shape)
    if not bool(torch.isfinite(amax).all()):
        raise ValueError("encode_fp8 input has inf or NaN values")
    scales = (amax / fmax).clamp_min(_MIN_SCALE).contiguous()  # (...,) float32
    # The clamp guards f32 rounding of amax / (amax / fmax) landing just above fmax,
    # which would cast to NaN in e4m3fn (it has no inf).
    q = (xf / scales.unsqueeze(-1)).clamp_(-fmax, fmax).to(dtype)  # (..., H)
    return q, scales


def decode_fp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Invert encode_fp8: q (..., H) fp8 and scales (...,) float32 -> (..., H) in `dtype`."""
    if q.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"decode_fp8 needs an fp8 tensor, got {q.dtype}")
    if scales.shape != q.shape[:-1]:
        raise ValueError(f"decode_fp8 scales shape {tuple(scales.shape)} != q rows {tuple(q.shape[:-1])}")
    return (q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)  # (..., H)
