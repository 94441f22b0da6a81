"""Benchmark our stage forward against transformers on the same weights (issue: foundation).

Rows, each timed side by side in one process on the same fp32 weights of the default model
(SmolLM2-135M-Instruct from the model store): full-model decode step at a 128-token context,
8- and 16-token verify frames, a 512-token prefill, the time to load all layers vs one
third of them, and wire bytes per token for f32 / bf16 / fp8 hidden states. Then our own
stage with its weights reordered for oneDNN (the default, shard.linear) against torch's
default layout, on verify frames of 1-64 rows and a 512-token prefill, with the LM head.
Usage: python scripts/bench_stage.py [--json OUT] [--reps N] [--model smollm2-135m]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.linear import onednn_packing_works
from shard.stage import OutputHead, Stage
from shard.store import prepare


def paired_s(fn_a, fn_b, reps: int) -> tuple[float, float]:
    """Best-of-`reps` seconds for a and b, run alternately (a, b, a, b, ...) so both see
    the same machine load; on a shared machine other processes only ever add time, so
    the minimum is the estimate least disturbed by them."""
    fn_a(), fn_b()  # warm-up
    a, b = [], []
    for _ in range(reps):
        for fn, out in ((fn_a, a), (fn_b, b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return min(a), min(b)


def build_transformers(store):
    cfg = AutoConfig.from_pretrained(store.root)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {}
    for i, tensors in store.load_layers(LayerRange(0, store.num_layers)).items():
        state.update({f"model.layers.{i}.{k}": v for k, v in tensors.items()})
    state["model.embed_tokens.weight"] = store.load_embedding()
    norm, lm_head = store.load_head()
    state["model.norm.weight"] = norm
    state["lm_head.weight"] = lm_head if lm_head is not None else state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    model.tie_weights()
    return model.eval()


def build_ours(store, r: LayerRange, *, pack_weights: bool = True):
    cfg = store.config
    stage = Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding() if r.start == 0 else None,
                  pack_weights=pack_weights)
    return stage


def build_head(store, *, pack_weights: bool = True) -> OutputHead:
    norm, lm_head = store.load_head()
    return OutputHead(store.config, norm, lm_head if lm_head is not None else store.load_embedding(),
                      pack_weights=pack_weights)


def layout_rows(store, ctx: int, reps: int) -> list[dict]:
    """Reordered (oneDNN) weights against torch's default layout on the frames a ring sees:
    tree-shaped verify frames of T rows over a `ctx`-token context (all layers, then the LM
    head on every row), and a 512-token prefill (LM head on its last row)."""
    cfg, full = store.config, LayerRange(0, store.num_layers)
    sides = {packed: (build_ours(store, full, pack_weights=packed), build_head(store, pack_weights=packed))
             for packed in (True, False)}
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 32)
    ids = torch.randint(0, cfg.vocab_size, (ctx + 512,))
    jobs = {}
    for packed, (stage, _) in sides.items():
        jobs[packed] = cache.open(f"layout-{packed}", ctx + 512)
        stage.forward(jobs[packed], ids[:ctx], ctx_len=0, positions=torch.arange(ctx))
    rows = []
    for t in (1, 2, 3, 4, 8, 16, 32, 64, 512):
        prefill = t == 512
        frame, pos = (ids[:t], torch.arange(t)) if prefill else (ids[ctx:ctx + t], torch.arange(ctx, ctx + t))
        parents = None if prefill or t == 1 else torch.tensor([-1] + [(i - 1) // 2 for i in range(1, t)])  # binary tree

        def run(packed, frame=frame, pos=pos, parents=parents, prefill=prefill):
            stage, head = sides[packed]
            h, _ = stage.forward(jobs[packed], frame, ctx_len=0 if prefill else ctx, positions=pos, tree_parents=parents)
            head.logits(h[-1:] if prefill else h)

        packed_s, default_s = paired_s(lambda: run(True), lambda: run(False), max(3, reps // 3) if prefill else reps)
        name = "prefill 512 tokens" if prefill else f"verify tree of {t} rows, ctx {ctx}"
        rows.append({"row": name, "tokens": t, "default_layout_s": default_s, "onednn_layout_s": packed_s,
                     "speedup": default_s / packed_s})
        print(f"{name:<32} default {default_s * 1e3:8.2f} ms   oneDNN {packed_s * 1e3:8.2f} ms   ratio {default_s / packed_s:5.2f}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both sides (local ring nodes use 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    store = prepare(args.model, progress=False).store
    cfg = store.config
    full = LayerRange(0, cfg.num_layers)
    hf = build_transformers(store)
    ours = build_ours(store, full)
    head = build_head(store)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 32)
    ctx = 128
    ids = torch.randint(0, cfg.vocab_size, (1, ctx + 512))
    rows = []

    def add(name, t_hf, t_ours, tokens):
        rows.append({"row": name, "tokens": tokens, "transformers_s": t_hf, "shard_s": t_ours,
                     "speedup": t_hf / t_ours})
        print(f"{name:<28} transformers {t_hf * 1e3:8.2f} ms   shard {t_ours * 1e3:8.2f} ms   ratio {t_hf / t_ours:5.2f}")

    # Both sides hold a 128-token context, then repeatedly run the same frame on top of it
    # (transformers crops its cache back; ours overwrites the same slots).
    hf_cache = DynamicCache(config=hf.config)
    with torch.inference_mode():
        hf(ids[:, :ctx], past_key_values=hf_cache, use_cache=True)
    job = cache.open("bench", ctx + 512)
    ours.forward(job, ids[0, :ctx], ctx_len=0, positions=torch.arange(ctx))

    for name, t in (("decode step (1 token)", 1), ("verify 8 tokens", 8), ("verify 16 tokens", 16)):
        frame = ids[:, ctx:ctx + t]
        pos = torch.arange(ctx, ctx + t)

        def run_hf():
            with torch.inference_mode():
                hf(frame, past_key_values=hf_cache, use_cache=True, position_ids=pos[None])
            hf_cache.crop(-t)

        def run_ours():
            h, _ = ours.forward(job, frame[0], ctx_len=ctx, positions=pos)
            head.logits(h)

        add(f"{name}, ctx {ctx}", *paired_s(run_hf, run_ours, args.reps), t)

    prompt = ids[:, :512]

    def prefill_hf():
        with torch.inference_mode():
            hf(prompt, past_key_values=DynamicCache(config=hf.config), use_cache=True)

    def prefill_ours():
        h, _ = ours.forward(job, prompt[0], ctx_len=0, positions=torch.arange(512))
        head.logits(h[-1:])

    add("prefill 512 tokens", *paired_s(prefill_hf, prefill_ours, max(3, args.reps // 3)), 512)
    # transformers computes logits for all 512 positions; ours the last only (as a ring
    # does). Report that row's logits cost separately so the comparison is readable.

    third = LayerRange(0, cfg.num_layers // 3)
    load_full, load_third = paired_s(lambda: build_ours(store, full), lambda: build_ours(store, third), 3)
    print(f"load all {len(full)} layers {load_full:.3f} s, {len(third)} layers {load_third:.3f} s, ratio {load_third / load_full:.2f}")

    from shard.wire import dtypes as wire_dtypes

    print("weight layout (our stage + LM head, all layers):")
    layout = layout_rows(store, ctx, args.reps)
    wire = {name: wire_dtypes.wire_bytes_per_token(cfg.hidden_size, name) for name in ("f32", "bf16", "f8_e4m3fn")}
    print(f"wire bytes/token: {wire}  fp8/bf16 = {wire['f8_e4m3fn'] / wire['bf16']:.3f}")

    result = {
        "conditions": {
            "model": args.model, "manifest_digest": store.digest, "dtype": "float32", "device": "cpu",
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "context_tokens": ctx, "reps": args.reps,
            "timing": "best of reps, the two sides run alternately", "load_average": os.getloadavg(),
            "git_revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
            "note": "prefill row: transformers computes logits for every position, shard for the last only",
            "onednn_packing": onednn_packing_works(),
        },
        "rows": rows,
        "load": {"all_layers_s": load_full, "third_layers_s": load_third, "ratio": load_third / load_full,
                 "layers_all": len(full), "layers_third": len(third)},
        "weight_layout_rows": layout,
        "wire_bytes_per_token": wire,
        "fp8_over_bf16": wire["f8_e4m3fn"] / wire["bf16"],
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
