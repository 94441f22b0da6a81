"""Where a batched stage forward's time goes, on the CPU or a GPU (issue 21).

Wall time per forward, the host's part of it, and the ops the host issues.

`PYTHONPATH=. python3 scripts/profile_stage_batch.py [--device cuda] [--dtype bfloat16] [--json OUT]`
A 10-layer slice of SmolLM2-135M (its prepared store or wheel; else, or with --stand-in, the
seeded model in its shapes from scripts/check_cuda_batch.py) runs Stage.forward_batch over
decode rows, one a job at context 128, as a node runs them. Per row count it reports the best
wall time of N synchronised forwards; the host's time to return from the forward without the
final synchronisation (on a GPU the kernels run behind it: host ~= wall means the forward is
bound by issuing ops, not by the device); and, from torch.profiler over one forward, the
ops issued, the device kernels launched, and the top ops by the host's self time. With
--attention, decode attention alone: the per-job loop against one padded call for all jobs.
Figures only: it never fails on what it measures.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from scripts import check_cuda_batch as check
from scripts import stage_timing as timing
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.stage import Stage


def model_slice(device: str, dtype: torch.dtype, stand_in: bool) -> tuple[str, Stage]:
    check.DEVICE = device
    store = None if stand_in else check.smollm2_store()
    model = check.tiny_model("smollm2-shapes") if store is None else None
    cfg = store.config if store is not None else model.cfg
    r = LayerRange(0, 10)
    weights = store.load_layers(r, torch.float32, "cpu") if store is not None else model.weights(r)
    name = "smollm2" if store is not None else "smollm2-shapes"
    return name, Stage(cfg, r, weights, dtype=dtype, device=device)  # no embedding: hidden rows in, as stages past the head


def measure(stage: Stage, rows: int, reps: int, device: str) -> dict:
    cfg = stage.cfg
    cache = KVCache(len(stage.layers), cfg.num_kv_heads, cfg.head_dim, stage.dtype, 1 << 34, device)
    frames = timing.decode_frames(stage, cache, rows, torch.Generator().manual_seed(rows))
    wall, host, outs = timing.best_time(lambda: stage.forward_batch(frames), reps, device)
    if not all(isinstance(o, tuple) for o in outs):
        raise RuntimeError(f"a timed frame failed: {next(o for o in outs if not isinstance(o, tuple))}")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        stage.forward_batch(frames)
        timing.sync(device)
    events = prof.key_averages()
    ops = [e for e in events if "::" in e.key]  # dispatcher ops (aten::, mkldnn::, ...), not the runtime's calls
    n_ops = sum(e.count for e in ops)
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    top = sorted(ops, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    return dict(rows=rows, wall_ms=wall * 1e3, host_ms=host * 1e3, ops=n_ops, kernel_launches=launches,
                ops_per_row=n_ops / rows, top_host_self_ms={e.key: [e.count, e.self_cpu_time_total / 1e3] for e in top})


def attention_paths(cfg, device: str, jobs: int, reps: int, layers: int = 10) -> dict:
    """Decode attention alone over `layers` layers, each job's K/V in its own tensor (as a
    JobCache holds them), contexts 100-400: the per-job loop Stage._attend runs against one
    padded SDPA a layer for all jobs (K/V writes as one _foreach_copy_, keys stacked from each
    job's cache, a mask for each job's length): what batching the attention would buy."""
    hq, hkv, d, g = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
    gen = torch.Generator().manual_seed(jobs)
    lens = [int(n) for n in torch.randint(100, 400, (jobs,), generator=gen)]
    caches = [torch.randn(layers, 2, hkv, 512, d, generator=gen).to(device) for _ in range(jobs)]
    q, kv = torch.randn(hq, jobs, d, generator=gen).to(device), torch.randn(hkv, jobs, d, generator=gen).to(device)
    smax = max(lens)
    mask = torch.stack([torch.arange(smax) >= n for n in lens])[:, None, None].to(device)  # True: masked out
    mask = torch.zeros(mask.shape, device=device).masked_fill(mask, float("-inf"))

    def loop():
        for layer in range(layers):
            outs = []
            for j, (c, n) in enumerate(zip(caches, lens)):
                c[layer, 0, :, n - 1].copy_(kv[:, j])
                c[layer, 1, :, n - 1].copy_(kv[:, j])
                outs.append(F.scaled_dot_product_attention(q[:, j:j + 1].reshape(1, hkv, g, d), c[layer, 0, None, :, :n],
                                                           c[layer, 1, None, :, :n]).reshape(hq, 1, d))
            out = torch.cat(outs, 1)
        return out  # the last layer's (Hq, jobs, D)

    def padded():
        for layer in range(layers):
            dst = [c[layer, i, :, n - 1] for i in (0, 1) for c, n in zip(caches, lens)]
            torch._foreach_copy_(dst, list(kv.unbind(1)) * 2)
            k, v = (torch.stack([c[layer, i, :, :smax] for c in caches]) for i in (0, 1))
            out = F.scaled_dot_product_attention(q.transpose(0, 1).reshape(jobs, hkv, g, d), k, v, attn_mask=mask)
        return out.reshape(jobs, hq, d).transpose(0, 1)

    out = {name: timing.best_time(run, reps, device)[0] * 1e3 for name, run in (("loop_ms", loop), ("padded_ms", padded))}
    differ = (loop() - padded()).abs().max().item()  # the two compute the same attention
    return dict(jobs=jobs, layers=layers, **out, largest_difference=differ)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--rows", default="1,16,64,256", help="decode rows (jobs) per forward, comma-separated")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stand-in", action="store_true", help="the seeded model in SmolLM2's shapes even where SmolLM2 is there")
    ap.add_argument("--attention", action="store_true", help="also time decode attention alone: per-job loop vs one padded call")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)  # as a node runs
    name, stage = model_slice(args.device, getattr(torch, args.dtype), args.stand_in)
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu, 1 thread"
    report = dict(model=name, layers=10, dtype=args.dtype, device=where, torch=torch.__version__, ctx=timing.CTX, levels=[])
    print(f"{name}, 10 layers, {args.dtype}, {where}, torch {torch.__version__}, decode rows at context {timing.CTX}", flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        m = measure(stage, rows, args.reps, args.device)
        report["levels"].append(m)
        print(f"{rows:4d} rows: wall {m['wall_ms']:8.2f} ms, host {m['host_ms']:8.2f} ms, {m['ops']} ops "
              f"({m['ops_per_row']:.0f} a row), {m['kernel_launches']} kernel launches", flush=True)
        for op, (count, ms) in m["top_host_self_ms"].items():
            print(f"        {op:32s} x{count:6d} {ms:8.2f} ms host self", flush=True)
        if args.attention:
            a = attention_paths(stage.cfg, args.device, rows, args.reps)
            report.setdefault("attention", []).append(a)
            print(f"        attention alone, contexts 100-400: per-job loop {a['loop_ms']:.2f} ms, "
                  f"one padded SDPA a layer {a['padded_ms']:.2f} ms (outputs differ by {a['largest_difference']:.1e})", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
