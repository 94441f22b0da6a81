"""The feed-forward blocks a layer may hold, and the RMSNorm every family uses.

A dense gated MLP (SwiGLU, or GeGLU for Gemma) and a mixture of experts (router top-k
over dense experts, plus a sigmoid-gated shared expert where the model has one). Each is
a callable (T, H) -> (T, H) over weights fixed at load, so the stage forward calls
`w.mlp(x)` whatever the family. Knows nothing of attention, caches, the wire or names of
tensors in checkpoints (shard.layer_weights).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from shard.linear import Linear

# The activation names configs use (hidden_act / hidden_activation) -> the function.
ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 whatever the compute dtype, then scale in the compute dtype.
    # Families that store (weight - 1) (Gemma) have the 1 added back at load.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class DenseMLP:
    """down(act(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, gate_up: Linear, down: Linear, activation: str) -> None:
        self.gate_up, self.down, self.act = gate_up, down, ACTIVATIONS[activation]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # (T, I) each
        return self.down(self.act(gate) * up)  # (T, H)


class MixtureOfExperts:
    """Each token runs its top-k experts by router probability, summed with those weights.

    The probabilities are a softmax over all experts (in fp32); `normalise` rescales the
    chosen k to sum to 1 (Mixtral always; Qwen MoE when its config's norm_topk_prob says).
    A shared expert, where present, runs on every token, scaled by sigmoid(shared_gate(x)).
    """

    def __init__(self, router: Linear, experts: list[DenseMLP], top_k: int, normalise: bool,
                 shared: DenseMLP | None = None, shared_gate: Linear | None = None) -> None:
        self.router, self.experts, self.top_k, self.normalise = router, experts, top_k, normalise
        self.shared, self.shared_gate = shared, shared_gate

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.router(x).float(), dim=-1)  # (T, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (T, K) each
        if self.normalise:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(x)  # (T, H)
        # Expert by expert over the tokens that chose it: each expert's weights are read
        # once per frame, and an expert no token chose costs nothing.
        for e in chosen.unique().tolist():
            rows, pick = (chosen == e).nonzero(as_tuple=True)  # tokens routed to e, and which of their k
            out.index_add_(0, rows, self.experts[e](x[rows]) * weights[rows, pick, None])
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out
