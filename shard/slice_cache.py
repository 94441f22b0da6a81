"""The slices loaded for audits' replays, in f32 (quantised as the audited stage declared),
kept while their weights fit a budget of bytes, or of slices.

A ring stage verifies the other stages' slices, drawn at random per audit, so keeping only
the one in use reloaded it whenever the draw alternated (0.25-0.7 CPU-s for a 10-layer
SmolLM2 slice on the dev VM, as much as the replay). Used by shard.verifier (a node's
replays, bounded by bytes) and coordinator.trust.replay_slices (a gateway's own, bounded by
count): the load is synchronous, its caller decides which thread runs it and when.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import torch

from shard.layers import LayerRange
from shard.quant import layer_bytes, quantise_stage, scheme
from shard.stage import Stage
from shard.store import ModelStore

Key = tuple[LayerRange, str]  # (layers, weight quantisation)


class SliceCache:
    """Loaded slices, least recently used first; the newest always stays."""

    def __init__(self, store: ModelStore, device: str, max_bytes: int | None = None,
                 max_slices: int | None = None) -> None:
        """`max_bytes`, `max_slices`: the bounds (None: none of that kind)."""
        self.store, self.device, self.max_bytes, self.max_slices = store, device, max_bytes, max_slices
        self._slices: OrderedDict[Key, Stage] = OrderedDict()
        self.loads = 0  # slices loaded

    def get(self, key: Key) -> Stage | None:
        stage = self._slices.get(key)
        if stage is not None:
            self._slices.move_to_end(key)
        return stage

    def __contains__(self, key: Key) -> bool:
        return key in self._slices

    def owns(self, stage: Stage) -> bool:
        return any(s is stage for s in self._slices.values())

    def __len__(self) -> int:
        return len(self._slices)

    def clear(self) -> None:
        self._slices.clear()

    def load(self, key: Key) -> tuple[Stage, float]:
        """Load `key` in f32 (quantised as it names), keep it, and drop the oldest others until
        the rest fit max_bytes and max_slices; the slice and the CPU seconds the calling thread
        spent."""
        started = time.thread_time()
        r, quant = key
        weights = self.store.load_layers(r, torch.float32, self.device)
        emb = self.store.load_embedding(torch.float32, self.device) if r.start == 0 else None
        stage = quantise_stage(Stage(self.store.config, r, weights, dtype=torch.float32, device=self.device,
                                     embedding=emb), scheme(quant))
        cpu_s = time.thread_time() - started
        self._slices[key] = stage
        self.loads += 1
        self._evict()
        return stage, cpu_s

    def _evict(self) -> None:
        if self.max_slices is not None:
            while len(self._slices) > max(self.max_slices, 1):
                self._slices.popitem(last=False)
        if self.max_bytes is not None:
            while len(self._slices) > 1 and sum(map(self._nbytes, self._slices)) > self.max_bytes:
                self._slices.popitem(last=False)

    def _nbytes(self, key: Key) -> int:
        """A head slice counts its token embedding too (loaded in f32: vocab x hidden x 4 bytes)."""
        cfg, (r, quant) = self.store.config, key
        embedding = 4 * cfg.vocab_size * cfg.hidden_size if r.start == 0 else 0
        return sum(layer_bytes(cfg, i, scheme(quant)) for i in r) + embedding
