"""A stage's forward over its contiguous layers, plus the model's two ends.

Plain Llama-family maths (RMSNorm, rotary, grouped-query attention, SwiGLU), written to
be read in one sitting. Knows nothing of the wire, fp8, peers or rings: callers hand it
tensors and slot bookkeeping, it hands back hidden states. Weights arrive as the store's
per-layer dicts; q/k/v and gate/up are fused into single matmuls at load, and every
matmul weight is laid out for its device (shard.linear): transforms on the weights, not
branches in the forward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from shard.arch import ModelConfig
from shard.errors import ShardError
from shard.kvcache import JobCache
from shard.layers import LayerRange
from shard.linear import Linear
from shard.rope import RotaryTable, apply_rotary


class StageInputError(ShardError):
    """A frame's slot bookkeeping or shapes do not fit this stage (what, limit, actual)."""

    def __init__(self, what: str, limit: object, actual: object) -> None:
        self.what, self.limit, self.actual = what, limit, actual
        super().__init__(f"{what} (limit {limit}, got {actual})")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype, then scale in the compute dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (H,)
    qkv: Linear  # H -> (Hq + 2 Hkv) * D, with the bias when the model has one
    o: Linear  # Hq * D -> H
    post_norm: torch.Tensor  # (H,)
    gate_up: Linear  # H -> 2 I
    down: Linear  # I -> H

    @classmethod
    def fuse(cls, t: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device | str,
             *, pack: bool = True) -> "LayerWeights":
        def get(name: str) -> torch.Tensor:
            return t[name].to(device=device, dtype=dtype)

        bias = None
        if "self_attn.q_proj.bias" in t:
            bias = torch.cat([get(f"self_attn.{p}_proj.bias") for p in "qkv"])
        return cls(
            input_norm=get("input_layernorm.weight"),
            qkv=Linear(torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"]), bias, pack=pack),
            o=Linear(get("self_attn.o_proj.weight"), pack=pack),
            post_norm=get("post_attention_layernorm.weight"),
            gate_up=Linear(torch.cat([get("mlp.gate_proj.weight"), get("mlp.up_proj.weight")]), pack=pack),
            down=Linear(get("mlp.down_proj.weight"), pack=pack),
        )


def attention_mask(ctx_len: int, tree_parents: torch.Tensor | None, t: int, device) -> torch.Tensor | None:
    """Bool (T, ctx_len + T): every query sees the whole committed context, plus, among
    this frame's tokens, itself and its ancestors (a causal chain when parents is None)."""
    if t == 1:
        return None  # one query attends to everything: no mask needed
    if tree_parents is None:
        within = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    else:
        within = torch.eye(t, dtype=torch.bool, device=device)
        parents = tree_parents.tolist()
        for i, p in enumerate(parents):
            if p >= 0:
                within[i] |= within[p]  # parents precede children, so row p is final
    ctx = torch.ones(t, ctx_len, dtype=torch.bool, device=device)
    return torch.cat([ctx, within], dim=1)


class Stage:
    """Layers `layers` of a model, computing frames for many jobs (each with its JobCache)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: LayerRange,
        weights: dict[int, dict[str, torch.Tensor]],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        embedding: torch.Tensor | None = None,
        pack_weights: bool = True,
    ) -> None:
        """`pack_weights=False` keeps the weights in torch's default layout (shard.linear):
        for benchmarks that compare the two."""
        if layers.end > cfg.num_layers:
            raise StageInputError("layer range end", cfg.num_layers, layers.end)
        missing = [i for i in layers if i not in weights]
        if missing:
            raise StageInputError("layers missing from the weights", f"{layers}", missing)
        self.cfg, self.layers, self.dtype, self.device = cfg, layers, dtype, torch.device(device)
        self.blocks = [LayerWeights.fuse(weights[i], dtype, device, pack=pack_weights) for i in layers]
        self.embedding = embedding.to(device=device, dtype=dtype) if embedding is not None else None
        self.rotary = RotaryTable(cfg, dtype, device)

    @property
    def is_head(self) -> bool:
        return self.embedding is not None

    @torch.inference_mode()
    def forward(
        self,
        job: JobCache,
        x: torch.Tensor,
        *,
        ctx_len: int,
        positions: torch.Tensor,
        tree_parents: torch.Tensor | None = None,
        commit_src: list[int] | tuple[int, ...] = (),
        commit_dst: int = 0,
        capture: Iterable[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run this stage on one frame of T tokens.

        x: token ids (T,) on the head stage, else hidden states (T, H). The commit (slots
        gathered to [commit_dst, ...)) is applied first; the frame's K/V then go to slots
        [ctx_len, ctx_len + T). Returns (hidden (T, H), {layer: output (T, H)} for the
        absolute layer indices in `capture` that this stage owns).
        """
        cfg = self.cfg
        t = x.shape[0]
        if positions.shape != (t,):
            raise StageInputError("positions shape", (t,), tuple(positions.shape))
        if commit_src and commit_dst + len(commit_src) > ctx_len:
            raise StageInputError("committed slots end past ctx_len", ctx_len, commit_dst + len(commit_src))
        job.ensure(ctx_len + t)
        job.commit(list(commit_src), commit_dst)
        if self.is_head:
            if x.dim() != 1:
                raise StageInputError("head stage input rank (token ids)", 1, x.dim())
            if t and (int(x.min()) < 0 or int(x.max()) >= cfg.vocab_size):
                raise StageInputError("token id", cfg.vocab_size - 1, int(x.max()) if int(x.min()) >= 0 else int(x.min()))
            h = F.embedding(x.to(self.device, torch.long), self.embedding)  # (T, H)
        else:
            if x.shape != (t, cfg.hidden_size):
                raise StageInputError("hidden shape", (t, cfg.hidden_size), tuple(x.shape))
            h = x.to(self.device, self.dtype)
        cos, sin = self.rotary.lookup(positions)  # (T, D) each
        # A fresh causal chain (prefill from slot 0) can use SDPA's own causal kernel; every
        # other frame shape gets an explicit mask.
        causal = ctx_len == 0 and tree_parents is None and t > 1
        mask = None if causal else attention_mask(ctx_len, tree_parents, t, self.device)
        wanted = set(capture)
        captured: dict[int, torch.Tensor] = {}
        for local, (layer, w) in enumerate(zip(self.layers, self.blocks)):
            h = h + self._attention(job, local, rms_norm(h, w.input_norm, cfg.rms_norm_eps), w, ctx_len, cos, sin, mask, causal)
            h = h + self._mlp(rms_norm(h, w.post_norm, cfg.rms_norm_eps), w)
            if layer in wanted:
                captured[layer] = h
        return h, captured

    def _attention(self, job, local, x, w: LayerWeights, ctx_len, cos, sin, mask, causal) -> torch.Tensor:
        cfg = self.cfg
        t, d, hq, hkv = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        qkv = w.qkv(x)  # (T, (Hq + 2 Hkv) D)
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rotary(q.view(t, hq, d).transpose(0, 1), cos, sin)  # (Hq, T, D)
        k = apply_rotary(k.view(t, hkv, d).transpose(0, 1), cos, sin)  # (Hkv, T, D)
        v = v.view(t, hkv, d).transpose(0, 1)  # (Hkv, T, D)
        keys, values = job.write(local, ctx_len, k, v)  # (Hkv, S, D) with S = ctx_len + T
        if t == 1 and hq != hkv:
            # Decode: fold each KV head's G query heads into query rows, (Hkv, G, D): the
            # same maths as repeating K/V per query head, without the copy, and SDPA stays
            # on its fused kernel (with the GQA flag CPU SDPA takes its slow reference path).
            g = hq // hkv
            out = F.scaled_dot_product_attention(q.reshape(hkv, g, d), keys, values).view(hq, 1, d)  # (Hq, 1, D)
        else:
            # A batch dimension of 1: CPU SDPA's fused kernels want 4-D inputs (without it,
            # GQA and masked frames fall back to the slow reference path).
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                                 enable_gqa=hq != hkv)[0]  # (Hq, T, D)
        return w.o(out.transpose(0, 1).reshape(t, hq * d))  # (T, H)

    @staticmethod
    def _mlp(x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        gate, up = w.gate_up(x).chunk(2, dim=-1)  # (T, I) each
        return w.down(F.silu(gate) * up)  # (T, H)


class OutputHead:
    """Final RMSNorm and LM head (tied to the embedding when the model ties them)."""

    def __init__(self, cfg: ModelConfig, norm: torch.Tensor, lm_head: torch.Tensor, *, dtype=torch.float32, device="cpu",
                 pack_weights: bool = True) -> None:
        self.cfg = cfg
        self.norm = norm.to(device=device, dtype=dtype)
        self.lm_head = Linear(lm_head.to(device=device, dtype=dtype), pack=pack_weights)  # H -> V

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, H) -> logits (T, V) in fp32."""
        h = rms_norm(hidden.to(self.norm.dtype), self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()
