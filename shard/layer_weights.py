"""One decoder layer's weights, from the store's per-layer dict to what the forward runs.

Reads tensors by their checkpoint names (the family's layout: shard.manifest lists the
same names with their shapes), fuses q/k/v and gate/up into single matmuls, folds a
family's norm offset into its norm weights, and lays every matmul weight out for its
device (shard.linear). Transforms on the weights, so the forward has no family branches.
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
            return t[name].to(device=device, dtype=dtype)

        def norm(name: str) -> torch.Tensor:
            # The offset is added in fp32, as Gemma's own norm does, before any cast down.
            return (t[name].float() + cfg.norm_offset).to(device=device, dtype=dtype)

        def linear(*names: str) -> Linear:
            return Linear(torch.cat([get(n) for n in names]), pack=pack)

        def dense(gate_up: Linear, down: str) -> DenseMLP:
            return DenseMLP(gate_up, linear(down), cfg.activation)

        layout = cfg.family.layout
        if layout == "phi3":  # the checkpoint fuses them already, in our order
            qkv = Linear(get("self_attn.qkv_proj.weight"), pack=pack)
        else:
            bias = torch.cat([get(f"self_attn.{p}_proj.bias") for p in "qkv"]) if cfg.qkv_bias else None
            qkv = Linear(torch.cat([get(f"self_attn.{p}_proj.weight") for p in "qkv"]), bias, pack=pack)
        if cfg.is_moe_layer(layer):
            prefix, (gate, up, down) = MOE_NAMES[layout]
            ex = [f"{prefix}experts.{e}." for e in range(cfg.num_experts)]
            experts = [dense(linear(f"{x}{gate}.weight", f"{x}{up}.weight"), f"{x}{down}.weight") for x in ex]
            shared = shared_gate = None
            if cfg.shared_expert_intermediate_size:
                s = prefix + "shared_expert."
                shared = dense(linear(s + "gate_proj.weight", s + "up_proj.weight"), s + "down_proj.weight")
                shared_gate = linear(prefix + "shared_expert_gate.weight")
            mlp = MixtureOfExperts(linear(prefix + "gate.weight"), experts, cfg.experts_per_token, cfg.norm_topk_prob,
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
