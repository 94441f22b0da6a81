"""Family facts read from HF configs: what each family resolves to, and what is refused.

Guards `prepare` failing early and by name on maths the runtime does not do (a rope type,
logit soft-capping, partial rotary), rather than serving a model that computes nonsense,
and the facts a config states in older spellings (Gemma 3 before layer_types, Phi-3's
"su" rope) reading the same as the new ones.
"""

from __future__ import annotations

import json

import pytest

from shard.arch import ModelConfig
from shard.errors import UnsupportedModelError
from shard.store import prepare

BASE = dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)


def test_gemma3_config_before_layer_types():
    # A Gemma 3 config.json as transformers 4.50 wrote it: sliding_window_pattern, a local
    # rope base and the global rope's linear scaling under rope_scaling.
    cfg = ModelConfig.from_hf(dict(BASE, model_type="gemma3_text", head_dim=16, sliding_window=512,
                                   sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
                                   rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=256,
                                   hidden_activation="gelu_pytorch_tanh", final_logit_softcapping=None))
    assert cfg.sliding_layers == (0, 1, 2, 3, 4) and cfg.sliding_window == 512
    assert (cfg.rope_type, cfg.rope_theta, cfg.local_rope_theta) == ("linear", 1e6, 1e4)
    assert cfg.attention_scale == 256 ** -0.5 and cfg.embedding_scale == 8.0 and cfg.norm_offset == 1.0
    assert cfg.activation == "gelu_pytorch_tanh" and cfg.qk_norm and cfg.sandwich_norms


def test_gemma3_layer_types_and_per_type_rope():
    cfg = ModelConfig.from_hf(dict(BASE, model_type="gemma3_text", head_dim=16, sliding_window=8,
                                   layer_types=["sliding_attention", "full_attention"] * 3, rope_parameters={
                                       "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}))
    assert cfg.sliding_layers == (0, 2, 4) and (cfg.rope_theta, cfg.local_rope_theta) == (1e6, 1e4)


def test_mistral_and_qwen_windows():
    # Mistral's window applies to every layer unless use_sliding_window is false; Qwen's
    # only when use_sliding_window, from max_window_layers on.
    assert ModelConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=16)).sliding_layers == tuple(range(6))
    assert ModelConfig.from_hf(dict(BASE, model_type="qwen2", sliding_window=16)).sliding_layers == ()
    qwen = ModelConfig.from_hf(dict(BASE, model_type="qwen2", sliding_window=16, use_sliding_window=True, max_window_layers=4))
    assert qwen.sliding_layers == (4, 5)
    assert ModelConfig.from_hf(dict(BASE, model_type="mistral", sliding_window=None)).sliding_window is None


def test_moe_facts():
    mixtral = ModelConfig.from_hf(dict(BASE, model_type="mixtral", num_local_experts=8, num_experts_per_tok=2))
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 128)
    assert mixtral.norm_topk_prob and all(mixtral.is_moe_layer(i) for i in range(6))
    qwen = ModelConfig.from_hf(dict(BASE, model_type="qwen3_moe", num_experts=16, num_experts_per_tok=4,
                                    moe_intermediate_size=32, mlp_only_layers=[5], decoder_sparse_step=2))
    assert not qwen.norm_topk_prob and qwen.expert_intermediate_size == 32
    assert [qwen.is_moe_layer(i) for i in range(6)] == [False, True, False, True, False, False]


def test_phi3_su_rope_is_longrope():
    cfg = ModelConfig.from_hf(dict(BASE, model_type="phi3", original_max_position_embeddings=64, rope_scaling={
        "type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}))
    assert cfg.rope_type == "longrope" and cfg.rope_factors("long_factor") == (2.0,) * 8
    assert cfg.rope_param("original_max_position_embeddings") == 64


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "mixtral", "qwen3_moe", "phi3", "gemma3_text"])
def test_config_round_trips_through_the_manifest_dict(model_type):
    # The manifest stores to_dict() as JSON and checks from_dict(...) == from_hf(config).
    hf = dict(BASE, model_type=model_type, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
              rope_scaling={"type": "su", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8},
              original_max_position_embeddings=64) if model_type == "phi3" else dict(
        BASE, model_type=model_type, num_experts=4 if "moe" in model_type else 0, num_experts_per_tok=2,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3)
    cfg = ModelConfig.from_hf(hf)
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gemma3"}, "unsupported model family: 'gemma3'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope_type: 'dynamic'"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, "unsupported partial_rotary_factor: 0.75"),
    ({"attn_logit_softcapping": 50.0}, "unsupported attn_logit_softcapping: 50.0"),
    ({"final_logit_softcapping": 30.0}, "unsupported final_logit_softcapping: 30.0"),
    ({"hidden_act": "gelu"}, "unsupported activation: 'gelu'"),
    ({"sliding_window": 8, "layer_types": ["chunked_attention"] * 6}, "unsupported layer type: 'chunked_attention'"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "unsupported rope_type of sliding layers: 'linear'"),
])
def test_unimplemented_options_are_refused_by_name(change, message):
    with pytest.raises(UnsupportedModelError) as info:
        ModelConfig.from_hf({**BASE, "model_type": "qwen3", **change})
    assert str(info.value).startswith(message)


def test_prepare_refuses_before_writing(tiny_model_factory, tmp_path):
    # Sound: the refusal comes from prepare on a real HF dir, and leaves no store behind.
    import shutil

    src = tmp_path / "src"
    shutil.copytree(tiny_model_factory("qwen3", head_dim=16).path, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported rope_type: 'dynamic'"):
        prepare(str(src), tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()
