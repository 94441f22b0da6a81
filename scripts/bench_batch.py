"""Benchmark a stage's batched forward against the same frames run one by one (issue 21).

N decode rows from N distinct jobs (N = 1, 4, 16, 32), each job with its own ragged
context (96-159 tokens, prefilled once), and 16 mixed (12 at ctx ~100, 4 at ~1900), through all layers of the default model
(SmolLM2-135M-Instruct from the model store) as one stage: Stage.forward_batch of the N
frames against N calls of Stage.forward, timed alternately in one process, best of reps.
Each rep rewrites the same slots, so every rep does the same work. Also reports the
largest difference between a job's batched and lone hidden states and logits (exactness).

Then what a long prompt costs the others (`prefill_beside_decode`): one stage of the first
`--piece-layers` layers run by the node's own StageScheduler and StageWorker, 16 decode
jobs in a closed loop (each frame's next one submitted `--ring-delay-ms` after its output,
the rest of a ring's traversal), and after a warm-up one job's `--prompt-tokens` prompt
arriving as the coordinator sends it (256-token chunks, all pipelined at once): each
decode frame's wait at the stage (arrival to output) before and while the prompt runs,
and the prompt's time at the stage, with prefill pieces (--prefill-piece-tokens 64) and
without (0: a chunk is one forward), and the same prompt on an idle stage both ways; each
`--prompt-reps` times, the two ways alternating: the prompt's best time, the waits pooled.
Then which prompt's pieces go first (`prefill_order`, --order-only): the same stage and
decode jobs, the long prompt arriving, and while it runs a 43-token prompt every 0.25 s
(one chunk each): each short prompt's time at the stage (arrival to output) and the long
prompt's, with prefill shortest remaining prompt first (the default) and oldest first
(--prefill-order arrival), alternating, `--prompt-reps` runs each.
Usage: python scripts/bench_batch.py [--json OUT] [--reps N] [--threads 1] [--model smollm2-135m]
       [--rows-only | --pieces-only | --order-only] [--piece-layers 10] [--prompt-tokens 2048] [--decode-jobs 16]
       [--prompt-reps 3]
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
import trio

from shard.batch_plan import DEFAULT_PIECE_ROWS
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.stage import OutputHead, Stage, StageFrame
from shard.stage_scheduler import SchedulerConfig, StageScheduler, Waiting
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import open_or_prepare
from shard.wire.messages import Forward

ROWS = (1, 4, 16, 32)
CHUNK_TOKENS = 256  # the coordinator's prefill chunk (coordinator.jobs.engine_config)


def clock():
    """This thread's CPU time with one torch thread (what a loaded, shared machine's
    preemption does not inflate: the 2-core VM runs at load 5-10 while others work), else
    wall time (torch's own threads are not in the caller's CPU time)."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def paired_s(fn_a, fn_b, reps: int) -> tuple[float, float]:
    """Best-of-`reps` seconds for a and b, run alternately so both see the same machine
    load; other processes only ever add time, so the minimum is the least disturbed."""
    fn_a(), fn_b()  # warm-up
    a, b = [], []
    for _ in range(reps):
        for fn, out in ((fn_a, a), (fn_b, b)):
            t0 = clock()
            fn()
            out.append(clock() - t0)
    return min(a), min(b)


def bench_rows(store, args) -> list[dict]:
    """Batched vs one by one, N decode rows of N jobs through every layer as one stage."""
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

    # The mixed case: 12 decode rows at ctx 100-111 beside 4 at ctx 1900-1903 (one request in
    # four a ~2k-token prompt, as bench_load sends them): long contexts' attention is per job.
    for i in range(16):
        ctx = 1900 + i // 4 if i % 4 == 3 else 100 + i
        job = cache.open(f"mixed{i}", ctx + 1)
        ids = torch.randint(0, cfg.vocab_size, (ctx + 1,))
        stage.forward(job, ids[:ctx], ctx_len=0, positions=torch.arange(ctx))
        frames.append(StageFrame(job, ids[ctx:], ctx, torch.tensor([ctx])))
    cases = [(n, frames[:n]) for n in ROWS] + [("16 mixed", frames[-16:])]

    rows = []
    for case, batch in cases:
        n = len(batch)

        def batched(batch=batch):
            return [h for h, _ in stage.forward_batch(batch)]

        def one_by_one(batch=batch):
            return [stage.forward(f.job, f.x, ctx_len=f.ctx_len, positions=f.positions)[0] for f in batch]

        pairs = list(zip(batched(), one_by_one()))
        max_diff = max((a - b).abs().max().item() for a, b in pairs)
        max_logit_diff = max((head.logits(a) - head.logits(b)).abs().max().item() for a, b in pairs)
        scale = max(b.abs().max().item() for _, b in pairs)
        batched_s, alone_s = paired_s(batched, one_by_one, args.reps)
        rows.append({"rows": n, "case": str(case), "batched_s": batched_s, "one_by_one_s": alone_s, "speedup": alone_s / batched_s,
                     "batched_rows_per_s": n / batched_s, "max_abs_diff_hidden": max_diff,
                     "max_abs_hidden": scale, "max_abs_diff_logits": max_logit_diff})
        print(f"{case!s:>8} rows  batched {batched_s * 1e3:8.2f} ms  one by one {alone_s * 1e3:8.2f} ms  "
              f"speed-up {alone_s / batched_s:5.2f}x  max |diff| hidden {max_diff:.1e} (of {scale:.0f}), logits {max_logit_diff:.1e}")
    one = rows[0]["batched_s"]
    for row in rows:
        row["cost_vs_one_row"] = row["batched_s"] / one
        row["throughput_vs_one_row"] = row["batched_rows_per_s"] * one
    return rows


def frame(job: str, ids: list[int], ctx: int, phase: str) -> Forward:
    return Forward(job_id=job, epoch=1, round=0, nonce=bytes(16), phase=phase, ctx_len=ctx,
                   positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


def spread(waits: list[float]) -> dict:
    """p50 / p95 / max of waits in seconds (nearest rank), and how many."""
    w = sorted(waits)
    at = lambda q: w[min(len(w) - 1, int(q * len(w)))] if w else None  # noqa: E731
    return {"n": len(w), "p50_s": at(0.5), "p95_s": at(0.95), "max_s": w[-1] if w else None}


async def prompt_at_stage(stage: Stage, piece_rows: int, decode_jobs: int, prompt_tokens: int, delay_s: float,
                          warm_s: float, order: str = "shortest", short_every_s: float = 0.0) -> dict:
    """One run: `decode_jobs` jobs decoding in a closed loop through the node's scheduler
    and worker, a prompt arriving after `warm_s`; what the decode frames waited and what
    the prompt took; `short_every_s` > 0: a 43-token prompt that often while it runs, and
    what each took. The worker's caches are fresh; the contexts are prefilled first."""
    cfg = stage.cfg
    worker = StageWorker(stage, WorkerConfig(max_context_tokens=4096))
    g = torch.Generator().manual_seed(1)
    ctxs = {}
    for i in range(decode_jobs):
        ctxs[f"d{i}"] = 96 + (i * 37) % 64
        worker.compute([frame(f"d{i}", torch.randint(3, cfg.vocab_size, (ctxs[f"d{i}"],), generator=g).tolist(), 0,
                              "prefill")])
    prompt = torch.randint(3, cfg.vocab_size, (prompt_tokens,), generator=g).tolist()
    state, done, arrived, waits = object(), {}, {}, []
    prompt_out: list[float] = []
    shorts: dict[str, list[float]] = {}  # job -> [arrived, done]

    async def run_batch(st, batch):
        outs = await trio.to_thread.run_sync(worker.process_frames, [(w.msg, b"") for w in batch],
                                             [w.piece for w in batch])
        now = trio.current_time()
        for w, out in zip(batch, outs):
            if isinstance(out, Exception):
                raise out
            if out is not None and w.job_id == "prompt":
                prompt_out.append(now)
            elif out is not None and w.job_id in shorts:
                shorts[w.job_id].append(now)
            elif out is not None:
                waits.append((arrived[w.job_id], now - arrived[w.job_id]))
                done[w.job_id].set()
        return []

    sched = StageScheduler(lambda: state, run_batch, SchedulerConfig(piece_rows=piece_rows, prefill_order=order))

    async def submit(fwd: Forward) -> None:
        rows, split_row_bytes = worker.queued_rows(fwd)
        await sched.submit(Waiting(state, fwd, memoryview(b""), fwd.job_id, rows, 0, split_row_bytes))

    async def decode(job: str) -> None:
        while True:
            done[job], arrived[job] = trio.Event(), trio.current_time()
            await submit(frame(job, [7], ctxs[job], "decode"))
            await done[job].wait()
            ctxs[job] += 1
            await trio.sleep(delay_s)

    async with trio.open_nursery() as nursery:
        await nursery.start(sched.serve)
        for job in ctxs:
            nursery.start_soon(decode, job)
        await trio.sleep(warm_s if decode_jobs else 0)
        t0 = trio.current_time()
        for start in range(0, prompt_tokens, CHUNK_TOKENS):  # the coordinator pipelines every chunk
            await submit(frame("prompt", prompt[start:start + CHUNK_TOKENS], start, "prefill"))
        while len(prompt_out) < -(-prompt_tokens // CHUNK_TOKENS):
            if short_every_s and trio.current_time() >= t0 + short_every_s * (len(shorts) + 1):
                shorts[f"s{len(shorts)}"] = [trio.current_time()]
                await submit(frame(f"s{len(shorts) - 1}", prompt[:43], 0, "prefill"))
            await trio.sleep(0.005)
        t1 = trio.current_time()
        while any(len(t) < 2 for t in shorts.values()):
            await trio.sleep(0.005)
        nursery.cancel_scope.cancel()
    return {"prompt_s": t1 - t0, "forwards": sched.forwards, "frames_and_pieces": sched.frames_run,
            "short_prompt_s": [t[1] - t[0] for t in shorts.values()],
            "decode_waits_before_prompt": [w for t, w in waits if t < t0],
            "decode_waits_while_prompt": [w for t, w in waits if t0 <= t < t1]}


def bench_pieces(store, args) -> dict:
    """The prompt beside decode jobs and alone, with pieces and without, each run
    `--prompt-reps` times, the two ways alternating so both see the same machine load:
    the prompt's best time, and the decode waits of all runs pooled."""
    cfg = store.config
    r = LayerRange(0, min(args.piece_layers, cfg.num_layers))
    stage = Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding())
    out = {"layers": len(r), "decode_jobs": args.decode_jobs, "prompt_tokens": args.prompt_tokens,
           "chunk_tokens": CHUNK_TOKENS, "ring_delay_s": args.ring_delay_ms / 1e3, "piece_rows": args.piece_rows,
           "reps": args.prompt_reps}
    for name, jobs in (("beside_decode", args.decode_jobs), ("alone", 0)):
        runs: dict[str, list[dict]] = {"pieces": [], "whole": []}
        for _ in range(args.prompt_reps):
            for label, piece_rows in (("pieces", args.piece_rows), ("whole", 0)):
                runs[label].append(trio.run(prompt_at_stage, stage, piece_rows, jobs, args.prompt_tokens,
                                            args.ring_delay_ms / 1e3, 1.5))
        for label, rs in runs.items():
            while_prompt = [w for run in rs for w in run["decode_waits_while_prompt"]]
            row = {"prompt_s_best": min(run["prompt_s"] for run in rs), "prompt_s": [run["prompt_s"] for run in rs],
                   "forwards": [run["forwards"] for run in rs]}
            if jobs:
                per_run = [spread(run["decode_waits_while_prompt"]) for run in rs]
                row.update(decode_wait_before_prompt=spread([w for run in rs for w in run["decode_waits_before_prompt"]]),
                           decode_wait_while_prompt=spread(while_prompt),
                           decode_wait_while_prompt_per_run=per_run,
                           decode_rows_per_s_while_prompt=len(while_prompt) / sum(run["prompt_s"] for run in rs))
            out[f"{name}_{label}"] = row
            during = row.get("decode_wait_while_prompt")
            print(f"{name:13s} {label:6s}  prompt best {row['prompt_s_best']:6.2f} s  forwards {row['forwards']}" +
                  (f"  decode wait p50/p95/max {during['p50_s'] * 1e3:5.0f} / {during['p95_s'] * 1e3:5.0f} / "
                   f"{during['max_s'] * 1e3:5.0f} ms, {row['decode_rows_per_s_while_prompt']:5.1f} rows/s (before the "
                   f"prompt: p95 {row['decode_wait_before_prompt']['p95_s'] * 1e3:.0f} ms); per run p95 " +
                   " ".join(f"{r['p95_s'] * 1e3:.0f}" for r in row["decode_wait_while_prompt_per_run"]) + " ms"
                   if during else ""))
    return out


def bench_order(store, args) -> dict:
    """The long prompt beside decode jobs and short prompts arriving while it runs, prefill
    shortest first and oldest first, alternating: the short prompts' times pooled, the long
    prompt's best and all."""
    cfg = store.config
    r = LayerRange(0, min(args.piece_layers, cfg.num_layers))
    stage = Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding())
    out = {"layers": len(r), "decode_jobs": args.decode_jobs, "prompt_tokens": args.prompt_tokens,
           "short_prompt_tokens": 43, "short_every_s": 0.25, "chunk_tokens": CHUNK_TOKENS,
           "ring_delay_s": args.ring_delay_ms / 1e3, "piece_rows": args.piece_rows, "reps": args.prompt_reps}
    runs: dict[str, list[dict]] = {"shortest": [], "arrival": []}
    for _ in range(args.prompt_reps):
        for order in runs:
            runs[order].append(trio.run(prompt_at_stage, stage, args.piece_rows, args.decode_jobs, args.prompt_tokens,
                                        args.ring_delay_ms / 1e3, 1.5, order, 0.25))
    for order, rs in runs.items():
        row = {"short_prompt": spread([s for run in rs for s in run["short_prompt_s"]]),
               "long_prompt_s_best": min(run["prompt_s"] for run in rs), "long_prompt_s": [run["prompt_s"] for run in rs],
               "decode_wait_while_prompt": spread([w for run in rs for w in run["decode_waits_while_prompt"]])}
        out[order] = row
        sp, dw = row["short_prompt"], row["decode_wait_while_prompt"]
        print(f"prefill {order:8s}  short prompt at the stage p50/p95/max {sp['p50_s'] * 1e3:5.0f} / "
              f"{sp['p95_s'] * 1e3:5.0f} / {sp['max_s'] * 1e3:5.0f} ms (n {sp['n']})  long prompt "
              f"{' '.join(f'{x:.2f}' for x in row['long_prompt_s'])} s  decode wait p95 {dw['p95_s'] * 1e3:.0f} ms",
              flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--json", default=None, help="write results here")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (local ring nodes use 1)")
    ap.add_argument("--rows-only", action="store_true", help="only the batched-vs-alone rows, not the long prompt")
    ap.add_argument("--pieces-only", action="store_true",
                    help="only the long prompt beside decode jobs (an existing --json file keeps its other figures)")
    ap.add_argument("--order-only", action="store_true",
                    help="only the prefill order: short prompts beside the long one (other --json figures kept)")
    ap.add_argument("--piece-layers", type=int, default=10, help="layers of the stage the prompt runs on")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--decode-jobs", type=int, default=16)
    ap.add_argument("--ring-delay-ms", type=float, default=60.0, help="a decode frame's trip round the rest of a ring")
    ap.add_argument("--piece-rows", type=int, default=DEFAULT_PIECE_ROWS, help="--prefill-piece-tokens of the run with pieces")
    ap.add_argument("--prompt-reps", type=int, default=3, help="runs of the prompt each way")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    store = open_or_prepare(args.model, progress=False)
    git_revision = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    conditions = {"model": args.model, "manifest_digest": store.digest, "dtype": "float32", "device": "cpu",
                  "torch_threads": args.threads, "torch": torch.__version__, "python": platform.python_version(),
                  "machine": platform.machine(), "cpus": os.cpu_count(), "git_revision": git_revision}
    result = {}
    if (args.pieces_only or args.order_only) and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            result = json.load(f)  # the batched-vs-alone figures stay as they were measured
    else:
        load_before = list(os.getloadavg())
        rows = bench_rows(store, args)
        result["conditions"] = conditions | {
            "layers": store.config.num_layers, "contexts": "job i at 96 + (37 i mod 64) tokens; 16 mixed: 12 at 100 + i, 4 at 1900-1903", "reps": args.reps,
            "timing": "best of reps, the two sides run alternately; CPU time of the thread with 1 torch thread, "
                      "else wall time", "load_average_at_start": load_before,
            "load_average": list(os.getloadavg())}
        result["rows"] = rows
    if args.order_only:
        load_before = list(os.getloadavg())
        order = bench_order(store, args)
        order["conditions"] = conditions | {"load_average_at_start": load_before, "load_average": list(os.getloadavg())}
        result["prefill_order"] = order
    elif not args.rows_only:
        load_before = list(os.getloadavg())
        pieces = bench_pieces(store, args)
        pieces["conditions"] = conditions | {"load_average_at_start": load_before, "load_average": list(os.getloadavg())}
        result["prefill_beside_decode"] = pieces
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
