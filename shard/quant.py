"""Weight-only int8 / int4 linear layers, and the transform that puts them into a loaded stage.

A scheme (SCHEMES, the one table) says how a matmul weight (N, K) is stored:
  int8        per output channel: w ~ q * s, q int8 in [-128, 127], s (N,) bf16 = max|w_n| / 127
  int4-gG     per group of G inputs of a channel: w ~ (q - 8) * s + z, q in [0, 15],
              s = (max - min) / 15 and z = min + 8 s per group, (K/G, N, 2) bf16
              (gpt-fast's layout, which torch's packed int4 kernels take)
`quantize_stage` swaps every Linear of a loaded Stage's decoder layers (q/k/v, o, gate/up,
down, each expert) for the scheme's drop-in (`Int8Linear`, `Int4Linear`: the same call
y (..., N) = x (..., K) @ W.T + b), so the forward runs unchanged: a transform, as gpt-fast
applies its own, never a branch inside the forward. The MoE router and shared-expert gate
stay in the compute dtype (a router's rounding would change which experts run), as do
norms, biases, the embedding and the coordinator's LM head.

The kernels: torch's packed weight-only matmuls, `_weight_int8pack_mm` and
`_weight_int4pack_mm(_for_cpu)`, on CPU and CUDA alike (only the int4 packing call differs
by device). They take activations in bf16: on the dev VM's AVX-512 CPU the int8 kernel ran
a 1-row (960 x 576) product in 45 us with bf16 activations and 940 us with f32 ones (f32
F.linear: 100 us), so activations are cast to bf16 around the kernel and back. That
rounding (2^-8 of each input and output element: bf16's unit roundoff) is what a quantised stage's outputs
carry beyond the weights' own error; `QuantScheme.activation_mantissa_bits` states it for
the audit tolerances.

Knows nothing of layers' maths, stores, the wire or peers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shard.errors import ShardError
from shard.linear import Linear

KERNEL_DTYPE = torch.bfloat16  # what the packed kernels take as activations and scales
KERNEL_MANTISSA_BITS = 7  # bf16's stored mantissa bits (shard.wire.dtypes' bf16 row)
INT4_ZERO_POINT = 8  # the int4 kernels read a nibble q as (q - 8) * s + z
INT4_ROWS_MULTIPLE = 16  # the CPU int4 packing's N granularity


class QuantError(ShardError):
    """A weight a scheme cannot hold (what, limit, actual)."""

    def __init__(self, what: str, limit: object, actual: object) -> None:
        self.what, self.limit, self.actual = what, limit, actual
        super().__init__(f"{what} (limit {limit}, got {actual})")


@dataclass(frozen=True)
class QuantScheme:
    """One row: how a matmul weight is stored. bits 0 = not quantised (the compute dtype)."""

    name: str
    bits: int
    group_size: int = 0  # inputs sharing one scale and zero; 0 = the whole row (per channel)

    @property
    def quantised(self) -> bool:
        return self.bits > 0

    @property
    def activation_mantissa_bits(self) -> int | None:
        """Mantissa bits the kernel rounds activations to (None: the compute dtype's own)."""
        return KERNEL_MANTISSA_BITS if self.quantised else None

    def weight_bytes(self, out_features: int, in_features: int, dense_itemsize: int) -> int:
        """Bytes of one (out, in) matmul weight held in this scheme (scales and zeros included)."""
        n, k = out_features, in_features
        if not self.quantised:
            return n * k * dense_itemsize
        scale_bytes = torch.finfo(KERNEL_DTYPE).bits // 8
        if self.group_size == 0:
            return n * k * self.bits // 8 + n * scale_bytes
        return n * k * self.bits // 8 + (k // self.group_size) * n * 2 * scale_bytes

    def linear(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        """The drop-in for Linear(weight, bias) in this scheme."""
        if not self.quantised:
            return Linear(weight, bias)
        if self.group_size == 0:
            return Int8Linear(weight, bias)
        return Int4Linear(weight, bias, group_size=self.group_size)


# THE table. `--quant` takes these names; "int4" is group 32, a GGUF Q4 block's size.
SCHEMES: dict[str, QuantScheme] = {s.name: s for s in (
    QuantScheme("none", 0),
    QuantScheme("int8", 8),
    QuantScheme("int4", 4, 32),
    QuantScheme("int4-g64", 4, 64),
    QuantScheme("int4-g128", 4, 128),
)}
NONE = SCHEMES["none"]


def effective_scheme(store_quant: str, requested: str) -> QuantScheme:
    """What a node runs on a store whose matmuls are stored in `store_quant` (its manifest's
    `quant`; "none" for a float store) when asked for `requested` (--quant): the request on a
    float store; the store's own grid otherwise (asking "none" of a quantised store gets it:
    the f32 weights are not there). Asking another scheme of a quantised store is refused,
    naming both, rather than requantising a grid onto another one."""
    if store_quant == "none" or requested == store_quant:
        return scheme(requested)
    if requested == "none":
        return scheme(store_quant)
    raise QuantError(f"--quant {requested} on a store kept quantised as {store_quant} (use --quant none or "
                     f"{store_quant}, or prepare the model from a float source)", store_quant, requested)


def scheme(name: str) -> QuantScheme:
    """The scheme named `name`; QuantError naming the choices otherwise."""
    row = SCHEMES.get(name)
    if row is None:
        raise QuantError("quantisation scheme", list(SCHEMES), name)
    return row


def _rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    return x.reshape(-1, in_features).to(KERNEL_DTYPE).contiguous()  # (T, K) bf16


class Int8Linear:
    """y = (x @ q.T) * s (+ b): int8 weights, one bf16 scale per output channel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        # Quantise against the scale as stored (bf16), so q * s is the nearest grid point of
        # the grid the kernel actually multiplies by.
        self.scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).to(KERNEL_DTYPE)  # (N,)
        self.weight = (w / self.scales.float()[:, None]).round().clamp(-128, 127).to(torch.int8)  # (N, K)
        self.bias = bias

    @classmethod
    def from_grid(cls, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                  device: torch.device | str = "cpu") -> "Int8Linear":
        """An already-quantised weight w = q * s: q (N, K) int8, scales (N,) (rounded to bf16)."""
        if q.dim() != 2 or tuple(scales.shape) != (q.shape[0],):
            raise QuantError("int8 grid scales shape (N,)", (q.shape[0],), tuple(scales.shape))
        self = cls.__new__(cls)
        self.out_features, self.in_features = q.shape
        self.weight = q.to(device=device, dtype=torch.int8).contiguous()
        self.scales = scales.to(device=device, dtype=KERNEL_DTYPE).contiguous()
        self.bias = bias
        return self

    def dequantised(self) -> torch.Tensor:
        """(N, K) f32: the weight this layer multiplies by."""
        return self.weight.float() * self.scales.float()[:, None]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(_rows(x, self.in_features), self.weight, self.scales)  # (T, N)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


def _inner_k_tiles(in_features: int) -> int:
    # CUDA's int4 layout tiles K by 16 * innerKTiles; the largest tiling that divides K.
    for tiles in (8, 4, 2):
        if in_features % (16 * tiles) == 0:
            return tiles
    raise QuantError("int4 in_features (a multiple of 32)", 32, in_features)


class Int4Linear:
    """y = x @ ((q - 8) * s + z).T (+ b): 4-bit weights, a bf16 scale and zero per group of inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *, group_size: int) -> None:
        n, k = weight.shape
        if k % group_size:
            raise QuantError(f"int4 group size {group_size} must divide in_features", group_size, k)
        self.out_features, self.in_features, self.group_size, self.bias = n, k, group_size, bias
        # The CPU packing takes N in multiples of 16: zero rows pad it, cut off the output.
        n = -(-n // INT4_ROWS_MULTIPLE) * INT4_ROWS_MULTIPLE
        w = F.pad(weight.float(), (0, 0, 0, n - self.out_features))  # (N, K)
        w = w.reshape(n, k // group_size, group_size)  # (N, K/G, G)
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)  # (N, K/G)
        scales = ((hi - lo) / 15).clamp(min=1e-6).to(KERNEL_DTYPE)
        zeros = (lo + INT4_ZERO_POINT * scales.float()).to(KERNEL_DTYPE)
        s, z = scales.float()[..., None], zeros.float()[..., None]
        q = ((w - z) / s + INT4_ZERO_POINT).round().clamp(0, 15).to(torch.int32)  # (N, K/G, G)
        self.scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (K/G, N, 2)
        self.weight = pack_int4(q.reshape(n, k), weight.device)  # the nibbles are not kept

    @classmethod
    def from_grid(cls, nibbles: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                  bias: torch.Tensor | None = None, device: torch.device | str = "cpu") -> "Int4Linear":
        """An already-quantised weight w = (q - 8) * s + z: nibbles (N, K) in [0, 15], scales
        and zeros (N, K/G) (e.g. a GGUF's 4-bit blocks, shard.gguf_quant); s and z are
        rounded to bf16, the nibbles kept as they are."""
        self = cls.__new__(cls)
        n, k = nibbles.shape
        groups = scales.shape[1]
        if scales.shape != zeros.shape or scales.shape[0] != n or k % groups:
            raise QuantError("int4 grid scales/zeros shape (N, K/G)", (n, "K/G"), tuple(scales.shape))
        self.out_features, self.in_features, self.group_size, self.bias = n, k, k // groups, bias
        pad = -(-n // INT4_ROWS_MULTIPLE) * INT4_ROWS_MULTIPLE - n
        sz = torch.stack([scales.float(), zeros.float()], dim=-1)  # (N, K/G, 2)
        sz = F.pad(sz, (0, 0, 0, 0, 0, pad), value=1.0).to(KERNEL_DTYPE)  # padded rows: any finite scale
        self.scales_and_zeros = sz.transpose(0, 1).contiguous().to(device)  # (K/G, N, 2)
        self.weight = pack_int4(F.pad(nibbles.to(torch.int32), (0, 0, 0, pad)), device)
        return self

    def nibbles(self) -> torch.Tensor:
        """(N padded, K) int32 in [0, 15], read back through the kernel: with scale 1 and
        zero 8 it returns q itself, exact in bf16."""
        k = self.in_features
        eye = torch.eye(k, dtype=KERNEL_DTYPE, device=self.weight.device)  # (K, K)
        unit = torch.tensor([1.0, float(INT4_ZERO_POINT)], dtype=KERNEL_DTYPE, device=self.weight.device)
        q = self._mm(eye, unit.expand_as(self.scales_and_zeros).contiguous())  # (K, N) = q.T
        return q.t().round().to(torch.int32)

    def dequantised(self) -> torch.Tensor:
        """(N, K) f32: the weight this layer multiplies by."""
        k, g = self.in_features, self.group_size
        q = self.nibbles().float()
        n = q.shape[0]
        sz = self.scales_and_zeros.float().transpose(0, 1)  # (N, K/G, 2)
        w = (q.reshape(n, k // g, g) - INT4_ZERO_POINT) * sz[..., :1] + sz[..., 1:]
        return w.reshape(n, k)[: self.out_features]

    def _mm(self, rows: torch.Tensor, scales_and_zeros: torch.Tensor) -> torch.Tensor:
        if self.weight.device.type == "cpu":
            return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight, self.group_size, scales_and_zeros)
        return torch.ops.aten._weight_int4pack_mm(rows, self.weight, self.group_size, scales_and_zeros)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self._mm(_rows(x, self.in_features), self.scales_and_zeros)  # (T, N padded)
        if y.shape[1] != self.out_features:
            y = y[:, : self.out_features]
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)  # (..., N)
        return y if self.bias is None else y + self.bias


def pack_int4(nibbles: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """(N, K) int32 in [0, 15] -> the device's packed int4 layout for the kernels above."""
    nibbles = nibbles.to(device)
    if nibbles.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(nibbles, 1)
    # CUDA takes two nibbles per byte, the even input in the high half (gpt-fast's packing).
    packed = (nibbles[:, ::2] << 4 | nibbles[:, 1::2]).to(torch.uint8)  # (N, K/2)
    return torch.ops.aten._convert_weight_to_int4pack(packed, _inner_k_tiles(nibbles.shape[1]))


def dense_weight(linear: Linear) -> torch.Tensor:
    """A Linear's (N, K) weight in torch's plain layout (a oneDNN-packed one read back)."""
    return linear.weight.to_dense() if linear.packed else linear.weight


def quantise_linear(linear: Linear, q: QuantScheme):
    """The drop-in for `linear` in scheme `q` (`linear` itself for "none")."""
    if not q.quantised or not isinstance(linear, Linear):
        return linear
    return q.linear(dense_weight(linear), linear.bias)


def quantise_stage(stage, q: QuantScheme):
    """Swap the matmuls of every decoder layer of `stage` (a shard.stage.Stage) for scheme
    `q`'s, in place, and return the stage. Routers and shared-expert gates are kept."""
    from shard.blocks import DenseMLP, MixtureOfExperts

    def mlp(block):
        if isinstance(block, DenseMLP):
            block.gate_up, block.down = quantise_linear(block.gate_up, q), quantise_linear(block.down, q)
        elif isinstance(block, MixtureOfExperts):
            for expert in block.experts:
                mlp(expert)
            if block.shared is not None:
                mlp(block.shared)

    if q.quantised:
        for w in stage.blocks:
            w.qkv, w.o = quantise_linear(w.qkv, q), quantise_linear(w.o, q)
            mlp(w.mlp)
    return stage


def layer_bytes(cfg, layer: int, q: QuantScheme, dense_itemsize: int = 4) -> int:
    """Bytes decoder layer `layer` of model `cfg` (a shard.arch.ModelConfig) holds in memory
    under scheme `q`, its other tensors at `dense_itemsize`: what quantise_stage leaves."""
    from shard.manifest import MOE_NAMES, layer_tensor_shapes

    prefix = MOE_NAMES.get(cfg.family.layout, ("",))[0]
    kept = {f"{prefix}gate.weight", f"{prefix}shared_expert_gate.weight"} if cfg.is_moe_layer(layer) else set()
    total = 0
    for name, shape in layer_tensor_shapes(cfg, layer).items():
        if len(shape) == 2 and name not in kept:
            total += q.weight_bytes(shape[0], shape[1], dense_itemsize)
        else:
            total += dense_itemsize * int(torch.Size(shape).numel())
    return total


def mean_layer_bytes(cfg, q: QuantScheme, dense_itemsize: int = 4) -> int:
    """layer_bytes averaged over the model's layers (what a node reports for the selector)."""
    n = cfg.num_layers
    return max(1, sum(layer_bytes(cfg, i, q, dense_itemsize) for i in range(n)) // n)
