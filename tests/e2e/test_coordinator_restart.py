"""A coordinator restarted under warm nodes serves again on the same slices (issue 19).

Bug guarded: losing the coordinator's control stream ended every node, and a coordinator
restarted with the same key had no nodes, forever. Now each node keeps its slice,
registers again with backoff and reports the epoch and layers it holds; the new
coordinator continues the epochs above it and re-forms the ring those slices make.
Sound: "nothing reloaded" is checked by object identity of every stage's loaded slice
(a reload builds a new Stage), and the text by equality with the run before the restart.
"""

from __future__ import annotations

import os
import socket

import trio
from transformers import AutoTokenizer

from coordinator.assembly import open_coordinator
from coordinator.config import CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.swarm import SwarmConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.reconnect import ReconnectPolicy
from shard.transport import open_host
from tests.e2e.ringkit import generate_greedy, memory_for_stages

PROMPT = [1, 50, 60, 70, 80, 90]
TOKENS = 12
STAGES = 2


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def run_node(store, coordinator: str, nodes: list, task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_host(keypair_from_seed(os.urandom(32))) as host:
        node = Node(NodeConfig(coordinator=coordinator, model=store.manifest.name,
                               max_memory_bytes=memory_for_stages(store, STAGES)), host, store,
                    reconnect=ReconnectPolicy(first_s=0.1, max_s=0.5))
        nodes.append(node)
        await node.serve(task_status=task_status)


def test_a_restarted_coordinator_re_forms_the_warm_ring_and_serves_the_same_text(tiny_llama_store):
    store = tiny_llama_store
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    key = keypair_from_seed(os.urandom(32))
    config = CoordConfig(listen=f"/ip4/127.0.0.1/tcp/{free_loopback_port()}", min_nodes=STAGES,
                         swarm=SwarmConfig(), engine=EngineConfig(draft="none"), receipts=ReceiptConfig(enabled=False))

    async def main():
        nodes: list[Node] = []
        async with trio.open_nursery() as outer:
            async with open_coordinator(config, store, tokenizer, key) as first:
                for _ in range(STAGES):
                    await outer.start(run_node, store, first.addr, nodes)
                with trio.fail_after(60):
                    ring = await first.swarm.wait_ring()
                before = await generate_greedy(first.engine, PROMPT, TOKENS)
                slices = {n.host.peer_id: n.state.worker.stage for n in nodes}
                epoch_before = ring.epoch
            # The coordinator is gone (its host closed every connection); the nodes retry.
            t0 = trio.current_time()
            async with open_coordinator(config, store, tokenizer, key) as second:
                with trio.fail_after(30):
                    ring = await second.swarm.wait_ring()
                formed_s = trio.current_time() - t0
                after = await generate_greedy(second.engine, PROMPT, TOKENS)
                kept = {n.host.peer_id: n.state.worker.stage for n in nodes}
            outer.cancel_scope.cancel()
        return before, after, slices, kept, epoch_before, ring.epoch, formed_s

    before, after, slices, kept, epoch_before, epoch_after, formed_s = trio.run(main)
    assert after == before
    assert len(slices) == STAGES and all(kept[p] is slices[p] for p in slices), "a slice was reloaded"
    assert epoch_after > epoch_before  # the nodes' epochs keep growing: no assignment refused as a replay
    assert formed_s < 15, formed_s
