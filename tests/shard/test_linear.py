"""shard.linear: a weight reordered for oneDNN multiplies like F.linear on the plain one.

Guards the stage's matmuls (every layer's q/k/v, o, gate/up, down and the LM head go
through `Linear`): a reordered weight read in the wrong layout, a dropped bias, a
non-contiguous input read as contiguous, or an empty frame would all give wrong hidden
states. The oracle is F.linear on the same weight, to f32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from shard.linear import MAX_PRODUCT_ROWS, ROW_BUCKETS, Linear, bucket_rows, onednn_packing_works


def test_this_torch_build_packs_f32_weights_for_onednn():
    # The pinned CPU torch (2.13) has the reorder; if a build stops having it the stage
    # silently falls back to the slower layout, which this makes visible.
    assert onednn_packing_works()
    assert Linear(torch.randn(8, 4)).packed


@settings(max_examples=40, deadline=None)
@given(out_features=st.integers(1, 300), in_features=st.integers(1, 200), rows=st.integers(0, 70),
       with_bias=st.booleans(), transposed_input=st.booleans(), seed=st.integers(0, 2**16))
def test_packed_linear_equals_f_linear(out_features, in_features, rows, with_bias, transposed_input, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g) if with_bias else None
    # A transposed view has the right shape but strides a contiguous read would misread.
    x = torch.randn(in_features, rows, generator=g).t() if transposed_input else torch.randn(rows, in_features, generator=g)
    want = F.linear(x, w, b)
    got = Linear(w.clone(), None if b is None else b.clone())(x)
    assert got.shape == (rows, out_features)
    scale = want.abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5 * max(scale, 1.0))


def test_other_dtypes_and_pack_false_keep_the_plain_weight():
    w = torch.randn(16, 8)
    x = torch.randn(3, 8)
    plain = Linear(w, pack=False)
    assert not plain.packed and plain.weight is w
    assert torch.equal(plain(x), F.linear(x, w))
    half = Linear(w.bfloat16())
    assert not half.packed
    assert torch.equal(half(x.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))


def test_leading_dimensions_pass_through():
    # The EAGLE head's functions take (..., T, in) batches; a packed weight must multiply
    # them like F.linear does, empty ones included.
    w, b = torch.randn(12, 8), torch.randn(12)
    packed = Linear(w.clone(), b.clone())
    for shape in ((2, 5, 8), (3, 0, 8), (1, 1, 1, 8)):
        x = torch.randn(shape)
        got = packed(x)
        assert got.shape == (*shape[:-1], 12)
        torch.testing.assert_close(got, F.linear(x, w, b), rtol=0, atol=1e-5)


def test_a_row_alone_equals_the_same_row_in_any_multi_row_product():
    # Bug guarded (issue 21): oneDNN multiplies a lone row on another kernel, whose sums
    # over a long inner dimension (SmolLM2's 1536-wide down projection) differ in the last
    # bits from the same row's in a 2..32-row product, so a job's logits moved by ~1e-4
    # depending on whether its decode row shared a forward with other jobs'. Sound: bitwise
    # equality over every row position and batch size; 576 is a width that never differed.
    g = torch.Generator().manual_seed(0)
    for in_features in (576, 1536, 4096):
        lin = Linear(torch.randn(384, in_features, generator=g), torch.randn(384, generator=g))
        x = torch.randn(32, in_features, generator=g) * 10
        for rows in (2, 3, 16, 32):
            many = lin(x[:rows])
            for i in range(rows):
                assert torch.equal(lin(x[i:i + 1])[0], many[i]), (in_features, rows, i)
        assert torch.equal(lin(x[0]), many[0])  # a 1-D row too


def test_row_counts_map_to_the_least_bucket_holding_them():
    # A fixed, small set (what bounds the kernels a process builds, issue 20): 1..8 as
    # they are, then at most 1, 3 and 7 rows of padding up to 16, 64 and 128.
    assert list(ROW_BUCKETS) == sorted(set(ROW_BUCKETS)) and len(ROW_BUCKETS) == 32
    assert ROW_BUCKETS[:8] == tuple(range(1, 9)) and MAX_PRODUCT_ROWS == ROW_BUCKETS[-1] == 128
    for rows in range(1, MAX_PRODUCT_ROWS + 1):
        b = bucket_rows(rows)
        assert b in ROW_BUCKETS and b >= rows and not any(rows <= c < b for c in ROW_BUCKETS), rows
        assert b - rows <= (0 if rows <= 8 else 1 if rows <= 16 else 3 if rows <= 64 else 7), rows
    assert [bucket_rows(r) for r in (1, 8, 9, 12, 13, 17, 64, 65, 127)] == [1, 8, 10, 12, 14, 20, 64, 72, 128]
    for bad in (0, -1, MAX_PRODUCT_ROWS + 1):
        with pytest.raises(ValueError, match="1 to 128 rows"):
            bucket_rows(bad)


@pytest.mark.slow
def test_padded_products_equal_the_unpadded_ones_bitwise_on_smollm2_shapes():
    # Bug guarded: padding a product's rows to its bucket (or splitting past 128 rows)
    # must not move a single bit, or a job's states would depend on the other jobs in its
    # batch. Sound: every row count 1..130, 200 and 300 through SmolLM2's four layer shapes
    # and its LM head (fewer counts), against oneDNN's product of exactly those rows; a lone
    # row against its 2-row product where the weight runs a lone row as two.
    g = torch.Generator().manual_seed(5)
    every = (*range(1, 131), 200, 300)
    for (out_f, in_f), counts in (((960, 576), every), ((576, 576), every),
                                  ((3072, 576), every), ((576, 1536), every),
                                  ((49152, 576), (1, 2, 3, 9, 13, 70, 129, 200))):
        lin = Linear(torch.randn(out_f, in_f, generator=g) * 0.05)
        x = torch.randn(max(counts) + 1, in_f, generator=g) * 10
        for rows in counts:
            exact = x[:max(rows, 2)] if lin.lone_row_as_two else x[:rows]
            want = torch.ops.mkldnn._linear_pointwise(exact.contiguous(), lin.weight, None, "none", [], "")[:rows]
            assert torch.equal(lin(x[:rows]), want), (out_f, in_f, rows)
