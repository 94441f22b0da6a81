"""One decoder layer's weights, from the store's per-layer dict to what the forward runs.

Reads tensors by their checkpoint names (the family's layout: shard.manifest lists the
same names with their shapes), fuses q/k/v and gate/up into single matmuls, folds a
family's norm offset into its norm weights, and lays every matmul weight out for its
device (shard.linear); a weight the store keeps quantised (shard.quant_weights) becomes
its quantised linear as it is, never through f32 (parts on different grids are fused in
f32 instead, for the stage's quantisation transform to take). Transforms on the weights,
so the forward has no family branches.
Knows nothing of caches, frames or the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shard.arch import ModelConfig
from shard.blocks import DenseMLP, MixtureOfExperts
from shard.linear import Linear
from shard.manifest import MOE_NAMES
from shard.quant_weights import QuantWeight

@dataclass
class LayerWeights:
    attn_norm: torch.Tensor  # (H,) before attention
    qkv: Linear  # H -> (Hq + 2 Hkv) * D, with the bias when the model has one
    o: Linear  # Hq * D -> H
    mlp_norm: torch.Tensor  # (H,) before the MLP
    mlp: Callable[[torch.Tensor], torch.Tensor]  # DenseMLP or MixtureOfExperts: (T, H) -> (T, H)
    sliding: bool = False  # attends only to the last cfg.sliding_window positions
    q_norm: torch.Tensor | None = None  # (D,) per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # (H,) on the block outputs before the residual add (Gemma 3)
    mlp_out_norm: torch.Tensor | None = None

    @classmethod
    def load(cls, cfg: ModelConfig, layer: int, t: dict[str, torch.Tensor], dtype: torch.dtype,
             device: torch.device | str, *, pack: bool = True) -> "LayerWeights":
        """`t`: short tensor name ("self_attn.q_proj.weight") -> tensor, for absolute `layer`."""

        def get(name: str) -> torch.Tensor:
            if name not in t and (grid := QuantWeight.from_tensors(t, name)) is not None:
                return grid.dequantised().to(device=device, dtype=dtype)
            return t[name].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # The offset is added in fp32, as Gemma's own norm does, before any cast down.
            return (t[name].float() + cfg.norm_offset).to(device=device, dtype=dtype)

        def linear(*names: str, bias: torch.Tensor | None = None):
            grids = [QuantWeight.from_tensors(t, n) for n in names]
            if all(g is not None for g in grids) and (fused := QuantWeight.cat(grids)) is not None:
                return fused.linear(bias, device)
            return Linear(torch.cat([get(n) for n in names]), bias, pack=pack)

        def router(name: str) -> Linear:  # kept in the compute dtype, as shard.quant keeps it
            return Linear(get(name), pack=pack)

        def dense(gate_up: Linear, down: str) -> DenseMLP:
            return DenseMLP(gate_up, linear(down), cfg.activation)

        layout = cfg.family.layout
        if layout == "phi3":  # the checkpoint fuses them already, in our order
            qkv = linear("self_attn.qkv_proj.weight")
        else:
            bias = torch.cat([get(f"self_attn.{p}_proj.bias") for p in "qkv"]) if cfg.qkv_bias else None
            qkv = linear(*(f"self_attn.{p}_proj.weight" for p in "qkv"), bias=bias)
        if cfg.is_moe_layer(layer):
            prefix, (gate, up, down) = MOE_NAMES[layout]
            ex = [f"{prefix}experts.{e}." for e in range(cfg.num_experts)]
            experts = [dense(linear(f"{x}{gate}.weight", f"{x}{up}.weight"), f"{x}{down}.weight") for x in ex]
            shared = shared_gate = None
            if cfg.shared_expert_intermediate_size:
                s = prefix + "shared_expert."
                shared = dense(linear(s + "gate_proj.weight", s + "up_proj.weight"), s + "down_proj.weight")
                shared_gate = router(prefix + "shared_expert_gate.weight")
            mlp = MixtureOfExperts(router(prefix + "gate.weight"), experts, cfg.experts_per_token, cfg.norm_topk_prob,
                                   shared, shared_gate)
        elif layout == "phi3":
            mlp = dense(linear("mlp.gate_up_proj.weight"), "mlp.down_proj.weight")
        else:
            mlp = dense(linear("mlp.gate_proj.weight", "mlp.up_proj.weight"), "mlp.down_proj.weight")
        # Sandwich-normed families (Gemma) name the norm after attention for its output.
        mlp_norm = "pre_feedforward_layernorm.weight" if cfg.sandwich_norms else "post_attention_layernorm.weight"
        return cls(
            attn_norm=norm("input_layernorm.weight"),
            qkv=qkv,
            o=linear("self_attn.o_proj.weight"),
            mlp_norm=norm(mlp_norm),
            mlp=mlp,
            sliding=layer in cfg.sliding_layers,
            q_norm=norm("self_attn.q_norm.weight") if cfg.qk_norm else None,
            k_norm=norm("self_attn.k_norm.weight") if cfg.qk_norm else None,
            attn_out_norm=norm("post_attention_layernorm.weight") if cfg.sandwich_norms else None,
            mlp_out_norm=norm("post_feedforward_layernorm.weight") if cfg.sandwich_norms else None,
        )
