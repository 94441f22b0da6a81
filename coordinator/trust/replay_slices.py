"""The slices an auditor loaded to recompute audits itself, kept for the next few.

A gateway whose store holds the layers recomputes an audit itself when no verifier node
can (coordinator.trust.audit, AuditConfig.replay_here). Loading a slice costs its layer
files' read and, for a declared quantisation, the same quantisation (shard.quant); so the
last `max_slices` (layers, quantisation) pairs stay loaded, in f32 on the CPU, until
`release` (the auditor calls it after AuditConfig.slice_idle_s with no audit: a 10-layer
SmolLM2 slice is 140 MB). glibc keeps freed memory for reuse, so release hands it back to
the system too (shard.heap). Loads run on a worker thread under the caller's limiter.
"""

from __future__ import annotations

import gc

import trio

from shard.heap import return_freed_heap
from shard.layers import LayerRange
from shard.slice_cache import SliceCache
from shard.stage import Stage
from shard.store import ModelStore


class ReplaySlices:
    def __init__(self, store: ModelStore, max_slices: int, limiter: trio.CapacityLimiter) -> None:
        self._cache = SliceCache(store, "cpu", max_slices=max_slices)
        self._limiter = limiter
        self._loading = trio.Lock()  # one load at a time: concurrent audits of one slice load it once

    def __len__(self) -> int:
        return len(self._cache)

    async def get(self, r: LayerRange, quant: str = "none") -> Stage:
        """Layers `r` under quantisation `quant`, loaded from the store if not kept."""
        async with self._loading:
            stage = self._cache.get((r, quant))
            if stage is None:
                stage, _ = await trio.to_thread.run_sync(self._cache.load, (r, quant), limiter=self._limiter)
        return stage

    def release(self) -> None:
        """Drop every kept slice and hand the freed memory back to the system."""
        self._cache.clear()
        gc.collect()
        return_freed_heap()
