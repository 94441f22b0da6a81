"""shard.gguf_quant: a GGUF's Q4_0 / Q4_1 / Q4_K / Q8_0 blocks as our int4 / int8 linears.

Guards the byte layouts (f16 scales at the block's start, which nibble holds which input,
Q4_K's 6-bit packed scales and mins) and the rewrite of each block's (d, m) into our
(s, z): a nibble order or a scale index off by one gives weights nowhere near gguf's own
dequantisation, the oracle here. Bounds: the grid itself is exact (f32 rounding); the
linear stores s and z in bf16, so each weight may move by (8 |s| + |z|) 2^-8; Q8_0 is
requantised per channel, so by half an int8 step of its row.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from shard.gguf_quant import BLOCKS, int4_grid, linear_from_gguf
from shard.quant import Int4Linear, Int8Linear, QuantError
from shard.sources import locate_alias

U = 2.0 ** -8  # bf16's unit roundoff
N, K = 48, 512


def blocks(kind: str, seed: int = 0) -> np.ndarray:
    """(N, bytes) raw blocks of `kind`: gguf's own quantiser where it has one, else (Q4_K)
    random bytes with finite positive f16 scales (every bit pattern of the rest is valid)."""
    rng = np.random.default_rng(seed)
    if kind != "Q4_K":
        return quants.quantize(rng.standard_normal((N, K)).astype(np.float32), GGMLQuantizationType[kind])
    raw = rng.integers(0, 256, (N, K // 256, 144), dtype=np.uint8)
    for at in (0, 2):  # d, dmin
        raw[..., at:at + 2] = (rng.random((N, K // 256)) * 0.01).astype(np.float16).view(np.uint8).reshape(N, -1, 2)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_4bit_blocks_are_our_int4_grid(kind):
    raw = blocks(kind)
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType[kind]))
    q, s, z = int4_grid(raw, kind, (N, K))
    assert q.shape == (N, K) and int(q.max()) <= 15 and s.shape == z.shape == (N, K // 32)
    grid = ((q.float().reshape(N, -1, 32) - 8) * s[..., None] + z[..., None]).reshape(N, K)
    torch.testing.assert_close(grid, want, rtol=0, atol=1e-6 * float(want.abs().max()))
    lin = linear_from_gguf(raw, kind, (N, K))
    assert isinstance(lin, Int4Linear) and lin.group_size == 32
    slack = ((8 * s.abs() + z.abs()) * U).repeat_interleave(32, dim=1) * 1.01 + 1e-7
    assert ((lin.dequantised() - want).abs() <= slack).all()


def test_q8_0_is_requantised_per_channel_within_half_a_step():
    raw = blocks("Q8_0")
    want = torch.from_numpy(quants.dequantize(raw, GGMLQuantizationType.Q8_0))
    lin = linear_from_gguf(raw, "Q8_0", (N, K))
    assert isinstance(lin, Int8Linear)
    assert ((lin.dequantised() - want).abs() <= lin.scales.float()[:, None] / 2 * 1.001 + 1e-7).all()


def test_wrong_sizes_and_types_are_refused_by_name():
    raw = blocks("Q4_1")
    with pytest.raises(QuantError, match=r"Q4_1 tensor bytes for shape \(48, 256\)"):
        int4_grid(raw, "Q4_1", (N, 256))
    with pytest.raises(QuantError, match="GGUF block type"):
        linear_from_gguf(raw, "Q6_K", (N, K))
    assert set(BLOCKS) >= {"Q4_0", "Q4_1", "Q4_K", "Q8_0"}


def test_the_default_models_q4_1_tensors_keep_their_grid():
    """The shipped SmolLM2 GGUF is Q4_1: one of its layer tensors, read from the file's
    bytes, multiplies as gguf dequantises it (ggml's shape order is (K, N): reversed)."""
    reader = GGUFReader(str(locate_alias("smollm2-135m")))
    t = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert t.tensor_type == GGMLQuantizationType.Q4_1
    shape = tuple(int(v) for v in reversed(t.shape))
    want = torch.from_numpy(quants.dequantize(t.data, t.tensor_type)).reshape(shape)
    q, s, z = int4_grid(t.data, "Q4_1", shape)
    lin = Int4Linear.from_grid(q, s, z)
    slack = ((8 * s.abs() + z.abs()) * U).repeat_interleave(32, dim=1) * 1.01 + 1e-7
    assert ((lin.dequantised() - want).abs() <= slack).all()
