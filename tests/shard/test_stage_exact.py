"""Stage forward composed across 1, 2, 3 and 5 stages equals transformers' forward.

Guards the core invariant of DESIGN.md: a ring computes exactly what one machine would.
Oracle: transformers' own model classes on the same seeded weights, in fp32, for prefill,
chunked prefill, decode, a K=8 chain, a 16-node tree (each node's logits equal those of
its root-to-node path run causally) and a commit of an accepted tree path.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from shard.arch import ModelConfig
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.stage import OutputHead, Stage

TOL = 1e-4
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, rms_norm_eps=1e-6)
FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "llama3-rope": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}}),
    "linear-rope": (LlamaConfig, LlamaForCausalLM, {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    "mistral": (MistralConfig, MistralForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen2-yarn": (Qwen2Config, Qwen2ForCausalLM, {"rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0}}),
}


def make_model(family: str, seed: int = 0):
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**SMALL, **extra)).eval()
    # transformers initialises norms to 1 and biases to 0; randomise them so a forward that
    # ignored either would be caught.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    return model


class Ring:
    """Stages built straight from a transformers state dict (the store has its own tests)."""

    def __init__(self, model, parts: int, checkpoint: dict[str, torch.Tensor] | None = None) -> None:
        """`checkpoint`: the tensors as saved on disk, when their names differ from the
        in-memory state dict's (transformers fuses MoE experts in memory)."""
        self.cfg = ModelConfig.from_hf(model.config.to_dict())
        sd = model.state_dict() if checkpoint is None else checkpoint
        per_layer: dict[int, dict[str, torch.Tensor]] = {}
        for name, t in sd.items():
            if name.startswith("model.layers."):
                idx, short = name[len("model.layers."):].split(".", 1)
                per_layer.setdefault(int(idx), {})[short] = t
        ranges = LayerRange.split(self.cfg.num_layers, parts)
        emb = sd["model.embed_tokens.weight"]
        self.stages = [Stage(self.cfg, r, per_layer, embedding=emb if r.start == 0 else None) for r in ranges]
        lm = sd.get("lm_head.weight", emb)
        self.head = OutputHead(self.cfg, sd["model.norm.weight"], lm)
        self.caches = [KVCache(len(r), self.cfg.num_kv_heads, self.cfg.head_dim, torch.float32, 1 << 26) for r in ranges]
        self.jobs = [c.open("job", 200) for c in self.caches]

    def run(self, tokens, *, ctx_len, positions=None, parents=None, commit_src=(), commit_dst=0):
        tokens = torch.as_tensor(tokens)
        if positions is None:
            positions = torch.arange(ctx_len, ctx_len + len(tokens))
        x = tokens
        for stage, job in zip(self.stages, self.jobs):
            x, _ = stage.forward(job, x, ctx_len=ctx_len, positions=positions, tree_parents=parents,
                                 commit_src=commit_src, commit_dst=commit_dst)
        return self.head.logits(x)


def reference_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([list(ids)])).logits[0].float()


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request):
    return make_model(request.param)


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_prefill_chunked_and_decode_match(model, parts):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (20,), generator=g).tolist()
    ref = reference_logits(model, ids)
    # One-shot prefill.
    ring = Ring(model, parts)
    assert (ring.run(ids[:12], ctx_len=0) - ref[:12]).abs().max() <= TOL
    # Then decode one token at a time on top of the cache.
    for i in range(12, 20):
        assert (ring.run([ids[i]], ctx_len=i)[0] - ref[i]).abs().max() <= TOL
    # Chunked prefill in uneven chunks on a fresh ring.
    ring = Ring(model, parts)
    out, start = [], 0
    for size in (5, 4, 7, 4):
        out.append(ring.run(ids[start:start + size], ctx_len=start))
        start += size
    assert (torch.cat(out) - ref).abs().max() <= TOL


@pytest.mark.parametrize("parts", [1, 3])
def test_chain_of_eight_after_rejection_overwrite(model, parts):
    # A K=8 chain verified in one frame; then a rejection at draft 3 means the next frame
    # starts at ctx 10+3 and overwrites the stale slots. Both must match the reference.
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 256, (24,), generator=g).tolist()
    ring = Ring(model, parts)
    ring.run(ids[:10], ctx_len=0)
    chain = ids[10:18]
    ref = reference_logits(model, ids[:18])
    assert (ring.run(chain, ctx_len=10) - ref[10:18]).abs().max() <= TOL
    alt = ids[:13] + [7, 8, 9]
    ref_alt = reference_logits(model, alt)
    assert (ring.run(alt[13:], ctx_len=13) - ref_alt[13:]).abs().max() <= TOL


def random_tree(n: int, g: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, n)]


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("parts", [1, 2, 5])
def test_tree_of_sixteen_and_commit(model, parts):
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(0, 256, (9,), generator=g).tolist()
    parents = random_tree(16, g)
    tokens = torch.randint(0, 256, (16,), generator=g).tolist()
    depth = [len(path_to(parents, i)) - 1 for i in range(16)]
    ring = Ring(model, parts)
    ring.run(ctx, ctx_len=0)
    positions = torch.tensor([len(ctx) + d for d in depth])
    logits = ring.run(tokens, ctx_len=len(ctx), positions=positions, parents=torch.tensor(parents))
    for i in range(16):
        seq = ctx + [tokens[j] for j in path_to(parents, i)]
        assert (logits[i] - reference_logits(model, seq)[-1]).abs().max() <= TOL, f"node {i}"
    # Accept the deepest path: gather its slots to the end of the context, then decode.
    leaf = max(range(16), key=lambda i: (depth[i], -i))
    accepted = path_to(parents, leaf)
    slots = [len(ctx) + j for j in accepted]
    nxt = 42
    base = len(ctx) + len(accepted)
    out = ring.run([nxt], ctx_len=base, commit_src=slots, commit_dst=len(ctx))
    seq = ctx + [tokens[j] for j in accepted] + [nxt]
    assert (out[0] - reference_logits(model, seq)[-1]).abs().max() <= TOL
