"""Benchmark a stage's batched forward against the same frames run one by one (issue 21).

N decode rows from N distinct jobs (N = 1, 4, 16, 32), each job with its own ragged
context (96-159 tokens, prefilled once), through all layers of the default model
(SmolLM2-135M-Instruct from the model store) as one stage: Stage.forward_batch of the N
frames against N calls of Stage.forward, timed alternately in one process, best of reps.
Each rep rewrites the same slots, so every rep does the same work. Also reports the
largest difference between a job's batched and lone hidden states and logits (exactness).
Usage: python scripts/bench_batch.py [--json OUT] [--reps N] [--threads 1] [--model smollm2-135m]
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

from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.stage import OutputHead, Stage, StageFrame
from shard.store import open_or_prepare

ROWS = (1, 4, 16, 32)


def paired_s(fn_a, fn_b, reps: int) -> tuple[float, float]:
    """Best-of-`reps` seconds for a and b, run alternately so both see the same machine
    load; other processes only ever add time, so the minimum is the least disturbed."""
    fn_a(), fn_b()  # warm-up
    a, b = [], []
    for _ in range(reps):
        for fn, out in ((fn_a, a), (fn_b, b)):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return min(a), min(b)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (local ring nodes use 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    store = open_or_prepare(args.model, progress=False)
    cfg = store.config
    stage = Stage(cfg, LayerRange(0, cfg.num_layers), store.load_layers(LayerRange(0, cfg.num_layers)),
                  embedding=store.load_embedding())
    norm, lm_head = store.load_head()
    head = OutputHead(cfg, norm, lm_head if lm_head is not None else store.load_embedding())
    cache = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 33)
    frames = []
    for i in range(max(ROWS)):
        ctx = 96 + (i * 37) % 64  # ragged contexts
        job = cache.open(f"job{i}", ctx + 1)
        ids = torch.randint(0, cfg.vocab_size, (ctx + 1,))
        stage.forward(job, ids[:ctx], ctx_len=0, positions=torch.arange(ctx))
        frames.append(StageFrame(job, ids[ctx:], ctx, torch.tensor([ctx])))

    rows = []
    for n in ROWS:
        batch = frames[:n]

        def batched(batch=batch):
            return [h for h, _ in stage.forward_batch(batch)]

        def one_by_one(batch=batch):
            return [stage.forward(f.job, f.x, ctx_len=f.ctx_len, positions=f.positions)[0] for f in batch]

        pairs = list(zip(batched(), one_by_one()))
        max_diff = max((a - b).abs().max().item() for a, b in pairs)
        max_logit_diff = max((head.logits(a) - head.logits(b)).abs().max().item() for a, b in pairs)
        scale = max(b.abs().max().item() for _, b in pairs)
        batched_s, alone_s = paired_s(batched, one_by_one, args.reps)
        rows.append({"rows": n, "batched_s": batched_s, "one_by_one_s": alone_s, "speedup": alone_s / batched_s,
                     "batched_rows_per_s": n / batched_s, "max_abs_diff_hidden": max_diff,
                     "max_abs_hidden": scale, "max_abs_diff_logits": max_logit_diff})
        print(f"{n:3d} rows  batched {batched_s * 1e3:8.2f} ms  one by one {alone_s * 1e3:8.2f} ms  "
              f"speed-up {alone_s / batched_s:5.2f}x  max |diff| hidden {max_diff:.1e} (of {scale:.0f}), logits {max_logit_diff:.1e}")
    one = rows[0]["batched_s"]
    for row in rows:
        row["cost_vs_one_row"] = row["batched_s"] / one
        row["throughput_vs_one_row"] = row["batched_rows_per_s"] * one
    result = {
        "conditions": {
            "model": args.model, "manifest_digest": store.digest,
            "layers": cfg.num_layers, "dtype": "float32", "device": "cpu", "torch_threads": args.threads,
            "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
            "cpus": os.cpu_count(), "contexts": "job i at 96 + (37 i mod 64) tokens", "reps": args.reps,
            "timing": "best of reps, the two sides run alternately", "load_average": list(os.getloadavg()),
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
    sys.exit(main())
