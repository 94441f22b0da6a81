"""fp8 activation codec and the wire dtype table, checked against torch as the oracle.

The error bound (derived in shard/wire/fp8.py's docstring): an fp8 format with m mantissa
bits and smallest normal 2^emin rounds v = x / s to nearest, so per element
    |decode(encode(x)) - x| <= max(2^-(m+1) |x|, 2^(emin-m-1) s)  (+ f32 rounding).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.wire.dtypes import BY_NAME, BY_TORCH, DTYPES, FLOAT_NAMES, ITEMSIZE, wire_bytes_per_token, wire_name
from shard.wire.fp8 import decode_fp8, encode_fp8, fp8_dtype

# fmt -> (mantissa bits m, emin): the constants the bound is derived from.
FORMAT_FACTS = {"e4m3fn": (3, -6), "e5m2": (2, -14)}


def _representable(fmt: str) -> torch.Tensor:
    """Every finite value of the fp8 format, sorted, as float64: the rounding oracle."""
    codes = torch.arange(256, dtype=torch.uint8).view(fp8_dtype(fmt)).to(torch.float64)
    return codes[torch.isfinite(codes)].unique().sort().values


def _bound(fmt: str, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    m, emin = FORMAT_FACTS[fmt]
    ax = x.to(torch.float64).abs()
    s = scales.to(torch.float64).unsqueeze(-1)
    # 2^-21 |x| covers the two f32 roundings (x / s and q * s), each <= 2^-24 relative.
    return torch.maximum(2.0 ** -(m + 1) * ax, 2.0 ** (emin - m - 1) * s) + 2.0**-21 * ax


@st.composite
def activations(draw):
    """(T, H) float32 with rows of wildly different magnitudes, some zero, some tiny."""
    rows, width = draw(st.integers(1, 6)), draw(st.integers(1, 48))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    x = torch.randn(rows, width, generator=g, dtype=torch.float64)
    exps = torch.tensor(draw(st.lists(st.integers(-40, 40), min_size=rows, max_size=rows)), dtype=torch.float64)
    x = x * torch.pow(2.0, exps).unsqueeze(-1)  # (T, H)
    if draw(st.booleans()):
        x[draw(st.integers(0, rows - 1))] = 0.0
    return x.to(torch.float32)


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@settings(max_examples=80, deadline=None)
@given(x=activations())
def test_row_scaling_rounds_to_nearest_and_meets_bound(fmt, x):
    # Bug guarded: wrong scale (not amax/fmax), truncation instead of round-to-nearest, or
    # NaN codes from values just above fmax. Sound: the oracle enumerates all 256 fp8 codes
    # and checks the chosen one is a nearest value to x / s; the bound is then implied.
    q, scales = encode_fp8(x, fmt=fmt, scale="row")
    assert q.dtype == fp8_dtype(fmt) and scales.dtype == torch.float32 and scales.shape == x.shape[:-1]
    v = x.to(torch.float64) / scales.to(torch.float64).unsqueeze(-1)  # (T, H) exact-ish scaled
    grid = _representable(fmt)
    nearest_err = (v.unsqueeze(-1) - grid).abs().min(dim=-1).values  # (T, H)
    chosen_err = (q.to(torch.float64) - v).abs()
    assert torch.all(chosen_err <= nearest_err + 1e-6 * v.abs() + 1e-30)
    assert torch.equal(q.view(torch.uint8), (x / scales.unsqueeze(-1)).to(fp8_dtype(fmt)).view(torch.uint8))
    # Every non-zero row uses the full range: its amax lands exactly on +-fmax.
    fmax = torch.finfo(fp8_dtype(fmt)).max
    nonzero = x.abs().amax(dim=-1) > 0
    assert torch.all(q.to(torch.float32).abs().amax(dim=-1)[nonzero] == fmax)
    err = (decode_fp8(q, scales).to(torch.float64) - x.to(torch.float64)).abs()
    assert torch.all(err <= _bound(fmt, x, scales))


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_per_row_scaling_keeps_small_rows_per_tensor_flushes_them(fmt):
    # Bug guarded: "row" silently behaving like "tensor". A row 2^-40 smaller than its
    # neighbour is below either format's range (e4m3fn ~2^18, e5m2 ~2^32 from max to the
    # smallest subnormal) under one shared scale, but kept to f32 rounding per row.
    x = torch.tensor([[1.0, -0.5, 0.25], [2.0**-40, 2.0**-41, -(2.0**-42)]])
    row_q, row_s = encode_fp8(x, fmt=fmt, scale="row")
    ten_q, ten_s = encode_fp8(x, fmt=fmt, scale="tensor")
    assert torch.all(ten_s == ten_s[0])
    # Powers of two within a row's range are fp8 values: only the f32 scale rounds.
    assert torch.allclose(decode_fp8(row_q, row_s), x, rtol=2**-20, atol=0)
    assert torch.all(decode_fp8(ten_q, ten_s)[1] == 0)


def test_zero_and_denormal_rows_stay_finite():
    # Bug guarded: scale 0 for an all-zero row gives 0/0 = NaN codes on the wire.
    x = torch.tensor([[0.0, 0.0], [1e-42, -1e-42], [3.0, 0.0]])
    for fmt in ("e4m3fn", "e5m2"):
        q, s = encode_fp8(x, fmt=fmt)
        y = decode_fp8(q, s)
        assert torch.all(torch.isfinite(y)) and torch.all(s > 0)
        assert torch.equal(y[0], torch.zeros(2)) and y[2, 0] == 3.0


def test_non_finite_input_and_bad_arguments_raise():
    with pytest.raises(ValueError, match="inf or NaN"):
        encode_fp8(torch.tensor([[1.0, float("inf")]]))
    with pytest.raises(ValueError, match="inf or NaN"):
        encode_fp8(torch.tensor([[float("nan"), 1.0]]))
    with pytest.raises(ValueError, match="fp8 format"):
        encode_fp8(torch.ones(2, 2), fmt="e3m4")
    with pytest.raises(ValueError, match="fp8 scale"):
        encode_fp8(torch.ones(2, 2), scale="block")
    with pytest.raises(ValueError, match="scales shape"):
        q, s = encode_fp8(torch.ones(2, 2))
        decode_fp8(q, s[:1])


def test_half_precision_inputs_and_outputs():
    # Bug guarded: quantising bf16 directly (x / s in bf16 loses bits before fp8 does).
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, s = encode_fp8(x)
    y = decode_fp8(q, s, dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    xf = x.to(torch.float32)
    # bf16 output adds at most 2^-9 relative on top of the fp8 bound.
    assert torch.all((y.to(torch.float32) - xf).abs() <= _bound("e4m3fn", xf, s) * (1 + 2**-8) + 2**-9 * xf.abs())


def test_dtype_table_is_consistent_with_torch():
    # Bug guarded: a hand-edited itemsize or a derived map drifting from the table.
    names = [d.name for d in DTYPES]
    assert len(set(names)) == len(names) and len({d.torch_dtype for d in DTYPES}) == len(DTYPES)
    for d in DTYPES:
        assert torch.empty((), dtype=d.torch_dtype).element_size() == d.itemsize == ITEMSIZE[d.name]
        assert BY_NAME[d.name] is d and BY_TORCH[d.torch_dtype] is d and wire_name(d.torch_dtype) == d.name
        assert d.is_float == d.torch_dtype.is_floating_point
    with pytest.raises(ValueError, match="cannot go on the wire"):
        wire_name(torch.float64)


def test_wire_bytes_per_token():
    assert wire_bytes_per_token(576, "f32") == 4 * 576
    assert wire_bytes_per_token(576, "bf16") == wire_bytes_per_token(576, "f16") == 2 * 576
    assert wire_bytes_per_token(576, "f8_e4m3fn") == wire_bytes_per_token(576, "f8_e5m2") == 576 + 4
    with pytest.raises(ValueError):
        wire_bytes_per_token(576, "i64")
    assert FLOAT_NAMES == {"f32", "f16", "bf16", "f8_e4m3fn", "f8_e5m2"}
    assert math.isclose(wire_bytes_per_token(576, "f32") / wire_bytes_per_token(576, "f8_e4m3fn"), 2304 / 580)
