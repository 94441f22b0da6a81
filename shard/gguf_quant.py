"""A GGUF's quantised blocks as shard.quant's layouts, read from their bytes, never through f32 weights.

Q4_0, Q4_1 and Q4_K hold 4-bit values with a scale (and a min) per 32 inputs, which is
int4 with groups of 32 (w = (q - 8) s + z) once (s, z) are rewritten from the block's:
    Q4_0  w = d (q - 8)             s = d,          z = 0
    Q4_1  w = d q + m               s = d,          z = m + 8 d
    Q4_K  w = d sc_j q - dmin m_j   s = d sc_j,     z = 8 s - dmin m_j   (sub-block j of 8 in 256)
The nibbles are taken as they are. Q8_0 holds int8 with a scale per 32 inputs, which
per-channel int8 cannot hold, so its rows are requantised per channel (one more rounding,
of at most half an int8 step of the row).
Layouts follow ggml (ggml-quants.c): little-endian f16 scales first, then the values;
Q4_0/Q4_1 keep inputs 0-15 of a block in the low nibbles and 16-31 in the high ones; Q4_K
keeps each 64 inputs as 32 bytes, the first 32 inputs low, the next 32 high.
Knows nothing of tensor names, stores or stages (gguf's own dequantize is the test oracle).
"""

from __future__ import annotations

import numpy as np
import torch

from shard.quant import Int4Linear, Int8Linear, QuantError

GROUP = 32  # inputs per scale in every 4-bit block type here
# ggml type name -> (inputs per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    """(N, K/B, bytes per block) uint8 view of a tensor's raw bytes."""
    per, size = BLOCKS[kind]
    n, k = shape
    if k % per or raw.size != n * (k // per) * size:
        raise QuantError(f"{kind} tensor bytes for shape {shape}", n * (k // per) * size, raw.size)
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, nb)


def _split_nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return qs & 0x0F, qs >> 4


def int4_grid(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles (N, K) uint8, scales (N, K/32) f32, zeros (N, K/32) f32) of a Q4_0/Q4_1/Q4_K tensor."""
    if kind not in INT4_TYPES:
        raise QuantError("4-bit GGUF block type", INT4_TYPES, kind)
    b = _blocks(raw, kind, shape)
    n, nb = b.shape[:2]
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        start = 2 if kind == "Q4_0" else 4
        lo, hi = _split_nibbles(b[..., start:start + 16])
        q = np.concatenate([lo, hi], axis=-1)  # (N, nb, 32)
        zeros = np.zeros_like(d) if kind == "Q4_0" else _f16(b, 2) + 8 * d
        return torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(d), torch.from_numpy(zeros)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc_bytes, qs = b[..., 4:16].astype(np.int32), b[..., 16:144]  # (N, nb, 12), (N, nb, 128)
    sc = np.empty((n, nb, 8), np.int32)
    mn = np.empty((n, nb, 8), np.int32)
    sc[..., :4], mn[..., :4] = sc_bytes[..., 0:4] & 63, sc_bytes[..., 4:8] & 63
    sc[..., 4:] = (sc_bytes[..., 8:12] & 0x0F) | ((sc_bytes[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (sc_bytes[..., 8:12] >> 4) | ((sc_bytes[..., 4:8] >> 6) << 4)
    lo, hi = _split_nibbles(qs.reshape(n, nb, 4, 32))  # per 64 inputs: low nibbles first
    q = np.stack([lo, hi], axis=3).reshape(n, nb * 256)  # (N, K)
    scales = d[..., None] * sc.astype(np.float32)  # (N, nb, 8)
    zeros = 8 * scales - dmin[..., None] * mn.astype(np.float32)
    return torch.from_numpy(q), torch.from_numpy(scales.reshape(n, -1)), torch.from_numpy(zeros.reshape(n, -1))


def linear_from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int], device: torch.device | str = "cpu"):
    """The shard.quant linear holding a GGUF tensor of ggml type `kind`: Int4Linear (groups
    of 32) for Q4_0/Q4_1/Q4_K, Int8Linear (per channel) for Q8_0."""
    if kind in INT4_TYPES:
        nibbles, scales, zeros = int4_grid(raw, kind, shape)
        return Int4Linear.from_grid(nibbles, scales, zeros, device=device)
    if kind == "Q8_0":
        b = _blocks(raw, kind, shape)
        d, q = _f16(b, 0), b[..., 2:34].copy().view(np.int8).astype(np.float32)  # (N, nb), (N, nb, 32)
        rows = torch.from_numpy((q * d[..., None]).reshape(shape[0], -1))  # one row block at a time in a store
        return Int8Linear(rows.to(device))
    raise QuantError("GGUF block type", tuple(BLOCKS), kind)
