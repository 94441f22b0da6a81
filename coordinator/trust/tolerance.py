"""How far an honest stage's output may be from the auditor's replay of it.

Per wire dtype (derived from shard.wire.dtypes' mantissa bits, the one table) and per the
weight quantisation the stage declared (shard.quant). Pure. Knows nothing of frames,
replays or evidence (coordinator.trust.audit compares with these).
"""

from __future__ import annotations

import dataclasses

from receipts import Tolerance
from shard.quant import scheme
from shard.wire.dtypes import BY_NAME, DTYPES, WireDType

# Recomputation in f32 on another machine, batched differently, differs from the stage's
# own f32 by ~1e-5 of the row's magnitude (accumulation error follows the row's RMS, not
# each element: a near-zero element next to large ones carries the same absolute error);
# after the wire codec that is at most one step of the wire dtype on an element that sat
# next to a rounding boundary. So an element may differ by abs_tol row RMSes plus a wire
# step of itself (rel_tol), and a rare few (max_outlier_fraction) by more. Both follow the
# dtype's step u = 2^-mantissa_bits (shard.wire.dtypes); f32's step is far below the
# recomputation error, where the floors take over. The multipliers were calibrated on
# SmolLM2 (docs/receipts.md: largest honest error at most 0.05 of the bound for f32, 0.2
# for bf16, 0.5 for fp8) and on honest tiny-model rings (tests/e2e/test_receipts_ring.py).
ABS_TOL_FLOOR, REL_TOL_FLOOR = 1e-4, 1e-3
# (abs_tol in u, rel_tol in u, outlier fraction). An fp8 row carries its own scale, so its
# codec error is bounded per element (shard.wire.fp8) and a step of the element is most of it.
STEPS_16BIT = (1.28, 2.0, 1e-3)
STEPS_FP8 = (0.16, 1.04, 2e-3)


def wire_tolerance(row: WireDType) -> Tolerance:
    """How far an honest stage's output in float dtype `row` may be from its replay."""
    abs_steps, rel_steps, outliers = STEPS_FP8 if row.is_fp8 else STEPS_16BIT
    step = 2.0 ** -row.mantissa_bits
    return Tolerance(abs_tol=max(ABS_TOL_FLOOR, abs_steps * step), rel_tol=max(REL_TOL_FLOOR, rel_steps * step),
                     max_outlier_fraction=outliers)


# Derived from the dtype table: never edit by hand.
TOLERANCES: dict[str, Tolerance] = {d.name: wire_tolerance(d) for d in DTYPES if d.is_float}


def stage_tolerance(wire_dtype: str, quant: str = "none") -> Tolerance:
    """How far an honest stage's output may be from its replay, on wire `wire_dtype` under
    its declared weight quantisation (shard.quant scheme name): a quantised stage's matmuls
    round activations to the kernel's dtype (bf16), so its outputs are held to that dtype's
    step when it is coarser than the wire's. The weights themselves need no allowance: the
    replay quantises the same store with the same scheme."""
    row = BY_NAME.get(wire_dtype, BY_NAME["f32"])
    bits = scheme(quant).activation_mantissa_bits
    if bits is not None and bits < row.mantissa_bits:
        row = dataclasses.replace(row, mantissa_bits=bits)
    return wire_tolerance(row)
