"""The head stage's embedding is held in the node's own memory, not in its file mapping
(issue 20: random token ids from a predecessor made mapped pages resident one by one, and
bench_hostile's node grew +116 MB for good; RSS now starts at what the node will hold)."""

from __future__ import annotations

import gc

import torch

from shard.manifest import EMBED_FILE
from shard.node_config import NodeConfig, load_stage
from shard.layers import LayerRange


def mapped(path) -> bool:
    with open("/proc/self/maps") as f:
        return any(line.rstrip().endswith(str(path)) for line in f)


def test_a_head_stage_keeps_no_mapping_of_the_embedding_file(tiny_llama_store):
    # Bug guarded: the embedding tensor backed by the safetensors file's mmap. Sound: the
    # store's own load keeps the mapping (checked first, so the probe can see one), and the
    # stage's embedding equals the stored one.
    path = tiny_llama_store.root / EMBED_FILE
    stored = tiny_llama_store.load_embedding()
    assert mapped(path), "the probe cannot see a mapping of the embedding file"
    stage = load_stage(NodeConfig(coordinator="/ip4/127.0.0.1/tcp/1"), tiny_llama_store, LayerRange(0, 1))
    assert torch.equal(stage.embedding, stored)
    del stored
    gc.collect()
    assert not mapped(path)
