"""Every supported family's stage forward, composed over 1, 2 and 3 stages, equals transformers.

Guards DESIGN.md's core invariant for the families beyond the Llama layout: Qwen3 (q/k
norm), Mixtral and Qwen MoE (router top-k, softmax vs renormalised weights, shared
experts, dense layers among MoE ones), Phi-3 (fused projections, longrope), Gemma 3
(sliding and global layers with their own rope bases, (1 + w) norms, sandwich norms,
embedding scale, query_pre_attn_scalar), and windows shorter than the test on Mistral and
Mixtral (every layer) and Qwen2 (layers from max_window_layers on).
Oracle: transformers' own classes on the same seeded weights in fp32. Stages are built
from the checkpoint as saved on disk (its tensor names, e.g. per-expert MoE weights),
not from the in-memory state dict, whose names transformers may fuse differently.
Windows are 6 positions and sequences reach 20, so sliding layers do cut keys off.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from safetensors.torch import load_file

from tests.shard import test_stage_exact as exact
from tests.shard.test_stage_exact import reference_logits

TOL = 1e-4
VOCAB = 256
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)]}
GEMMA_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"]
FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16)),
    "mistral-window": (transformers.MistralConfig, dict(sliding_window=6)),
    "mixtral-top2": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-top1-window": (transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=1, sliding_window=6)),
    "qwen2-window-from-layer-2": (transformers.Qwen2Config, dict(use_sliding_window=True, sliding_window=6, max_window_layers=2)),
    "qwen3-moe-top3": (transformers.Qwen3MoeConfig, dict(MOE, num_experts=6, num_experts_per_tok=3, head_dim=16)),
    "qwen3-moe-norm-dense": (transformers.Qwen3MoeConfig, dict(MOE, num_experts=4, norm_topk_prob=True, mlp_only_layers=[1],
                                                               decoder_sparse_step=2, head_dim=16)),
    "qwen2-moe-shared": (transformers.Qwen2MoeConfig, dict(MOE, num_experts=4, shared_expert_intermediate_size=48)),
    "phi3-window": (transformers.Phi3Config, dict(sliding_window=6)),
    "phi3-longrope": (transformers.Phi3Config, dict(rope_parameters=LONGROPE, original_max_position_embeddings=64)),
    "gemma3": (transformers.Gemma3TextConfig, dict(head_dim=16, sliding_window=6, layer_types=GEMMA_TYPES,
                                                   query_pre_attn_scalar=24, rope_parameters={
                                                       "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                                       "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})),
}


def make_model(family: str, tmp_path_factory, seed: int = 0):
    """(transformers model, its checkpoint as saved on disk)."""
    cfg_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg_cls(**SMALL, **extra), dtype=torch.float32).eval()
    # transformers initialises norms to 1 (Gemma: 0) and biases to 0; randomise them so a
    # forward that ignored one would be caught. Routers get logits far enough apart that
    # the top-k choice is not decided by rounding.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight") or name.endswith("shared_expert_gate.weight"):
                p.copy_(0.3 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(family)
    model.save_pretrained(path)
    return model, load_file(str(path / "model.safetensors"))


def Ring(model, saved, parts: int) -> exact.Ring:
    """Stages built from the checkpoint as saved, over `parts` stages."""
    return exact.Ring(model, parts, saved)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    return make_model(request.param, tmp_path_factory)


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_prefill_chunked_and_decode_match(family, parts):
    model = family[0]
    ids = torch.randint(3, VOCAB, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    ref = reference_logits(model, ids)
    ring = Ring(*family, parts)
    assert (ring.run(ids[:12], ctx_len=0) - ref[:12]).abs().max() <= TOL
    for i in range(12, 20):
        assert (ring.run([ids[i]], ctx_len=i)[0] - ref[i]).abs().max() <= TOL, f"decode at {i}"
    ring = Ring(*family, parts)
    out, start = [], 0
    for size in (5, 4, 7, 4):
        out.append(ring.run(ids[start:start + size], ctx_len=start))
        start += size
    assert (torch.cat(out) - ref).abs().max() <= TOL


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_chain_of_eight_after_rejection_overwrite(family, parts):
    model = family[0]
    ids = torch.randint(3, VOCAB, (24,), generator=torch.Generator().manual_seed(2)).tolist()
    ring = Ring(*family, parts)
    ring.run(ids[:10], ctx_len=0)
    ref = reference_logits(model, ids[:18])
    assert (ring.run(ids[10:18], ctx_len=10) - ref[10:18]).abs().max() <= TOL
    alt = ids[:13] + [7, 8, 9]
    assert (ring.run(alt[13:], ctx_len=13) - reference_logits(model, alt)[13:]).abs().max() <= TOL


def path_to(parents: list[int], i: int) -> list[int]:
    path = []
    while i >= 0:
        path.append(i)
        i = parents[i]
    return path[::-1]


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_tree_of_twelve_and_commit(family, parts):
    # Each node's logits equal its root-to-node path run causally; then the deepest path
    # is committed and one more token decoded on top of it.
    model = family[0]
    g = torch.Generator().manual_seed(3)
    ctx = torch.randint(3, VOCAB, (9,), generator=g).tolist()
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=g)) for i in range(1, 12)]
    tokens = torch.randint(3, VOCAB, (12,), generator=g).tolist()
    depth = [len(path_to(parents, i)) - 1 for i in range(12)]
    ring = Ring(*family, parts)
    ring.run(ctx, ctx_len=0)
    positions = torch.tensor([len(ctx) + d for d in depth])
    logits = ring.run(tokens, ctx_len=len(ctx), positions=positions, parents=torch.tensor(parents))
    for i in range(12):
        seq = ctx + [tokens[j] for j in path_to(parents, i)]
        assert (logits[i] - reference_logits(model, seq)[-1]).abs().max() <= TOL, f"node {i}"
    leaf = max(range(12), key=lambda i: (depth[i], -i))
    accepted = path_to(parents, leaf)
    base = len(ctx) + len(accepted)
    out = ring.run([42], ctx_len=base, commit_src=[len(ctx) + j for j in accepted], commit_dst=len(ctx))
    seq = ctx + [tokens[j] for j in accepted] + [42]
    assert (out[0] - reference_logits(model, seq)[-1]).abs().max() <= TOL


def test_longrope_past_the_original_context(tmp_path_factory):
    # Bug guarded: longrope's long factors never used, or used from position 0 of a short
    # frame. transformers picks short or long factors per forward, by the frame's last
    # position against original_max_position_embeddings (64 here); a 70-token prefill
    # therefore runs entirely on the long factors, and so must the stage.
    model, saved = make_model("phi3-longrope", tmp_path_factory)
    ids = torch.randint(3, VOCAB, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    ring = Ring(model, saved, 2)
    assert (ring.run(ids, ctx_len=0) - reference_logits(model, ids)).abs().max() <= TOL


def test_aux_capture_equals_the_reference_hidden_states(family):
    # Bug guarded: EAGLE aux features captured at the wrong point of a layer for a family
    # whose layer is not Llama-shaped (before Gemma's post-feedforward norm, before an MoE
    # block's output is added). Sound: every layer but the last (whose transformers
    # hidden state is after the final norm) is captured across two stages and compared
    # with transformers' output_hidden_states for the same prompt.
    model, saved = family
    ids = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(5))
    ring = Ring(model, saved, 2)
    n = ring.cfg.num_layers
    captured: dict[int, torch.Tensor] = {}
    x = ids
    for stage, job in zip(ring.stages, ring.jobs):
        x, got = stage.forward(job, x, ctx_len=0, positions=torch.arange(12), capture=range(n - 1))
        captured.update(got)
    with torch.no_grad():
        ref = model(ids[None], output_hidden_states=True).hidden_states  # (embeddings, layer 0, ..., normed last)
    assert sorted(captured) == list(range(n - 1))
    for layer, h in captured.items():
        assert (h - ref[layer + 1][0]).abs().max() <= TOL, layer
