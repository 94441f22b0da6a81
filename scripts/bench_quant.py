"""Weight-only quantisation (shard.quant) against f32 on the default model, side by side in one run.

Every scheme is the same full-model stage (SmolLM2-135M-Instruct from the model store, all
30 layers, embedding on it) with its decoder matmuls swapped by quantise_stage; the LM
head stays f32 for all of them (the coordinator's own). Rows, per scheme:
  - decode step (1 token), 8-token verify chain, at a 128-token context, and a 512-token
    prefill: best of --reps, the schemes run round-robin so all see the same machine load,
    each with the LM head on the rows a ring would return;
  - weights per layer in memory (shard.quant.layer_bytes) and against f32;
  - greedy agreement with f32: 8 chat prompts (scripts/spec_prompts.py), --new-tokens
    greedy tokens each, the fraction of positions whose token equals f32's, and how many
    prompts agree in full;
  - perplexity on docs/data/perplexity_text.txt (public domain: the Gettysburg Address
    (Bliss copy), the opening of the Declaration of Independence, the first sentences of
    A Tale of Two Cities and Pride and Prejudice), one causal pass over all of its tokens;
    and the same with the scheme's weights multiplied in f32 (F.linear on the dequantised
    grid), which splits a scheme's loss into its grid's and its kernels' (bf16 activations).
The row "gguf-int4" is the store prepared with the GGUF's own Q4_1 blocks kept
(--gguf-model, default the smollm2-135m-q4 alias): no requantisation; its store file
bytes per layer are reported beside the float store's.
Usage: python scripts/bench_quant.py [--json OUT] [--reps N] [--new-tokens N] [--schemes none,int8,int4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import time

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from scripts.spec_prompts import PROMPTS
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.linear import Linear
from shard.quant import SCHEMES, effective_scheme, layer_bytes, quantise_stage
from shard.stage import OutputHead, Stage
from shard.store import open_or_prepare

TEXT = pathlib.Path(__file__).resolve().parent.parent / "docs" / "data" / "perplexity_text.txt"
CTX = 128
TARGETS = {"int8": {"decode_speedup_min": 1.5, "ppl_rel_max": 0.01}, "int4": {"bytes_ratio_max": 0.3, "ppl_rel_max": 0.05}}


def round_robin_s(fns: dict[str, callable], reps: int) -> dict[str, float]:
    """Best-of-`reps` seconds per name, the functions run in turn each repetition: on a
    shared machine other processes only ever add time, so the minimum is the estimate
    least disturbed by them, and interleaving gives every scheme the same load."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: math.inf for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def greedy(stage: Stage, head: OutputHead, cache: KVCache, prompt: list[int], n: int) -> list[int]:
    job = cache.open("greedy", len(prompt) + n)
    try:
        h, _ = stage.forward(job, torch.tensor(prompt), ctx_len=0, positions=torch.arange(len(prompt)))
        out = [int(head.logits(h[-1:]).argmax())]
        while len(out) < n:
            pos = len(prompt) + len(out) - 1
            h, _ = stage.forward(job, torch.tensor(out[-1:]), ctx_len=pos, positions=torch.tensor([pos]))
            out.append(int(head.logits(h).argmax()))
    finally:
        cache.close("greedy")
    return out


def perplexity(stage: Stage, head: OutputHead, cache: KVCache, ids: list[int], chunk: int = 512) -> float:
    """exp(mean NLL of each token given all before it), prefilled in `chunk`-token frames."""
    job = cache.open("ppl", len(ids))
    nll, count = 0.0, 0
    try:
        for start in range(0, len(ids), chunk):
            frame = torch.tensor(ids[start:start + chunk])
            h, _ = stage.forward(job, frame, ctx_len=start, positions=torch.arange(start, start + len(frame)))
            logits = head.logits(h)  # (T, V)
            targets = torch.tensor(ids[start + 1:start + 1 + len(frame)])
            logits = logits[: len(targets)]
            nll += float(F.cross_entropy(logits, targets, reduction="sum"))
            count += len(targets)
    finally:
        cache.close("ppl")
    return math.exp(nll / count)


def f32_grid(stage: Stage, weights, embedding) -> Stage:
    """A plain f32 stage on `stage`'s dequantised weights (its grid without its kernels)."""
    ref = Stage(stage.cfg, stage.layers, weights, embedding=embedding)
    for qw, rw in zip(stage.blocks, ref.blocks):
        if hasattr(qw.qkv, "dequantised"):
            rw.qkv, rw.o = Linear(qw.qkv.dequantised(), qw.qkv.bias), Linear(qw.o.dequantised())
            rw.mlp.gate_up, rw.mlp.down = Linear(qw.mlp.gate_up.dequantised()), Linear(qw.mlp.down.dequantised())
    return ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--new-tokens", type=int, default=128, help="greedy tokens per prompt for the agreement rows")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--schemes", default="none,int8,int4,int4-g64")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (local ring nodes use 1)")
    ap.add_argument("--gguf-model", default="smollm2-135m-q4", help="the same model with its GGUF blocks kept "
                                                                   "(a row 'gguf-int4'; '' for none)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    names = args.schemes.split(",")
    assert names[0] == "none", "f32 (none) comes first: it is the reference"
    store = open_or_prepare(args.model, progress=False)
    cfg = store.config
    full = LayerRange(0, cfg.num_layers)
    weights = store.load_layers(full)
    embedding = store.load_embedding()
    norm, lm_head = store.load_head()
    head = OutputHead(cfg, norm, lm_head if lm_head is not None else embedding)
    stages = {n: quantise_stage(Stage(cfg, full, weights, embedding=embedding), SCHEMES[n]) for n in names}
    scheme_of = {n: SCHEMES[n] for n in names}
    store_bytes = {n: sum(store.manifest.layer_bytes) / len(full) for n in names}
    if args.gguf_model:
        kept = open_or_prepare(args.gguf_model, progress=False)
        assert kept.config == cfg, "the kept-GGUF store must be the same model"
        names.append("gguf-int4")
        scheme_of["gguf-int4"] = effective_scheme(kept.manifest.quant, "none")
        stages["gguf-int4"] = quantise_stage(Stage(cfg, full, kept.load_layers(full), embedding=embedding),
                                             scheme_of["gguf-int4"])
        store_bytes["gguf-int4"] = sum(kept.manifest.layer_bytes) / len(full)
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 32)
    ids = torch.randint(0, cfg.vocab_size, (CTX + 512,))

    # -- speed ------------------------------------------------------------------------
    jobs = {}
    for n, stage in stages.items():
        jobs[n] = cache.open(f"speed-{n}", CTX + 512)
        stage.forward(jobs[n], ids[:CTX], ctx_len=0, positions=torch.arange(CTX))
    timing: dict[str, dict[str, float]] = {n: {} for n in names}
    for row, t in (("decode_1_s", 1), ("verify_8_s", 8)):
        def frame(n, t=t):
            h, _ = stages[n].forward(jobs[n], ids[CTX:CTX + t], ctx_len=CTX, positions=torch.arange(CTX, CTX + t))
            head.logits(h)
        for n, s in round_robin_s({n: (lambda n=n: frame(n)) for n in names}, args.reps).items():
            timing[n][row] = s
        print(row, {n: f"{timing[n][row] * 1e3:.1f} ms" for n in names}, flush=True)

    def prefill(n):
        h, _ = stages[n].forward(jobs[n], ids[:512], ctx_len=0, positions=torch.arange(512))
        head.logits(h[-1:])
    for n, s in round_robin_s({n: (lambda n=n: prefill(n)) for n in names}, max(3, args.reps // 3)).items():
        timing[n]["prefill_512_s"] = s
    print("prefill_512_s", {n: f"{timing[n]['prefill_512_s'] * 1e3:.0f} ms" for n in names}, flush=True)
    for n in names:
        cache.close(f"speed-{n}")

    # -- bytes ------------------------------------------------------------------------
    per_layer = {n: sum(layer_bytes(cfg, i, scheme_of[n]) for i in full) / len(full) for n in names}

    # -- quality ----------------------------------------------------------------------
    tok = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    prompts = [p for group in PROMPTS.values() for p in group[:1]] + [p for group in PROMPTS.values() for p in group[1:2]]
    prompts = prompts[: args.prompts]
    encoded = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
    encoded = [list(e["input_ids"]) if isinstance(e, dict) or hasattr(e, "keys") else list(e) for e in encoded]
    outputs = {n: [] for n in names}
    for n in names:
        t0 = time.perf_counter()
        outputs[n] = [greedy(stages[n], head, cache, e, args.new_tokens) for e in encoded]
        print(f"greedy {n}: {time.perf_counter() - t0:.0f} s", flush=True)
    text_ids = list(tok(TEXT.read_text())["input_ids"])
    ppl = {n: perplexity(stages[n], head, cache, text_ids) for n in names}
    ppl_grid = {n: perplexity(f32_grid(stages[n], weights, embedding), head, cache, text_ids) for n in names}

    rows = []
    ref = names[0]
    for n in names:
        same = [sum(a == b for a, b in zip(outputs[n][i], outputs[ref][i])) for i in range(len(encoded))]
        first_diff = [next((j for j, (a, b) in enumerate(zip(outputs[n][i], outputs[ref][i])) if a != b), None)
                      for i in range(len(encoded))]
        row = {
            "scheme": n, **timing[n],
            "decode_speedup": timing[ref]["decode_1_s"] / timing[n]["decode_1_s"],
            "verify_8_speedup": timing[ref]["verify_8_s"] / timing[n]["verify_8_s"],
            "prefill_512_speedup": timing[ref]["prefill_512_s"] / timing[n]["prefill_512_s"],
            "bytes_per_layer": per_layer[n], "bytes_ratio": per_layer[n] / per_layer[ref],
            "greedy_agreement": sum(same) / (len(encoded) * args.new_tokens),
            "prompts_identical": sum(d is None for d in first_diff), "first_divergence": first_diff,
            "perplexity": ppl[n], "perplexity_rel": ppl[n] / ppl[ref] - 1,
            "perplexity_f32_grid": ppl_grid[n], "perplexity_f32_grid_rel": ppl_grid[n] / ppl[ref] - 1,
            "store_bytes_per_layer": store_bytes[n],
        }
        family = "int4" if "int4" in n else n
        if family in TARGETS:
            t = TARGETS[family]
            met = row["perplexity_rel"] <= t["ppl_rel_max"]
            if "decode_speedup_min" in t:
                met = met and row["decode_speedup"] >= t["decode_speedup_min"]
            if "bytes_ratio_max" in t:
                met = met and row["bytes_ratio"] <= t["bytes_ratio_max"]
            row["target"], row["target_met"] = t, met
        rows.append(row)
        print(f"{n:<10} decode {row['decode_1_s'] * 1e3:6.1f} ms (x{row['decode_speedup']:.2f})  verify8 "
              f"{row['verify_8_s'] * 1e3:6.1f} ms (x{row['verify_8_speedup']:.2f})  prefill512 "
              f"{row['prefill_512_s'] * 1e3:6.0f} ms (x{row['prefill_512_speedup']:.2f})  "
              f"{row['bytes_per_layer'] / 1e6:.2f} MB/layer (x{row['bytes_ratio']:.3f})  agree {row['greedy_agreement']:.3f} "
              f"({row['prompts_identical']}/{len(encoded)} prompts)  ppl {row['perplexity']:.3f} ({row['perplexity_rel']:+.2%}; "
              f"grid in f32 {row['perplexity_f32_grid_rel']:+.2%})"
              + (f"  target {'met' if row['target_met'] else 'NOT met'}" if "target" in row else ""), flush=True)

    result = {
        "conditions": {
            "model": args.model, "manifest_digest": store.digest, "store_dtype": store.manifest.dtype,
            "source": store.manifest.source, "compute_dtype": "float32", "kernel_activation_dtype": "bfloat16",
            "device": "cpu", "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cores": os.cpu_count(), "context_tokens": CTX, "reps": args.reps,
            "timing": "best of reps, schemes round-robin; every row includes the f32 LM head on the returned rows",
            "load_average": os.getloadavg(), "prompts": len(encoded), "new_tokens": args.new_tokens,
            "perplexity_text": str(TEXT.relative_to(TEXT.parent.parent.parent)), "perplexity_tokens": len(text_ids),
            "git_revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                           text=True).stdout.strip(),
        },
        "rows": rows,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
