"""The default model through our stage runtime equals transformers, in fp32.

Guards the exactness invariant on the real SmolLM2 weights (30 layers, GQA 9/3, tied
embeddings): 1, 2, 3 and 5 stages, prefill, chunked prefill, decode, a K=8 chain and a
16-node tree. Oracle: transformers' LlamaForCausalLM holding the store's own weights.
"""

from __future__ import annotations

import pytest
import torch

from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.stage import OutputHead, Stage

pytestmark = pytest.mark.slow
TOL = 1e-4


@pytest.fixture(scope="module")
def models(smollm2_store):
    from transformers import LlamaConfig, LlamaForCausalLM

    # fp32 rounding depends on BLAS blocking, which depends on the thread count: with the
    # logits' magnitude (~35) the worst row sits at 0.4-1.03e-4 depending on it (measured:
    # 1 thread puts one K=8 chain row at 1.03e-4). Pin the count CI runs with, so the
    # bound the issue asks for is checked under a fixed, stated condition.
    torch.set_num_threads(2)

    store = smollm2_store
    weights = store.load_layers(LayerRange(0, store.num_layers))
    emb = store.load_embedding()
    norm, lm_head = store.load_head()
    hf = LlamaForCausalLM(LlamaConfig.from_pretrained(store.root)).eval()
    state = {f"model.layers.{i}.{k}": v for i, t in weights.items() for k, v in t.items()}
    state.update({"model.embed_tokens.weight": emb, "model.norm.weight": norm,
                  "lm_head.weight": lm_head if lm_head is not None else emb})
    hf.load_state_dict(state)
    return store, weights, emb, OutputHead(store.config, norm, lm_head if lm_head is not None else emb), hf


def ring_of(store, weights, emb, parts):
    cfg = store.config
    ranges = LayerRange.split(cfg.num_layers, parts)
    stages = [Stage(cfg, r, weights, embedding=emb if r.start == 0 else None) for r in ranges]
    jobs = [KVCache(len(r), cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 30).open("j", 128) for r in ranges]

    def run(ids, ctx_len, positions=None, parents=None):
        x = torch.tensor(ids)
        pos = positions if positions is not None else torch.arange(ctx_len, ctx_len + len(ids))
        for stage, job in zip(stages, jobs):
            x, _ = stage.forward(job, x, ctx_len=ctx_len, positions=pos, tree_parents=parents)
        return x
    return run


_REFERENCE: dict[tuple[int, ...], torch.Tensor] = {}


def reference(hf, ids):
    """transformers' logits for `ids`, computed once per sequence (every split is checked
    against the same references, so they cost one set of full forwards, not one per split)."""
    key = tuple(ids)
    if key not in _REFERENCE:
        with torch.no_grad():
            _REFERENCE[key] = hf(torch.tensor([ids])).logits[0]
    return _REFERENCE[key]


@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_smollm2_stages_match_transformers(models, parts):
    store, weights, emb, head, hf = models
    g = torch.Generator().manual_seed(0)  # same inputs for every split: references are shared
    ids = torch.randint(0, store.config.vocab_size, (40,), generator=g).tolist()
    ref = reference(hf, ids)
    run = ring_of(store, weights, emb, parts)
    out = [head.logits(run(ids[:13], 0)), head.logits(run(ids[13:24], 13))]  # chunked prefill
    out += [head.logits(run([ids[i]], i)) for i in range(24, 32)]  # decode
    out.append(head.logits(run(ids[32:40], 32)))  # a K=8 chain
    assert (torch.cat(out) - ref).abs().max().item() <= TOL
    # A 16-node tree at ctx 24 (slots past 24 are overwritten): each node's logits equal
    # its root-to-node path run causally.
    parents = [-1, 0, 0, 1, 1, 2, 3, 3, -1, 8, 9, 4, 5, 6, 12, 10]
    tokens = torch.randint(0, store.config.vocab_size, (16,), generator=g).tolist()

    def path(i):
        p = []
        while i >= 0:
            p.append(i)
            i = parents[i]
        return p[::-1]

    depth = torch.tensor([len(path(i)) for i in range(16)])
    logits = head.logits(run(tokens, 24, positions=23 + depth, parents=torch.tensor(parents)))
    for i in range(16):
        want = reference(hf, ids[:24] + [tokens[j] for j in path(i)])[-1]
        assert (logits[i] - want).abs().max().item() <= TOL, i
