"""The architecture facts a stage needs, read from a Hugging Face config dict.

Knows the Llama family (Llama, Mistral, Qwen2, SmolLM2) and nothing of files or torch.
This is the one place that says which families and rope variants the runtime supports.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from shard.errors import UnsupportedModelError

# model_type -> whether q/k/v projections carry a bias. Everything else about these
# families is read from the config itself.
SUPPORTED_FAMILIES = {"llama": False, "mistral": False, "qwen2": True}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
SUPPORTED_ACTIVATIONS = ("silu",)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_type: str = "default"
    # Extra rope parameters for non-default rope types (factor, low_freq_factor, ...),
    # stored as sorted (key, value) pairs so the config stays hashable.
    rope_params: tuple[tuple[str, float], ...] = ()
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def max_context_tokens(self) -> int:
        # Past the sliding window, Mistral-style attention would drop old keys; the runtime
        # attends to the whole context, so it caps the context there to stay exact.
        if self.sliding_window:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token_per_layer_f32(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 4

    def rope_param(self, key: str, default: float | None = None) -> float:
        for k, v in self.rope_params:
            if k == key:
                return v
        if default is None:
            raise UnsupportedModelError(f"rope parameter {key!r} for rope_type", self.rope_type, "present in config")
        return default

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_params"] = [list(p) for p in self.rope_params]
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_params"] = tuple((str(k), float(v)) for k, v in d.get("rope_params", ()))
        d["eos_token_ids"] = tuple(int(t) for t in d.get("eos_token_ids", ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a transformers config dict (`PretrainedConfig.to_dict()` or config.json)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError("model family", model_type, sorted(SUPPORTED_FAMILIES))
        act = hf.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError("activation", act, SUPPORTED_ACTIVATIONS)
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias", True, [False])
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = str(rope.pop("rope_type", rope.pop("type", "default")))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError("rope_type", rope_type, SUPPORTED_ROPE_TYPES)
        params = tuple(sorted((k, float(v)) for k, v in rope.items() if isinstance(v, (int, float)) and not isinstance(v, bool)))
        qkv_bias = SUPPORTED_FAMILIES[model_type] or bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", model_type == "mistral") else None
        return cls(
            model_type=model_type,
            num_layers=int(hf["num_hidden_layers"]),
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),
            num_heads=num_heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            vocab_size=int(hf["vocab_size"]),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            rope_type=rope_type,
            rope_params=params,
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_ids),
        )
