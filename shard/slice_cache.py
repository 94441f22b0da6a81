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

    def __init__(self, store: ModelStore, device: str, max_bytes: int, max_slices: int | None = None) -> None:
        self.store, self.device, self.max_bytes, self.max_slices = store, device, max_bytes, max_slices
        self._slices: OrderedDict[Key, Stage] = OrderedDict()
        self.loads, self.load_cpu_s = 0, 0.0  # slices loaded, and the CPU (thread) seconds it took

    def get(self, key: Key) -> Stage | None:
        stage = self._slices.get(key)
        if stage is not None:
            self._slices.move_to_end(key)
        return stage

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
        self.loads, self.load_cpu_s = self.loads + 1, self.load_cpu_s + cpu_s
        self._evict()
        return stage, cpu_s

    def _evict(self) -> None:
        """A head slice counts its token embedding too (loaded in f32: vocab x hidden x 4 bytes)."""
        cfg = self.store.config
        size = {k: sum(layer_bytes(cfg, i, scheme(k[1])) for i in k[0]) + (4 * cfg.vocab_size * cfg.hidden_size
                                                                           if k[0].start == 0 else 0)
                for k in self._slices}
        most = len(self._slices) if self.max_slices is None else self.max_slices
        while len(self._slices) > 1 and (sum(size[k] for k in self._slices) > self.max_bytes or len(self._slices) > most):
            self._slices.popitem(last=False)
