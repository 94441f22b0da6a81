"""A GGUF's quantised blocks as shard.quant's layouts, read from their bytes, never through f32 weights.

Q4_0, Q4_1 and Q4_K hold 4-bit values with a scale (and a min) per 32 inputs, which is
int4 with groups of 32 (w = (q - 8) s + z) once (s, z) are rewritten from the block's:
    Q4_0  w = d (q - 8)             s = d,          z = 0
    Q4_1  w = d q + m               s = d,          z = m + 8 d
    Q4_K  w = d sc_j q - dmin m_j   s = d sc_j,     z = 8 s - dmin m_j   (sub-block j of 8 in 256)
The nibbles are taken as they are. Q8_0 holds int8 with a scale per 32 inputs, which
per-channel int8 cannot hold, so its rows are requantised per channel (one more rounding,
of at most half an int8 step of the row).
Layouts follow ggml (ggml-quants.c): little-endian f16 scales first, then the values;
Q4_0/Q4_1 keep inputs 0-15 of a block in the low nibbles and 16-31 in the high ones; Q4_K
keeps each 64 inputs as 32 bytes, the first 32 inputs low, the next 32 high.
`read_grids` finds a GGUF file's block tensors under the checkpoint names transformers
loads them as (its name map and its q/k row permutation, learnt by passing row indices
through its own tensor processor, so every family it reads is read the same way), and
keeps each only where the grid's values equal what transformers loaded, exactly.
Knows nothing of stores or stages (gguf's own dequantize is the test oracle).
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType

from shard.manifest import MOE_NAMES
from shard.quant import Int8Linear, QuantError
from shard.quant_weights import QuantWeight

GROUP = 32  # inputs per scale in every 4-bit block type here
# ggml type name -> (inputs per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q4_K": (256, 144)}
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _blocks(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> np.ndarray:
    """(N, K/B, bytes per block) uint8 view of a tensor's raw bytes."""
    per, size = BLOCKS[kind]
    n, k = shape
    if k % per or raw.size != n * (k // per) * size:
        raise QuantError(f"{kind} tensor bytes for shape {shape}", n * (k // per) * size, raw.size)
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // per, size)


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, nb)


def _split_nibbles(qs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return qs & 0x0F, qs >> 4


def int4_grid(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nibbles (N, K) uint8, scales (N, K/32) f32, zeros (N, K/32) f32) of a Q4_0/Q4_1/Q4_K tensor."""
    if kind not in INT4_TYPES:
        raise QuantError("4-bit GGUF block type", INT4_TYPES, kind)
    b = _blocks(raw, kind, shape)
    n, nb = b.shape[:2]
    if kind in ("Q4_0", "Q4_1"):
        d = _f16(b, 0)
        start = 2 if kind == "Q4_0" else 4
        lo, hi = _split_nibbles(b[..., start:start + 16])
        q = np.concatenate([lo, hi], axis=-1)  # (N, nb, 32)
        zeros = np.zeros_like(d) if kind == "Q4_0" else _f16(b, 2) + 8 * d
        return torch.from_numpy(q.reshape(n, -1)), torch.from_numpy(d), torch.from_numpy(zeros)
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc_bytes, qs = b[..., 4:16].astype(np.int32), b[..., 16:144]  # (N, nb, 12), (N, nb, 128)
    sc = np.empty((n, nb, 8), np.int32)
    mn = np.empty((n, nb, 8), np.int32)
    sc[..., :4], mn[..., :4] = sc_bytes[..., 0:4] & 63, sc_bytes[..., 4:8] & 63
    sc[..., 4:] = (sc_bytes[..., 8:12] & 0x0F) | ((sc_bytes[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (sc_bytes[..., 8:12] >> 4) | ((sc_bytes[..., 4:8] >> 6) << 4)
    lo, hi = _split_nibbles(qs.reshape(n, nb, 4, 32))  # per 64 inputs: low nibbles first
    q = np.stack([lo, hi], axis=3).reshape(n, nb * 256)  # (N, K)
    scales = d[..., None] * sc.astype(np.float32)  # (N, nb, 8)
    zeros = 8 * scales - dmin[..., None] * mn.astype(np.float32)
    return torch.from_numpy(q), torch.from_numpy(scales.reshape(n, -1)), torch.from_numpy(zeros.reshape(n, -1))


def grid_from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int]) -> QuantWeight:
    """The shard.quant grid of a GGUF tensor of ggml type `kind`: int4 (groups of 32) for
    Q4_0/Q4_1/Q4_K, int8 (per channel, requantised) for Q8_0."""
    if kind in INT4_TYPES:
        return QuantWeight("int4", *int4_grid(raw, kind, shape))
    if kind == "Q8_0":
        b = _blocks(raw, kind, shape)
        d, q = _f16(b, 0), b[..., 2:34].copy().view(np.int8).astype(np.float32)  # (N, nb), (N, nb, 32)
        lin = Int8Linear(torch.from_numpy((q * d[..., None]).reshape(shape[0], -1)))
        return QuantWeight("int8", lin.weight, lin.scales)
    raise QuantError("GGUF block type", tuple(BLOCKS), kind)


def linear_from_gguf(raw: np.ndarray, kind: str, shape: tuple[int, int], device: torch.device | str = "cpu"):
    """The shard.quant linear holding a GGUF tensor of ggml type `kind` (see grid_from_gguf)."""
    return grid_from_gguf(raw, kind, shape).linear(device=device)


# A GGUF's fused MoE expert tensors (E, N, K) by their ggml name, as each expert's
# (gate, up, down) projection: MOE_NAMES' index of the checkpoint name.
_EXPERT_TENSORS = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}


def read_grids(path, config: dict, layout: str, model, state: dict[str, torch.Tensor],
               ) -> tuple[dict[str, QuantWeight], dict[str, str]]:
    """({checkpoint name -> grid} for the decoder-layer matmul weights of GGUF file `path`
    stored as one of BLOCKS, {name -> why it stays float}). `model`: the transformers model
    loaded from the file, `state`: its tensors under checkpoint names (the reference each
    grid must reproduce exactly, row permutation included); `layout`: shard.arch's. MoE
    routers are never taken (shard.quant keeps them in the compute dtype)."""
    from gguf import GGUFReader, dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    reader = GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config)
    names = get_gguf_hf_weights_map(model, processor)
    prefix, projections = MOE_NAMES.get(layout, ("mlp.", ()))
    routers = (f".{prefix}gate.weight", "shared_expert_gate.weight")
    grids, dense = {}, {}

    def take(hf: str, raw: np.ndarray, kind: str, shape: tuple[int, int], order: np.ndarray) -> None:
        if hf not in state or hf.endswith(routers) or not hf.startswith("model.layers."):
            return
        want = state[hf]
        got = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind])).reshape(shape)[torch.from_numpy(order)]
        if tuple(want.shape) != shape or not torch.equal(got, want.float()):
            dense[hf] = f"its {kind} blocks are not what transformers loads as {hf}"
            return
        grids[hf] = grid_from_gguf(raw, kind, shape).rows(torch.from_numpy(order))

    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = tuple(int(v) for v in reversed(t.shape))  # ggml lists (K, N[, E])
        if kind not in BLOCKS:
            continue
        stem = t.name.rsplit(".", 2)
        if len(shape) == 3 and len(stem) == 3 and stem[1] in _EXPERT_TENSORS and projections:
            layer = int(stem[0].removeprefix("blk."))
            proj = projections[_EXPERT_TENSORS[stem[1]]]
            for e in range(shape[0]):
                take(f"model.layers.{layer}.{prefix}experts.{e}.{proj}.weight", t.data[e], kind, shape[1:],
                     np.arange(shape[1]))
        elif len(shape) == 2 and t.name in names:
            # Row indices through transformers' own processing give its row order (llama.cpp
            # permutes q and k rows for its rotary layout; transformers undoes it).
            order = processor.process(weights=np.arange(shape[0], dtype=np.float32)[:, None], name=t.name).weights
            order = np.asarray(order).reshape(-1).astype(np.int64)
            if sorted(order.tolist()) != list(range(shape[0])):
                dense[names[t.name]] = "transformers reshapes it beyond a row permutation"
                continue
            take(names[t.name], t.data, kind, shape, order)
    return grids, dense
