"""What a stage's memory holds: one layer's weights as its node keeps them, and the K/V
bytes left for its jobs. A node sizes its stage's KVCache by `stage_kv_bytes`; the gateway
(coordinator.jobs.kv_room) predicts each stage's room by the same figure from what the node
registered, so the two cannot drift apart. Does not know caches, jobs or the wire.
"""

from __future__ import annotations

from typing import Any

from shard.quant import mean_layer_bytes, scheme
from shard.wire.dtypes import COMPUTE_DTYPES

MIN_KV_BYTES = 64 << 20  # a stage's K/V bytes are never set below this


def held_bytes_per_layer(model_config: Any, quant: str, dtype: str) -> int:
    """One layer's weights as held under quantisation `quant` in compute dtype `dtype`
    (0: not quantised, the store's own bytes: ModelStore.layer_bytes)."""
    q, dense = scheme(quant), COMPUTE_DTYPES[dtype].itemsize
    return mean_layer_bytes(model_config, q, dense) if q.quantised else 0


def stage_weight_bytes(store: Any, r: Any, bytes_per_layer: int) -> int:
    """Layers `r` of `store` (a ModelStore) as a node holds them: `bytes_per_layer` each
    (held_bytes_per_layer, what it registers), else as stored; a head stage (r.start == 0)
    also holds the token embedding, resident (shard.node_config.load_stage), counted as
    stored (SmolLM2: 113 MB in f32, a third of the stage's layers)."""
    layers = len(r) * bytes_per_layer or store.layer_bytes(r)
    return layers + (store.embedding_bytes() if r.start == 0 else 0)


def stage_kv_bytes(memory_bytes: int, weight_bytes: int) -> int:
    """Bytes of K/V a stage may hold: its node's memory less its layers' weights."""
    return max(memory_bytes - weight_bytes, MIN_KV_BYTES)


def node_kv_bytes(config: Any, store: Any, r: Any) -> int:
    """The K/V bytes of a node (its NodeConfig) serving layers `r` of `store`."""
    per_layer = held_bytes_per_layer(store.config, config.quant, config.dtype)
    return stage_kv_bytes(config.max_memory_bytes, stage_weight_bytes(store, r, per_layer))
