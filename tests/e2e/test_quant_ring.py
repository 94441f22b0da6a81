"""Quantised nodes in a real ring: `shard-node join --quant int4` end to end.

Guards the wiring around shard.quant: the flag reaching the node's loaded slice (not only
its self-benchmark), the node's Register carrying its scheme and its bytes per layer, the
selector seating by those bytes (nodes whose memory holds half the model in f32 hold all
of it in int4, so the ring has one stage instead of two), and the ring's greedy tokens
being those of the quantised model: the oracle is the same int4 slice run locally (the
int4 kernels are row-independent, so prefill and decode are bit-exact against it).
"""

from __future__ import annotations

import torch
import trio

from coordinator.jobs.engine_config import EngineConfig
from shard.cli import build_parser
from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.node import NodeConfig
from shard.options import config_from_args
from shard.quant import SCHEMES, mean_layer_bytes, quantise_stage
from shard.stage import OutputHead, Stage
from tests.e2e.ringkit import generate_greedy, open_local_ring

PROMPT = [1] + [3 + (7 * i) % 200 for i in range(11)]
NEW_TOKENS = 8


def test_join_takes_the_quant_flag():
    args = build_parser().parse_args(["join", "--coordinator", "/ip4/127.0.0.1/tcp/1/p2p/x", "--quant", "int4"])
    assert config_from_args(NodeConfig, args, coordinator=args.coordinator).quant == "int4"


def local_greedy(store, scheme: str) -> list[int]:
    cfg = store.config
    r = LayerRange(0, cfg.num_layers)
    stage = quantise_stage(Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding()), SCHEMES[scheme])
    norm, lm_head = store.load_head()
    head = OutputHead(cfg, norm, lm_head if lm_head is not None else store.load_embedding())
    job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 26).open("j", 64)
    hidden, _ = stage.forward(job, torch.tensor(PROMPT), ctx_len=0, positions=torch.arange(len(PROMPT)))
    out = [int(head.logits(hidden[-1:]).argmax())]
    while len(out) < NEW_TOKENS:
        pos = len(PROMPT) + len(out) - 1
        hidden, _ = stage.forward(job, torch.tensor(out[-1:]), ctx_len=pos, positions=torch.tensor([pos]))
        out.append(int(head.logits(hidden).argmax()))
    return out


def test_int4_nodes_seat_the_whole_model_in_one_stage_and_decode_the_int4_model(tiny_llama_store):
    store = tiny_llama_store

    async def main():
        async with open_local_ring(store, 2, engine=EngineConfig(draft="none"), node_config={"quant": "int4"}) as ring:
            regs = [m.register for m in ring.swarm.members.values()]
            assert {(r.quant, r.bytes_per_layer) for r in regs} == {("int4", mean_layer_bytes(store.config, SCHEMES["int4"]))}
            assert [len(layers) for _, layers in ring.swarm.ring.stages] == [store.num_layers]
            return await generate_greedy(ring.engine, PROMPT, NEW_TOKENS)

    assert trio.run(main) == local_greedy(store, "int4")
