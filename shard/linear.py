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


class Linear:
    """y (..., out) = x (..., in) @ weight.T + bias, for a weight fixed at construction."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pack: bool = True) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.packed = pack and weight.device.type == "cpu" and weight.dtype == torch.float32 and onednn_packing_works()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_HINT_ROWS) if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # oneDNN takes a (T, in) matrix
        if rows.shape[0] == 0:  # and at least one row
            return x.new_zeros(*x.shape[:-1], self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), self.weight, self.bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.out_features)
