"""`x @ W.T (+ b)` with a fixed weight, in the layout its device multiplies fastest.

A stage's frames are short: one row per decode step, a few to a few dozen rows per verify
frame. On a CPU, torch's default f32 path (MKL) runs a 2- or 3-row product as that many
matrix-vector passes over the weight, so a 3-row verify frame of SmolLM2 costs 1.9x a
1-row one although the weights (the memory traffic) are the same. oneDNN, with the weight
reordered once at load into its blocked layout (what torch's own CPU compiler does for
frozen weights), reads the weight once for such a frame: measured on the 2-core dev VM
(AVX2, 1 thread), a full-model SmolLM2 frame of 1 / 3 / 8 rows took 40 / 74 / 80 ms with
MKL and 41 / 50 / 64 ms reordered (docs/benchmarks.md, bench_stage). The reorder replaces
the weight (no second copy). Elsewhere (GPU, non-f32 weights, a torch without oneDNN) the
weight stays as it is and `F.linear` runs.

Knows nothing of layers or models: callers hand it a weight, then rows.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# oneDNN chooses its blocked layout for an expected row count; 4 ran best on the dev VM
# across 2..32-row frames (a 1-row hint made every multi-row frame slower than MKL).
PACK_HINT_ROWS = 4


@functools.cache
def onednn_packing_works() -> bool:
    """Whether this torch build reorders and multiplies f32 weights with oneDNN, checked
    once on a small product against F.linear (internal ops: a build without them, or whose
    results disagree, keeps the plain path)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(16, 8), torch.randn(3, 8)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(y, F.linear(x, w), rtol=1e-5, atol=1e-5))


def lone_row_differs(packed: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> bool:
    """Whether oneDNN's product of one row with this packed weight differs from the same
    row's in a multi-row product. It multiplies a lone row on another kernel, and for long
    inner dimensions (on the dev VM: SmolLM2's 1536-wide down projection, not its 576-wide
    ones) the sums differ in the last bits, while a row's result is the same in every
    multi-row product. Such a weight runs a lone row as two, so a job's states do not
    depend on whether its frame shared the forward with other jobs' (issue 21); the weight
    is read once either way (measured: +12 us on a 59 us down projection, < 1% of a decode
    forward). Checked once per weight on two fixed random rows."""
    x = torch.randn(2, in_features, generator=torch.Generator().manual_seed(0))  # (2, in)
    both = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    alone = torch.ops.mkldnn._linear_pointwise(x[:1].contiguous(), packed, bias, "none", [], "")
    return not torch.equal(both[:1], alone)


class Linear:
    """y (..., out) = x (..., in) @ weight.T + bias, for a weight fixed at construction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack and weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_packing_works()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS) if self.packed else weight
        self.lone_row_as_two = self.packed and lone_row_differs(self.weight, self.bias, self.in_features)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # oneDNN takes a (T, in) matrix
        if rows.shape[0] == 0:  # and at least one row
            return x.new_zeros(*x.shape[:-1], self.out_features)
        twice = rows.shape[0] == 1 and self.lone_row_as_two  # see lone_row_differs
        y = torch.ops.mkldnn._linear_pointwise((rows.expand(2, -1) if twice else rows).contiguous(), self.weight,
                                               self.bias, "none", [], "")
        y = y[:1] if twice else y  # (T, out)
        return y.reshape(*x.shape[:-1], self.out_features)
