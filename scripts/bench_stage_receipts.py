"""What signing receipts adds to a stage's time per frame, measured on the stage itself.

One SmolLM2 middle stage (layers [10, 20), fp32, 1 thread) processes the same decode and
verify frames with and without its receipt signer (frame log on, as nodes run it), the
two workers alternating call by call. Each call is what a node does per frame
(StageWorker.process_frame: compute, encode the output, and sign over the received and
sent canonical bytes); the signer is also timed alone on those frames.
Usage: python scripts/bench_stage_receipts.py [--json OUT] [--reps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch

from shard.frame_log import FrameLog, FrameLogConfig
from shard.layers import LayerRange
from shard.receipt_signer import make_signer
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import open_or_prepare
from shard.wire.codec import encode_body
from shard.wire.messages import Assignment, Forward

LAYERS = LayerRange(10, 20)


def frames(cfg, ctx: int, t: int) -> Forward:
    g = torch.Generator().manual_seed(t)
    parents = torch.arange(-1, t - 1, dtype=torch.int32) if t > 1 else None
    return Forward(job_id="bench", epoch=1, round=t, nonce=b"n" * 16, phase="verify" if t > 1 else "decode",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + t), tree_parents=parents,
                   hidden=torch.randn(t, cfg.hidden_size, generator=g))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=40)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    store = open_or_prepare("smollm2-135m")
    cfg = store.config
    stage = Stage(cfg, LAYERS, store.load_layers(LAYERS))
    seed = os.urandom(32)
    assignment = Assignment(epoch=1, peer_id="p", role="stage", layer_start=LAYERS.start, layer_end=LAYERS.end,
                            predecessor="a", successor="b", model="m", manifest_digest=store.digest, wire_dtype="f32")
    signer = make_signer(seed, store, assignment, FrameLog(FrameLogConfig()))
    plain, signed = StageWorker(stage, WorkerConfig()), StageWorker(stage, WorkerConfig(), signer)
    ctx = 128
    warm = Forward(job_id="bench", epoch=1, round=0, nonce=b"n" * 16, phase="prefill", ctx_len=0,
                   positions=torch.arange(ctx), hidden=torch.randn(ctx, cfg.hidden_size))
    plain.process_frame(warm, encode_body(warm)), signed.process_frame(warm, encode_body(warm))
    rows = []
    for t in (1, 8):
        fwd = frames(cfg, ctx, t)
        received = memoryview(encode_body(fwd))  # as the node hands it over: a view of the frame it read
        a, b, s = [], [], []
        for _ in range(args.reps):
            for worker, out in ((plain, a), (signed, b)):
                t0 = time.perf_counter()
                sent, _ = worker.process_frame(fwd, received)
                out.append(time.perf_counter() - t0)
            sent_bytes = encode_body(sent)
            t0 = time.perf_counter()
            signer(fwd, received, sent_bytes)
            s.append(time.perf_counter() - t0)
        row = {"frame_tokens": t, "stage_s_best": min(a), "stage_with_receipts_s_best": min(b),
               "signer_s_median": statistics.median(s), "signer_share_of_stage": statistics.median(s) / min(a),
               "paired_overhead_best": min(b) / min(a) - 1}
        rows.append(row)
        print(f"T={t}: stage {min(a) * 1e3:.2f} ms, with receipts {min(b) * 1e3:.2f} ms; signer alone "
              f"{statistics.median(s) * 1e3:.3f} ms = {row['signer_share_of_stage'] * 100:.2f}% of the stage")
    report = {"conditions": {"model": "smollm2-135m", "layers": [LAYERS.start, LAYERS.end], "dtype": "float32",
                             "wire": "f32", "torch_threads": 1, "reps": args.reps, "context_tokens": ctx,
                             "load_average": os.getloadavg(), "machine": platform.machine(),
                             "git_revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                            text=True).stdout.strip()},
              "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
