"""What is being served and asked for: the model's size facts and the request's shape.

Pure data. Knows nothing of nodes, links or plans. Each byte fact lives here, once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ring.errors import InvalidInputError


@dataclass(frozen=True)
class ModelSpec:
    """The served model as the cost model needs it (not its weights or architecture)."""

    name: str
    num_layers: int
    bytes_per_layer: int  # weights of one decoder layer as stored on the node
    kv_bytes_per_token_layer: int  # K and V for one position of one layer
    activation_bytes_per_token: int  # one hidden state on the wire, in the chosen wire dtype
    token_id_bytes: int = 4  # what the coordinator sends the head per token (int32 ids)
    # What the head stage holds beyond its layers: the token embedding as stored
    # (SmolLM2 f32: 113 MB, ~8 of its 30 layers; Llama-70B f16: 2.1 GB, more than one).
    head_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "bytes_per_layer", "activation_bytes_per_token"):
            if getattr(self, name) <= 0:
                raise InvalidInputError(f"model {name}", getattr(self, name))
        for name in ("kv_bytes_per_token_layer", "token_id_bytes", "head_bytes"):
            if getattr(self, name) < 0:
                raise InvalidInputError(f"model {name}", getattr(self, name))

    @classmethod
    def llama_like(
        cls, name: str, num_layers: int, hidden: int, kv_heads: int, head_dim: int, params_per_layer: int,
        weight_bytes_per_param: float = 2.0, kv_bytes_per_value: int = 2, wire_bytes_per_value: int = 2,
    ) -> "ModelSpec":
        """Derive the byte facts of a Llama-family model from its shape."""
        return cls(
            name=name,
            num_layers=num_layers,
            bytes_per_layer=int(params_per_layer * weight_bytes_per_param),
            kv_bytes_per_token_layer=2 * kv_heads * head_dim * kv_bytes_per_value,  # K and V
            activation_bytes_per_token=hidden * wire_bytes_per_value,
        )

    def layer_bytes_with_kv(self, context_tokens: int, bytes_per_layer: int = 0) -> int:
        """Memory one layer needs on a stage: weights (`bytes_per_layer` where the node holds
        them otherwise, e.g. quantised; 0: as stored) plus its KV cache for the context."""
        return (bytes_per_layer or self.bytes_per_layer) + self.kv_bytes_per_token_layer * context_tokens


@dataclass(frozen=True)
class Workload:
    """The request the ring is chosen for (typically the expected or current one)."""

    prompt_tokens: int
    output_tokens: int
    prefill_chunk_tokens: int = 512
    round_tokens: int = 5  # positions carried per decode traversal (draft K=4 + 1)
    expected_tokens_per_traversal: float = 2.5  # committed per traversal, from acceptance stats

    def __post_init__(self) -> None:
        for name in ("prompt_tokens", "prefill_chunk_tokens", "round_tokens"):
            if getattr(self, name) < 1:
                raise InvalidInputError(f"workload {name}", getattr(self, name))
        if self.output_tokens < 1:
            raise InvalidInputError("workload output_tokens", self.output_tokens)
        if not (1.0 <= self.expected_tokens_per_traversal <= self.round_tokens):
            raise InvalidInputError("workload expected_tokens_per_traversal", self.expected_tokens_per_traversal)

    @property
    def context_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def num_chunks(self) -> int:
        return math.ceil(self.prompt_tokens / self.prefill_chunk_tokens)

    @property
    def tokens_per_chunk(self) -> float:
        # The scheduler splits the prompt into equal chunks, so every chunk costs the same
        # and the flow-shop makespan formula in ring.cost is exact.
        return self.prompt_tokens / self.num_chunks

    @property
    def decode_traversals(self) -> float:
        # The first output token comes from the prefill's last logits; the rest need
        # traversals, each committing expected_tokens_per_traversal on average.
        return (self.output_tokens - 1) / self.expected_tokens_per_traversal
