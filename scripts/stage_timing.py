"""Timing a stage's batched forward the same way in the GPU checks and profiles (issue 21):
decode rows one a job at a fixed context, and the best of N synchronised runs after warm-ups.
Used by scripts/check_cuda_batch.py and scripts/profile_stage_batch.py."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from shard.kvcache import KVCache
from shard.stage import Stage, StageFrame

CTX = 128  # the context the timed decode rows sit at


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def best_time(run: Callable[[], object], reps: int, device: str) -> tuple[float, float, object]:
    """(best wall seconds, best seconds until `run` returned, before the final synchronisation:
    on a GPU the host's part, the kernels run behind it; the last result) of `reps` runs after
    two warm-ups."""
    wall = host = float("inf")
    for i in range(reps + 2):
        sync(device)
        t0 = time.perf_counter()
        out = run()
        t1 = time.perf_counter()
        sync(device)
        if i >= 2:
            wall, host = min(wall, time.perf_counter() - t0), min(host, t1 - t0)
    return wall, host, out


def decode_frames(stage: Stage, cache: KVCache, rows: int, gen: torch.Generator) -> list[StageFrame]:
    """`rows` jobs' decode rows at context CTX (their K/V slots before it zeros: the same reads as a real context)."""
    return [StageFrame(cache.open(f"s{rows}_{j}", CTX + 1), torch.randn(1, stage.cfg.hidden_size, generator=gen),
                       CTX, torch.tensor([CTX])) for j in range(rows)]
