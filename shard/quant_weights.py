"""A quantised matmul weight as a store holds it: its tensors, and the linear a node builds from them.

A store prepared from a GGUF keeps its 4-bit and 8-bit blocks (shard.gguf_quant) as
shard.quant's grids instead of f32. One weight `X.weight` (N, K) is stored as
(suffixes from shard.manifest.QUANT_PARTS, the one table of them):
  int4   X.weight.int4    (N, K/2) uint8: inputs 2j (low nibble) and 2j+1 (high) of a row
         X.weight.scales  (N, K/G) bf16     w = (q - 8) * s + z, per group of G inputs
         X.weight.zeros   (N, K/G) bf16
  int8   X.weight.int8    (N, K) int8       w = q * s, per output channel
         X.weight.scales  (N,) bf16
a device-independent layout: the node packs it for its own device's kernel at load
(shard.quant.pack_int4), so the bytes and digests are the same for every node.
Knows nothing of GGUF, files or layers' maths.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shard.manifest import QUANT_PARTS, quant_scheme_name
from shard.quant import INT4_ZERO_POINT, KERNEL_DTYPE, Int4Linear, Int8Linear, QuantError


@dataclass(frozen=True)
class QuantWeight:
    """One (N, K) weight on a quantisation grid: `q` int8 (N, K) with `scales` (N,) for int8,
    or nibbles `q` uint8 (N, K) in [0, 15] with `scales`, `zeros` (N, K/G) for int4."""

    kind: str  # "int8" | "int4" (a QUANT_PARTS key)
    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def group_size(self) -> int:
        """Inputs per scale: 0 for per channel (int8)."""
        return 0 if self.kind == "int8" else self.q.shape[1] // self.scales.shape[1]

    @property
    def scheme_name(self) -> str:
        """The shard.quant.SCHEMES row this weight runs as ("int8", "int4", "int4-g64", ...)."""
        return quant_scheme_name(self.kind, self.group_size)

    def dequantised(self) -> torch.Tensor:
        """(N, K) f32: the weight on its grid (scales and zeros as stored)."""
        s = self.scales.float()
        if self.kind == "int8":
            return self.q.float() * s[:, None]
        n, k = self.shape
        g = self.group_size
        w = (self.q.float().reshape(n, k // g, g) - INT4_ZERO_POINT) * s[..., None] + self.zeros.float()[..., None]
        return w.reshape(n, k)

    def rows(self, order: torch.Tensor) -> "QuantWeight":
        """The weight with its output rows taken in `order` (a GGUF's q/k row permutation undone)."""
        return QuantWeight(self.kind, self.q[order], self.scales[order], None if self.zeros is None else self.zeros[order])

    def linear(self, bias: torch.Tensor | None = None, device: torch.device | str = "cpu"):
        """The shard.quant linear multiplying by this grid, packed for `device` (no requantisation)."""
        if self.kind == "int8":
            return Int8Linear.from_grid(self.q, self.scales, bias, device)
        return Int4Linear.from_grid(self.q, self.scales, self.zeros, bias, device)

    def to_tensors(self, name: str) -> dict[str, torch.Tensor]:
        """The store tensors of weight `name` (see the module docstring)."""
        parts = QUANT_PARTS[self.kind]
        if self.kind == "int8":
            return {name + parts[0]: self.q.to(torch.int8), name + parts[1]: self.scales.to(KERNEL_DTYPE)}
        q = self.q.to(torch.uint8)
        packed = q[:, 0::2] | (q[:, 1::2] << 4)  # (N, K/2)
        return {name + parts[0]: packed, name + parts[1]: self.scales.to(KERNEL_DTYPE),
                name + parts[2]: self.zeros.to(KERNEL_DTYPE)}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], name: str) -> "QuantWeight | None":
        """Weight `name` read back from store tensors; None when it is not stored quantised."""
        for kind, parts in QUANT_PARTS.items():
            if name + parts[0] in tensors:
                q = tensors[name + parts[0]]
                if kind == "int4":
                    q = torch.stack([q & 0x0F, q >> 4], dim=-1).reshape(q.shape[0], -1)  # (N, K)
                    return cls(kind, q, tensors[name + parts[1]], tensors[name + parts[2]])
                return cls(kind, q, tensors[name + parts[1]])
        return None

    @staticmethod
    def cat(parts: list["QuantWeight"]) -> "QuantWeight | None":
        """The row-wise concatenation (fused q/k/v or gate/up), or None when the parts are
        not on one kind of grid with one group size (the caller then multiplies in f32)."""
        first = parts[0]
        if any(p.kind != first.kind or p.group_size != first.group_size or p.shape[1] != first.shape[1] for p in parts):
            return None
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])
        return QuantWeight(first.kind, torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]), zeros)


def check_shape(w: QuantWeight, name: str, shape: tuple[int, ...]) -> None:
    """QuantError unless the stored grid is the (N, K) weight the layout names."""
    if w.shape != tuple(shape):
        raise QuantError(f"stored shape of quantised {name}", tuple(shape), w.shape)
