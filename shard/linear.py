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

oneDNN builds (JIT) and caches a kernel for each row count and weight shape, ~0.45 MB
each, and torch offers no call that frees them (shard.heap caps the caches at 256): ragged
batches and hostile frames with every row count from 1 to 800 kept a node 20-40 MB above
its baseline for good (issue 20). So a packed product runs on a fixed set of row counts,
ROW_BUCKETS: the rows are padded with zeros up to the next bucket and the padding's output
dropped, and more rows than the largest bucket run in pieces of it. A row's result is
bitwise the same in every product of two or more rows (checked on SmolLM2's five weight
shapes, 2..600 rows), so padding changes no result. Each shape's buckets are built once
per process when its first Linear is made (warm_buckets), so a node's kernels are all there
from the start and nothing later adds any.

Knows nothing of layers or models: callers hand it a weight, then rows.
"""

from __future__ import annotations

import bisect
import functools

import torch
import torch.nn.functional as F

# oneDNN chooses its blocked layout for an expected row count; 4 ran best on the dev VM
# across 2..32-row frames (a 1-row hint made every multi-row frame slower than MKL).
PACK_HINT_ROWS = 4


# The row counts a packed product runs at: 1 to 8 as they are (a product's cost there is
# mostly reading the weight), then every 2nd to 16, every 4th to 64 and every 8th to 128
# (past 8 rows the cost grows with the rows, ~30 us a row for one SmolLM2 layer's four
# products on the dev VM, 1 thread); more rows run in pieces of 128 (as fast as one
# product: 4 x 128 rows took 19.7 ms, 512 rows 19.6 ms). Measured on a 10-layer SmolLM2
# stage at load 7-10 (the rows of the padding cost what rows do): a 9-, 13- or 17-row frame
# padded to 12/16/20 took +11%, 65 -> 72 +10%, 130 -> 128 + 2 +12%, the rest within noise.
# 32 buckets, ~17 MB of kernels per weight shape: a 10-layer SmolLM2 stage (fresh process,
# 1 thread) starts at 455 MB instead of 384 and stays there (forwards of every row count
# 1..800: +2.1 MB; they kept +114.9 MB before, the 256-kernel caps full, in as much time);
# the gateway's LM head (49152 x 576) +18 MB and 1.1 s at load, then products of 1..160
# rows +0.5 MB (+86.2 MB before).
ROW_BUCKETS = tuple(range(1, 9)) + (10, 12, 14) + tuple(range(16, 65, 4)) + tuple(range(72, 129, 8))
MAX_PRODUCT_ROWS = ROW_BUCKETS[-1]


def bucket_rows(rows: int) -> int:
    """The row count a product of `rows` rows (1..MAX_PRODUCT_ROWS) runs at: the least bucket
    holding them."""
    if not 1 <= rows <= MAX_PRODUCT_ROWS:
        raise ValueError(f"a product holds 1 to {MAX_PRODUCT_ROWS} rows, got {rows}")
    return ROW_BUCKETS[bisect.bisect_left(ROW_BUCKETS, rows)]


_WARM: set[tuple[int, int, bool]] = set()  # weight shapes (out, in, bias) whose buckets are built


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
        if self.packed:
            self.warm_buckets()

    def warm_buckets(self) -> None:
        """Build this weight shape's kernel for every bucket, once per process (see the
        module's note): later products of any row count add no kernel."""
        key = (self.out_features, self.in_features, self.bias is not None)
        if key not in _WARM:
            x = torch.zeros(MAX_PRODUCT_ROWS, self.in_features, dtype=self.weight.dtype)
            for rows in ROW_BUCKETS:
                self._product(x[:rows])
            _WARM.add(key)

    def _product(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, in) contiguous -> (T, out), on oneDNN's kernel for exactly T rows."""
        return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")

    def _bucketed(self, rows: torch.Tensor) -> torch.Tensor:
        """(T, in), 1 <= T <= MAX_PRODUCT_ROWS -> (T, out), the rows zero-padded to their bucket."""
        t = rows.shape[0]
        t_run = bucket_rows(max(t, 2) if self.lone_row_as_two else t)  # see lone_row_differs
        if t_run == t:
            return self._product(rows.contiguous())
        padded = rows.new_zeros(t_run, self.in_features)
        padded[:t] = rows
        return self._product(padded)[:t]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packed:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)  # oneDNN takes a (T, in) matrix
        if rows.shape[0] == 0:  # and at least one row
            return x.new_zeros(*x.shape[:-1], self.out_features)
        if rows.shape[0] <= MAX_PRODUCT_ROWS:
            y = self._bucketed(rows)  # (T, out)
        else:
            y = torch.cat([self._bucketed(rows[i:i + MAX_PRODUCT_ROWS]) for i in range(0, rows.shape[0], MAX_PRODUCT_ROWS)])
        return y.reshape(*x.shape[:-1], self.out_features)
