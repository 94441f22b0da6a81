"""The architecture facts a stage needs, read from a Hugging Face config dict.

One table row per supported family (`SUPPORTED_FAMILIES`: the facts its checkpoints imply
that the config does not state), and `ModelConfig`, the resolved facts of one model. This
is the one place that says which families, rope variants, activations and config options
the runtime supports; anything else is refused here, naming the option, so `prepare` fails
before any heavy work. Knows nothing of files, tensors' names or torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from shard.errors import UnsupportedModelError


@dataclass(frozen=True)
class Family:
    """What a model_type's checkpoints imply beyond their config."""

    qkv_bias: bool = False  # q/k/v always carry a bias (else the config's attention_bias says)
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary
    norm_offset: float = 0.0  # norms scale by (offset + weight): Gemma stores weight - 1
    sandwich_norms: bool = False  # attention and MLP outputs are normed before the residual add
    scale_embedding: bool = False  # embeddings are multiplied by sqrt(hidden)
    sliding_by_default: bool = False  # a config's sliding_window applies unless use_sliding_window is false
    norm_topk_prob: bool = False  # MoE: renormalise the top-k router weights when the config is silent
    local_rope_theta: float | None = None  # default-rope base of sliding layers when the config is silent
    layout: str = "llama"  # checkpoint tensor naming (shard.manifest.layer_tensor_shapes)


SUPPORTED_FAMILIES = {
    "llama": Family(),
    "mistral": Family(sliding_by_default=True),
    "qwen2": Family(qkv_bias=True),
    "qwen3": Family(qk_norm=True),
    "mixtral": Family(sliding_by_default=True, norm_topk_prob=True, layout="mixtral"),
    "qwen2_moe": Family(qkv_bias=True, layout="qwen_moe"),
    "qwen3_moe": Family(qk_norm=True, layout="qwen_moe"),
    "phi3": Family(sliding_by_default=True, layout="phi3"),
    "gemma3_text": Family(qk_norm=True, norm_offset=1.0, sandwich_norms=True, scale_embedding=True, local_rope_theta=1e4),
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # shard.blocks.ACTIVATIONS implements them
# Config keys whose presence with a truthy value means maths this runtime does not do.
UNSUPPORTED_OPTIONS = ("mlp_bias", "attn_logit_softcapping", "final_logit_softcapping", "use_bidirectional_attention")


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
    # Extra rope parameters for non-default rope types (factor, low_freq_factor, ...; a
    # tuple for per-frequency factors), as sorted (key, value) pairs so the config hashes.
    rope_params: tuple[tuple[str, float | tuple[float, ...]], ...] = ()
    sliding_window: int | None = None  # positions a layer in `sliding_layers` attends back to
    sliding_layers: tuple[int, ...] = ()
    local_rope_theta: float | None = None  # default-rope base of the sliding layers; None: the global rope
    qk_norm: bool = False
    attention_scale: float | None = None  # softmax scale; None: 1/sqrt(head_dim)
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    embedding_scale: float = 1.0
    activation: str = "silu"  # of the gated MLP
    # Mixture of experts (num_experts == 0: every layer has the dense MLP).
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: tuple[int, ...] = ()  # layers of an MoE model that keep the dense MLP
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def family(self) -> Family:
        return SUPPORTED_FAMILIES[self.model_type]

    @property
    def max_context_tokens(self) -> int:
        # Sliding layers mask exactly (shard.stage), so the window does not cap the context.
        return self.max_position_embeddings

    @property
    def kv_bytes_per_token_per_layer_f32(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * 4

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    def rope_param(self, key: str, default: float | None = None) -> float:
        for k, v in self.rope_params:
            if k == key and not isinstance(v, tuple):
                return v
        if default is None:
            raise UnsupportedModelError(f"rope parameter {key!r} for rope_type", self.rope_type, "present in config")
        return default

    def rope_factors(self, key: str) -> tuple[float, ...]:
        for k, v in self.rope_params:
            if k == key and isinstance(v, tuple):
                return v
        raise UnsupportedModelError(f"rope parameter {key!r} for rope_type", self.rope_type, "a list in config")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["rope_params"] = [[k, list(v) if isinstance(v, tuple) else v] for k, v in self.rope_params]
        for f in fields(self):
            if isinstance(d[f.name], tuple):
                d[f.name] = list(d[f.name])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["rope_params"] = tuple((str(k), _rope_value(v)) for k, v in d.get("rope_params", ()))
        for key in ("sliding_layers", "dense_layers", "eos_token_ids"):
            d[key] = tuple(int(t) for t in d.get(key, ()))
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Read a transformers config dict (`PretrainedConfig.to_dict()` or config.json)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_FAMILIES:
            raise UnsupportedModelError("model family", model_type, sorted(SUPPORTED_FAMILIES))
        fam = SUPPORTED_FAMILIES[model_type]
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in SUPPORTED_ACTIVATIONS:
            raise UnsupportedModelError("activation", act, SUPPORTED_ACTIVATIONS)
        for option in UNSUPPORTED_OPTIONS:
            if hf.get(option):
                raise UnsupportedModelError(option, hf[option], [None, False])
        num_layers = int(hf["num_hidden_layers"])
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        head_dim = int(hf.get("head_dim") or hidden // num_heads)
        rope_theta, rope_type, params, local_theta = _rope(hf)
        window, sliding = _sliding(hf, fam, num_layers)
        if local_theta is None and sliding:
            local_theta = fam.local_rope_theta
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        scalar = hf.get("query_pre_attn_scalar")
        return cls(
            model_type=model_type,
            num_layers=num_layers,
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
            qkv_bias=fam.qkv_bias or bool(hf.get("attention_bias", False)),
            rope_type=rope_type,
            rope_params=params,
            sliding_window=window,
            sliding_layers=sliding,
            local_rope_theta=local_theta,
            qk_norm=fam.qk_norm,
            attention_scale=float(scalar) ** -0.5 if scalar else None,
            norm_offset=fam.norm_offset,
            sandwich_norms=fam.sandwich_norms,
            embedding_scale=hidden ** 0.5 if fam.scale_embedding else 1.0,
            activation=act,
            **_moe(hf, fam, num_layers),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(int(t) for t in eos_ids),
        )


def _rope_value(v: Any) -> float | tuple[float, ...]:
    return tuple(float(x) for x in v) if isinstance(v, (list, tuple)) else float(v)


def _rope(hf: dict[str, Any]) -> tuple[float, str, tuple, float | None]:
    """(global theta, global rope type, its parameters, default-rope theta of sliding layers or None)."""
    # transformers >= 5 folds rope_theta and rope_scaling into rope_parameters, keyed by
    # layer type when sliding and full layers rotate differently (Gemma 3).
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    local_theta = hf.get("rope_local_base_freq")
    if "full_attention" in rope:
        local = dict(rope.get("sliding_attention") or {})
        rope = dict(rope["full_attention"])
        if local:
            if local.get("rope_type", "default") != "default":
                raise UnsupportedModelError("rope_type of sliding layers", local.get("rope_type"), ["default"])
            local_theta = local.get("rope_theta")
    rope_theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = str(rope.pop("rope_type", rope.pop("type", "default")))
    rope_type = {"su": "longrope"}.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError("rope_type", rope_type, SUPPORTED_ROPE_TYPES)
    if float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor") or 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor", rope.get("partial_rotary_factor"), [1.0])
    if rope_type != "default" and "original_max_position_embeddings" not in rope and hf.get("original_max_position_embeddings"):
        rope["original_max_position_embeddings"] = hf["original_max_position_embeddings"]
    params = tuple(sorted((k, _rope_value(v)) for k, v in rope.items() if _is_number(v) or
                          (isinstance(v, (list, tuple)) and all(_is_number(x) for x in v))))
    return rope_theta, rope_type, params, float(local_theta) if local_theta is not None else None


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _sliding(hf: dict[str, Any], fam: Family, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers that use it): from layer_types where the config lists them, else
    Mistral-style (every layer from max_window_layers on, when use_sliding_window)."""
    window = hf.get("sliding_window")
    types = hf.get("layer_types")
    if types is not None:
        bad = sorted(set(types) - {"sliding_attention", "full_attention"})
        if bad:
            raise UnsupportedModelError("layer type", bad[0], ["sliding_attention", "full_attention"])
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif hf.get("sliding_window_pattern"):  # Gemma 3 configs written before layer_types
        pattern = int(hf["sliding_window_pattern"])
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    elif (fam.sliding_by_default if hf.get("use_sliding_window") is None else hf["use_sliding_window"]):
        layers = tuple(range(int(hf.get("max_window_layers") or 0), num_layers))
    else:
        layers = ()
    if not window or not layers:
        return None, ()
    return int(window), layers


def _moe(hf: dict[str, Any], fam: Family, num_layers: int) -> dict[str, Any]:
    """The MoE fields of ModelConfig (empty for a dense model)."""
    experts = int(hf.get("num_local_experts") or hf.get("num_experts") or 0)
    if not experts:
        return {}
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in hf.get("mlp_only_layers") or ()} | {i for i in range(num_layers) if (i + 1) % step}
    return dict(
        num_experts=experts,
        experts_per_token=int(hf["num_experts_per_tok"]),
        expert_intermediate_size=int(hf.get("moe_intermediate_size") or hf["intermediate_size"]),
        norm_topk_prob=bool(hf.get("norm_topk_prob", fam.norm_topk_prob)),
        shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size") or 0),
        dense_layers=tuple(sorted(dense)),
    )
