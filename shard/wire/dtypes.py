"""The one table of tensor dtypes allowed on the wire, and every map derived from it.

This table is also the allow-list for peer frames: a dtype name that is not a row here
is a protocol error. Knows nothing of frames, messages or scaling (see codec.py, fp8.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class WireDType:
    """One row: the name a frame carries, the torch dtype it decodes to, bytes per element."""

    name: str
    torch_dtype: torch.dtype
    itemsize: int
    is_float: bool
    # fp8 values need a float32 scale per row to carry activations (see fp8.py).
    is_fp8: bool = False
    # Explicitly stored mantissa bits of a float (0 for integers): one step of the dtype is
    # 2^-mantissa_bits of an element at the bottom of its binade (audit tolerances follow it).
    mantissa_bits: int = 0
    # The name command-line flags take for it as an activation dtype (--wire-dtype); None: not offered.
    cli_name: str | None = None

    @property
    def torch_name(self) -> str:
        """torch's own name without the module ("float32"), as compute-dtype flags spell it."""
        return str(self.torch_dtype).removeprefix("torch.")


# THE table. Bytes on the wire are little-endian in every row.
DTYPES: tuple[WireDType, ...] = (
    WireDType("f32", torch.float32, 4, is_float=True, mantissa_bits=23, cli_name="f32"),
    WireDType("f16", torch.float16, 2, is_float=True, mantissa_bits=10, cli_name="f16"),
    WireDType("bf16", torch.bfloat16, 2, is_float=True, mantissa_bits=7, cli_name="bf16"),
    WireDType("f8_e4m3fn", torch.float8_e4m3fn, 1, is_float=True, is_fp8=True, mantissa_bits=3, cli_name="fp8"),
    WireDType("f8_e5m2", torch.float8_e5m2, 1, is_float=True, is_fp8=True, mantissa_bits=2),
    WireDType("i64", torch.int64, 8, is_float=False),
    WireDType("i32", torch.int32, 4, is_float=False),
    WireDType("u8", torch.uint8, 1, is_float=False),
    WireDType("bool", torch.bool, 1, is_float=False),
)

# Derived maps: never edit these by hand.
BY_NAME: dict[str, WireDType] = {d.name: d for d in DTYPES}
BY_TORCH: dict[torch.dtype, WireDType] = {d.torch_dtype: d for d in DTYPES}
ITEMSIZE: dict[str, int] = {d.name: d.itemsize for d in DTYPES}
FLOAT_NAMES: frozenset[str] = frozenset(d.name for d in DTYPES if d.is_float)
FP8_NAMES: frozenset[str] = frozenset(d.name for d in DTYPES if d.is_fp8)
INT_NAMES: frozenset[str] = frozenset(d.name for d in DTYPES if not d.is_float and d.name != "bool")
# Activations (hidden states, aux features) travel in any float row, in table order.
ACTIVATION_NAMES: tuple[str, ...] = tuple(d.name for d in DTYPES if d.is_float)
BY_CLI_NAME: dict[str, WireDType] = {d.cli_name: d for d in DTYPES if d.cli_name is not None}
# A stage computes in a 16- or 32-bit float, named as torch names it ("float32", "bfloat16").
COMPUTE_DTYPES: dict[str, torch.dtype] = {d.torch_name: d.torch_dtype for d in DTYPES if d.is_float and not d.is_fp8}

# Bytes of one per-row fp8 scale (float32), charged per token by wire_bytes_per_token.
FP8_ROW_SCALE_BYTES = BY_NAME["f32"].itemsize


def wire_name(dtype: torch.dtype) -> str:
    """The wire name of a torch dtype; ValueError for a dtype the wire cannot carry."""
    row = BY_TORCH.get(dtype)
    if row is None:
        raise ValueError(f"dtype {dtype} cannot go on the wire (allowed: {[d.name for d in DTYPES]})")
    return row.name


def from_cli_name(cli_name: str) -> str:
    """The wire name of an activation dtype as flags spell it ("fp8" -> "f8_e4m3fn");
    ValueError for a name no row offers."""
    row = BY_CLI_NAME.get(cli_name)
    if row is None:
        raise ValueError(f"activation dtype must be one of {list(BY_CLI_NAME)}, got {cli_name!r}")
    return row.name


def wire_bytes_per_token(hidden_size: int, dtype: str) -> int:
    """Bytes one token's hidden state costs on the wire in `dtype` (a wire float name).

    f32 = 4H, f16/bf16 = 2H, fp8 = H + 4 (one float32 scale per row). Tensor bytes only:
    the msgpack header is amortised over the frame and not counted.
    """
    row = BY_NAME.get(dtype)
    if row is None or not row.is_float:
        raise ValueError(f"{dtype!r} is not a wire float dtype (allowed: {sorted(FLOAT_NAMES)})")
    return hidden_size * row.itemsize + (FP8_ROW_SCALE_BYTES if row.is_fp8 else 0)
