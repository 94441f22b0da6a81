"""Compare a stage's claimed output with an auditor's recomputation, within a tolerance.

Pure numpy on float64 copies: bytes are read as little-endian float32, float16 or
bfloat16 (the wire's float dtypes); sequences and arrays as given. An element is an
outlier when |actual - expected| > abs_tol * scale + rel_tol * |expected| (numpy.isclose's
rule, with the absolute part in units of `scale`: 1, or e.g. the RMS of the element's row,
since recomputation error scales with the magnitudes a row accumulates, not with each
element) or when either side is NaN or the two sides are unequal infinities. The verdict passes when
the fraction of outliers is at most `max_outlier_fraction`: recomputation on other hardware
or kernels is not bit-exact, but a skipped or faked layer moves most elements.
This module does not know which layers produced the numbers, nor how they were recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from receipts.errors import SpotCheckError

# Wire float dtypes readable from raw bytes: name -> (little-endian storage dtype, itemsize).
BYTE_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}

FloatData = bytes | bytearray | memoryview | Sequence[float] | np.ndarray


@dataclass(frozen=True)
class Tolerance:
    """How close a recomputation must be: per-element abs + rel bound, and a budget of outliers."""

    abs_tol: float = 1e-3
    rel_tol: float = 1e-2
    max_outlier_fraction: float = 1e-3

    def __post_init__(self) -> None:
        for name in ("abs_tol", "rel_tol", "max_outlier_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise SpotCheckError(f"tolerance {name}", "a finite number >= 0", v)
            object.__setattr__(self, name, float(v))  # one type, so encodings are canonical
        if self.max_outlier_fraction > 1.0:
            raise SpotCheckError("tolerance max_outlier_fraction", "at most 1.0", self.max_outlier_fraction)


@dataclass(frozen=True)
class SpotCheck:
    """The verdict of one comparison. Errors are inf when an element is NaN or mismatched inf."""

    tolerance: Tolerance
    num_elements: int
    num_outliers: int
    max_abs_error: float
    max_rel_error: float

    @property
    def outlier_fraction(self) -> float:
        return self.num_outliers / self.num_elements

    @property
    def passed(self) -> bool:
        return self.outlier_fraction <= self.tolerance.max_outlier_fraction


def compare_outputs(
    expected: FloatData, actual: FloatData, tolerance: Tolerance = Tolerance(), *, dtype: str = "float32",
    scale: float | np.ndarray = 1.0,
) -> SpotCheck:
    """Compare the recomputed output `expected` with the stage's claimed output `actual`.

    `dtype` says how to read bytes-like inputs; both sides are flattened. `scale`: the unit
    of abs_tol, a finite number >= 0 or one per element (flattened like the inputs).
    Error handling: SpotCheckError for an unknown dtype, a byte length that is not a whole
    number of elements, different element counts, no elements at all, or a bad scale.
    """
    e, a = _as_float64(expected, dtype, "expected"), _as_float64(actual, dtype, "actual")
    if e.size != a.size:
        raise SpotCheckError("element count", e.size, a.size)
    if e.size == 0:
        raise SpotCheckError("element count", "at least 1", 0)
    unit = np.asarray(scale, dtype=np.float64).ravel()
    if unit.size not in (1, e.size):
        raise SpotCheckError("scale element count", f"1 or {e.size}", unit.size)
    if not (np.isfinite(unit).all() and (unit >= 0).all()):
        raise SpotCheckError("scale", "finite numbers >= 0", "a NaN, an infinity or a negative value")
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - e)  # inf - inf is NaN: handled as a mismatch below
        same = (a == e) | ((diff <= tolerance.abs_tol * unit + tolerance.rel_tol * np.abs(e)) & np.isfinite(diff))
        err = np.where(a == e, 0.0, np.where(np.isnan(diff), np.inf, diff))  # (N,) float64
        rel = err / np.maximum(np.abs(e), np.finfo(np.float64).tiny)
    return SpotCheck(
        tolerance=tolerance,
        num_elements=int(e.size),
        num_outliers=int(e.size - np.count_nonzero(same)),
        max_abs_error=float(err.max()),
        max_rel_error=float(np.nan_to_num(rel, nan=np.inf).max()),
    )


def _as_float64(data: FloatData, dtype: str, side: str) -> np.ndarray:
    if isinstance(data, (bytes, bytearray, memoryview)):
        if dtype not in BYTE_DTYPES:
            raise SpotCheckError("dtype", sorted(BYTE_DTYPES), dtype)
        raw = memoryview(data).cast("B")
        storage = BYTE_DTYPES[dtype]
        if len(raw) % storage.itemsize:
            raise SpotCheckError(f"{side} byte length", f"a multiple of {storage.itemsize}", len(raw))
        values = np.frombuffer(raw, dtype=storage)
        if dtype == "bfloat16":  # bfloat16 is the top half of a float32
            values = (values.astype("<u4") << 16).view("<f4")
        return values.astype(np.float64).ravel()
    try:
        return np.asarray(data, dtype=np.float64).ravel()
    except (TypeError, ValueError) as e:
        raise SpotCheckError(f"{side} values", "floats", type(data).__name__) from e
