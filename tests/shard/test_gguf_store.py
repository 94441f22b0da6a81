"""A GGUF's quantised blocks kept quantised in the store (shard.gguf_quant.read_grids,
shard.quant_weights, shard.store.prepare) and loaded as quantised linears.

The model: a tiny Llama written here with the gguf library, whose layer matmuls mix every
block type we keep (Q4_0, Q4_1, Q4_K, Q8_0) with an F16 one that stays float, and whose q/k
rows llama.cpp-style permuted storage transformers undoes on load. Guards: a weight
stored under the wrong name or with q/k rows in the GGUF's order (its grid would not be
what transformers loads: the grid-vs-transformers bound fails by orders of magnitude), a
store that inflates the blocks to f32 (the byte count below is exact to the tensor), a
node that requantises what it loads (the loaded linears must multiply by the stored grid,
bit for bit), and a forward that mis-reads the grids (the stage is held to the bf16 bound of
shard.quant's tests against f32 on the dequantised grid). Bounds: the stored grid keeps
the GGUF's nibbles and rounds each block's scale and zero to bf16, so each weight may move
by (8 |s| + |z|) 2^-8 from transformers' value (Q8_0: half a per-channel int8 step).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, quants

from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.linear import Linear
from shard.manifest import layer_file, layer_tensor_shapes
from shard.quant import SCHEMES, Int4Linear, Int8Linear, QuantError, effective_scheme, quantise_stage, scheme
from shard.quant_weights import QuantWeight
from shard.sources import checkpoint_state, locate_alias
from shard.stage import Stage
from shard.store import TORCH_DTYPES, prepare

U = 2.0 ** -8  # bf16's unit roundoff
H, I, LAYERS, VOCAB = 256, 512, 2, 1024  # Q4_K's 256-input blocks need K % 256 == 0
# arch -> (heads, kv heads, head dim): llama stores q/k rows permuted (transformers undoes
# it), qwen3 does not and adds q/k norms; transformers reads qwen3's head dim as 128.
FAMILIES = {"llama": (4, 2, 64), "qwen3": (2, 1, 128), "qwen3moe": (2, 1, 128)}
EXPERTS, EXPERT_I = 4, 768  # qwen3moe: transformers reads no expert width from a GGUF (its default 768)
TYPES = [  # per layer: q, k, v, o, gate, up, down
    dict(attn_q="Q4_0", attn_k="Q4_0", attn_v="Q4_0", attn_output="Q8_0", ffn_gate="Q4_1", ffn_up="Q4_1", ffn_down="Q4_K"),
    dict(attn_q="Q4_K", attn_k="Q4_1", attn_v="F16", attn_output="Q4_1", ffn_gate="Q8_0", ffn_up="Q8_0", ffn_down="Q4_0"),
]


def _shapes(arch: str) -> dict[str, tuple[int, int]]:
    heads, kv, d = FAMILIES[arch]
    return dict(attn_q=(heads * d, H), attn_k=(kv * d, H), attn_v=(kv * d, H), attn_output=(H, heads * d),
                ffn_gate=(I, H), ffn_up=(I, H), ffn_down=(H, I))


def _q4_k(rng, n: int, k: int) -> np.ndarray:
    # gguf has no Q4_K quantiser: random blocks with small positive f16 d and dmin.
    raw = rng.integers(0, 256, (n, k // 256, 144), dtype=np.uint8)
    for at in (0, 2):
        raw[..., at:at + 2] = (rng.random((n, k // 256)) * 2e-4).astype(np.float16).view(np.uint8).reshape(n, -1, 2)
    return raw.reshape(n, -1)


def write_gguf(path, arch: str) -> str:
    """A tiny `arch` model with TYPES' block types, written with the gguf library."""
    heads, kv, d = FAMILIES[arch]
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    for key, value in (("context_length", 256), ("embedding_length", H), ("block_count", LAYERS),
                       ("feed_forward_length", I), ("head_count", heads), ("head_count_kv", kv),
                       ("rope_dimension_count", d), ("key_length", d), ("value_length", d)):
        getattr(w, f"add_{key}")(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    if arch == "qwen3moe":
        w.add_expert_count(EXPERTS)
        w.add_expert_used_count(EXPERTS)  # every expert runs: no top-k choice for bf16 rounding to flip
    # A real tokenizer (SmolLM2's), so transformers reads the file: its first VOCAB tokens and
    # the merges among them (the whole 49k one costs a minute per load on the test machine).
    src = GGUFReader(str(locate_alias("smollm2-135m")))
    tokens = src.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    trimmed = {"tokenizer.ggml.tokens": tokens,
               "tokenizer.ggml.token_type": src.fields["tokenizer.ggml.token_type"].contents()[:VOCAB],
               "tokenizer.ggml.merges": [m for m in src.fields["tokenizer.ggml.merges"].contents()
                                         if (lambda a, b: a in kept and b in kept and a + b in kept)(*m.split(" ", 1))]}
    for key, f in src.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == GGUFValueType.ARRAY else None
            w.add_key_value(key, trimmed.get(key, f.contents()), f.types[0], sub)
    vocab = len(tokens)
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, H)) * 0.5).astype(np.float16))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    for i, types in enumerate(TYPES):
        w.add_tensor(f"blk.{i}.attn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", (1 + 0.1 * rng.standard_normal(H)).astype(np.float32))
        if arch == "qwen3moe":
            w.add_tensor(f"blk.{i}.ffn_gate_inp.weight", (0.1 * rng.standard_normal((EXPERTS, H))).astype(np.float32))
        if arch in ("qwen3", "qwen3moe"):
            for qk in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{qk}.weight", (1 + 0.1 * rng.standard_normal(d)).astype(np.float32))
        for name, kind in types.items():
            n, k = _shapes(arch)[name]
            if arch == "qwen3moe" and name.startswith("ffn_"):  # every expert's, as one (E, N, K) tensor
                n, k = (EXPERT_I, H) if name != "ffn_down" else (H, EXPERT_I)
                qt = GGMLQuantizationType[kind]
                experts = [_q4_k(rng, n, k) if kind == "Q4_K" else
                           quants.quantize((rng.standard_normal((n, k)) * 0.08).astype(np.float32), qt)
                           for _ in range(EXPERTS)]
                w.add_tensor(f"blk.{i}.{name}_exps.weight", np.stack(experts), raw_dtype=qt)
                continue
            if kind == "Q4_K":
                w.add_tensor(f"blk.{i}.{name}.weight", _q4_k(rng, n, k), raw_dtype=GGMLQuantizationType.Q4_K)
                continue
            dense = (rng.standard_normal((n, k)) * 0.08).astype(np.float32)
            if kind == "F16":
                w.add_tensor(f"blk.{i}.{name}.weight", dense.astype(np.float16))
            else:
                qt = GGMLQuantizationType[kind]
                w.add_tensor(f"blk.{i}.{name}.weight", quants.quantize(dense, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-mixed.gguf", "llama")


@pytest.fixture(scope="module")
def stored(tiny_gguf, tmp_path_factory):
    return prepare(tiny_gguf, tmp_path_factory.mktemp("store") / "s", progress=False).store


def _transformers_state(path: str) -> dict[str, torch.Tensor]:
    import pathlib

    from transformers import AutoModelForCausalLM

    p = pathlib.Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    return checkpoint_state(model)


@pytest.fixture(scope="module")
def transformers_state(tiny_gguf):
    return _transformers_state(tiny_gguf)


HF = dict(attn_q="self_attn.q_proj", attn_k="self_attn.k_proj", attn_v="self_attn.v_proj",
          attn_output="self_attn.o_proj", ffn_gate="mlp.gate_proj", ffn_up="mlp.up_proj", ffn_down="mlp.down_proj")


def test_each_block_is_stored_as_its_grid_and_equals_what_transformers_loads(stored, transformers_state):
    assert_grids_are_transformers_weights(stored, transformers_state)


def test_a_qwen3_gguf_is_kept_quantised_too(tmp_path):
    """Qwen3: no q/k row permutation in its GGUF (a llama-only undo applied here would
    scramble q and k), q/k norms beside the kept weights."""
    path = write_gguf(tmp_path / "tiny-qwen3.gguf", "qwen3")
    store = prepare(path, tmp_path / "s", progress=False).store
    assert store.config.model_type == "qwen3" and store.config.qk_norm
    assert_grids_are_transformers_weights(store, _transformers_state(path))


def assert_grids_are_transformers_weights(stored, transformers_state) -> None:
    assert stored.manifest.quant == "int4"
    for i, types in enumerate(TYPES):
        tensors = stored.load_layers(LayerRange(i, i + 1))[i]
        for gg, kind in types.items():
            name = f"{HF[gg]}.weight"
            want = transformers_state[f"model.layers.{i}.{name}"]
            grid = QuantWeight.from_tensors(tensors, name)
            if kind == "F16":
                assert grid is None and torch.equal(tensors[name], want), name  # stays float, exactly
                continue
            assert grid.kind == ("int8" if kind == "Q8_0" else "int4"), (i, name)
            got = grid.dequantised()
            if kind == "Q8_0":
                slack = grid.scales.float()[:, None] / 2 * 1.001 + 1e-7
            else:
                assert grid.group_size == 32
                s, z = grid.scales.float(), grid.zeros.float()
                slack = ((8 * s.abs() + z.abs()) * U).repeat_interleave(32, dim=1) * 1.01 + 1e-7
            err = (got - want).abs()
            assert (err <= slack).all(), (i, name, kind, float((err - slack).max()))


def test_the_store_holds_the_quantised_bytes_not_f32(stored):
    """Payload bytes of each layer file, from its tensor entries, equal exactly: every kept
    weight at its scheme's size (values + bf16 scales (+ zeros)), the F16 one and the norms in
    f32; and the manifest's layer bytes (the file sizes the selector reads) are under 0.3x f32."""
    cfg = stored.config
    for i, types in enumerate(TYPES):
        entry = stored.manifest.files[layer_file(i)]
        payload = sum(int(np.prod(t.shape)) * TORCH_DTYPES[t.dtype].itemsize for t in entry.tensors.values())
        want = 0
        for name, shape in layer_tensor_shapes(cfg, i).items():
            gg = next((g for g, h in HF.items() if name == f"{h}.weight"), None)
            kind = types.get(gg, "F32")
            q = SCHEMES["int8" if kind == "Q8_0" else "int4" if kind.startswith("Q4") else "none"]
            want += q.weight_bytes(*shape, 4) if len(shape) == 2 else 4 * shape[0]
        assert payload == want, i
        f32 = sum(4 * int(np.prod(s)) for s in layer_tensor_shapes(cfg, i).values())
        assert stored.manifest.layer_bytes[i] == entry.bytes < 0.3 * f32 + 0.3 * (4 * I * H)  # v_proj is f32


def test_a_node_loads_the_grids_as_they_are_and_the_stage_runs_them(stored):
    cfg = stored.config
    r = LayerRange(0, cfg.num_layers)
    q = effective_scheme(stored.manifest.quant, "none")
    stage = quantise_stage(Stage(cfg, r, stored.load_layers(r), embedding=stored.load_embedding()), q)
    b0, b1 = stage.blocks
    assert isinstance(b0.qkv, Int4Linear) and isinstance(b0.o, Int8Linear) and isinstance(b0.mlp.gate_up, Int4Linear)
    assert isinstance(b1.mlp.gate_up, Int8Linear) and isinstance(b1.mlp.down, Int4Linear)
    assert isinstance(b1.qkv, Int4Linear)  # Q4_K + Q4_1 + F16 fused in f32, then quantised by the node's scheme
    # Not requantised: the loaded linear multiplies by the stored grid, bit for bit.
    tensors = stored.load_layers(LayerRange(0, 1))[0]
    down = QuantWeight.from_tensors(tensors, "mlp.down_proj.weight")
    assert torch.equal(b0.mlp.down.dequantised(), down.dequantised())
    assert torch.equal(b0.o.dequantised(), QuantWeight.from_tensors(tensors, "self_attn.o_proj.weight").dequantised())
    # The forward against f32 on the dequantised grids: the kernels' bf16 rounding, no more.
    reference = Stage(cfg, r, stored.load_layers(r), embedding=stored.load_embedding())
    for qw, rw in zip(stage.blocks, reference.blocks):
        rw.qkv, rw.o = Linear(qw.qkv.dequantised()), Linear(qw.o.dequantised())
        rw.mlp.gate_up, rw.mlp.down = Linear(qw.mlp.gate_up.dequantised()), Linear(qw.mlp.down.dequantised())
    outs = []
    for s in (stage, reference):
        job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 24).open("j", 32)
        ids = torch.arange(5, 21)
        prefill, _ = s.forward(job, ids, ctx_len=0, positions=torch.arange(16))
        chain, _ = s.forward(job, ids[:3], ctx_len=16, positions=torch.arange(16, 19))
        outs.append(torch.cat([prefill, chain]))
    got, want = outs
    rms = want.pow(2).mean(dim=1, keepdim=True).sqrt()
    assert ((got - want).abs() <= 4 * 2 * U * cfg.num_layers * rms).all(), float(((got - want).abs() / rms).max())
    assert not torch.equal(got, want)  # the kernels did run (bf16 activations)


def test_a_quantised_store_runs_its_own_scheme_and_refuses_another():
    assert effective_scheme("none", "int8") is SCHEMES["int8"]
    assert effective_scheme("int4", "none") is SCHEMES["int4"] is effective_scheme("int4", "int4")
    with pytest.raises(QuantError, match=r"--quant int8 on a store kept quantised as int4"):
        effective_scheme("int4", "int8")
    assert scheme("int4").quantised


def test_serve_refuses_local_nodes_a_quantisation_the_store_cannot_run(tiny_gguf, stored, capsys):
    """`shard-coord serve --local-nodes N --node-quant int8` on a store kept as int4: one
    line before anything starts, not N nodes that each fail to load their slices."""
    from coordinator.cli import main

    argv = ["serve", "--model", tiny_gguf, "--store-dir", str(stored.root), "--local-nodes", "2", "--node-quant", "int8",
            "--listen", "/ip4/127.0.0.1/tcp/0", "--http", "127.0.0.1:0"]
    assert main(argv) == 1
    assert capsys.readouterr().err == ("shard-coord serve: error: --quant int8 on a store kept quantised as int4 (use "
                                       "--quant none or int4, or prepare the model from a float source) (limit int4, got "
                                       "int8)\n")


def test_a_qwen3_moe_gguf_keeps_each_experts_blocks(tmp_path):
    """Qwen3-MoE: each (E, N, K) expert tensor is split per expert under the checkpoint's
    names (transformers leaves a GGUF's experts fused: shard.sources splits them, gate rows
    first), each expert's grid equals transformers' weight, the router stays f32, and the
    quantised MoE stage stays within the bf16 bound of f32 on its dequantised grids."""
    path = write_gguf(tmp_path / "tiny-qwen3moe.gguf", "qwen3moe")
    store = prepare(path, tmp_path / "s", progress=False).store
    cfg = store.config
    assert (cfg.model_type, cfg.num_experts, store.manifest.quant) == ("qwen3_moe", EXPERTS, "int4")
    state = _transformers_state(path)
    for i, types in enumerate(TYPES):
        tensors = store.load_layers(LayerRange(i, i + 1))[i]
        assert torch.equal(tensors["mlp.gate.weight"], state[f"model.layers.{i}.mlp.gate.weight"])  # the router: f32
        for gg, proj in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
            for e in range(EXPERTS):
                name = f"mlp.experts.{e}.{proj}.weight"
                grid = QuantWeight.from_tensors(tensors, name)
                assert grid.kind == ("int8" if types[gg] == "Q8_0" else "int4"), name
                s, z = grid.scales.float(), grid.zeros
                slack = (s[:, None] / 2 * 1.001 if z is None else
                         ((8 * s.abs() + z.float().abs()) * U).repeat_interleave(32, dim=1) * 1.01) + 1e-7
                assert ((grid.dequantised() - state[f"model.layers.{i}.{name}"]).abs() <= slack).all(), (i, name)
    r = LayerRange(0, cfg.num_layers)
    stage = quantise_stage(Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding()), SCHEMES["int4"])
    reference = Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding())
    for qw, rw in zip(stage.blocks, reference.blocks):
        rw.qkv, rw.o = Linear(qw.qkv.dequantised()), Linear(qw.o.dequantised())
        for qe, re_ in zip(qw.mlp.experts, rw.mlp.experts):
            re_.gate_up, re_.down = Linear(qe.gate_up.dequantised()), Linear(qe.down.dequantised())
    assert isinstance(stage.blocks[0].mlp.router, Linear)
    outs = []
    for st in (stage, reference):
        job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 24).open("j", 32)
        out, _ = st.forward(job, torch.arange(5, 21), ctx_len=0, positions=torch.arange(16))
        outs.append(out)
    got, want = outs
    rms = want.pow(2).mean(dim=1, keepdim=True).sqrt()
    # Every token runs every expert (top-k = E), so the comparison has no routing choice
    # that bf16 rounding could flip; the router's weights are continuous in its input.
    assert ((got - want).abs() <= 4 * 2 * U * cfg.num_layers * rms).all(), float(((got - want).abs() / rms).max())


def test_prepare_says_the_matmuls_are_kept_quantised(tiny_gguf, stored, capsys):
    from shard.cli import main

    assert main(["prepare", "--model", tiny_gguf, "--out", str(stored.root), "--quiet"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"already prepared, digests verified, nothing to do: tiny-mixed (llama, 2 layers, F32, matmuls kept "
                     f"as int4) at {stored.root}")
