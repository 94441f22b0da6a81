"""An in-process ring for tests: a coordinator (coordinator.assembly, receipts off) and N
real Nodes, each a libp2p host on loopback with its own key, all inside one trio run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import trio
from transformers import AutoTokenizer

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.ring_engine import RingEngine
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.swarm import Swarm, SwarmConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.transport import open_host


@dataclass
class LocalRing:
    engine: RingEngine
    swarm: Swarm
    node_scopes: list[trio.CancelScope]
    node_ids: list[str]
    nodes: list[Node] = field(default_factory=list)  # in the order started

    def kill(self, peer_id: str) -> None:
        """Stop a node abruptly: its host closes, as when a volunteer's machine dies."""
        self.node_scopes[self.node_ids.index(peer_id)].cancel()


async def _run_node(store, coordinator: str, node_config: dict, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with open_host(keypair_from_seed(os.urandom(32))) as host:
            node = Node(NodeConfig(coordinator=coordinator, model=store.manifest.name, **node_config), host, store)
            task_status.started((scope, host.peer_id, node))
            await node.serve()


async def generate_greedy(engine, prompt: list[int], n: int) -> list[int]:
    """The first `n` greedy tokens of one job on `engine` (the job is closed after)."""
    return (await generate_greedy_with_stats(engine, prompt, n))[0]


async def generate_greedy_with_stats(engine, prompt: list[int], n: int) -> tuple[list[int], dict]:
    """`generate_greedy`, and the job's stats once the n tokens are in."""
    job = await engine.open_job(prompt, SamplingParams(temperature=0.0))
    out: list[int] = []
    try:
        async with aclosing(job.next_tokens()) as blocks:
            async for block in blocks:
                out += block
                if len(out) >= n:
                    break
        stats = job.stats()
    finally:
        await job.aclose()
    return out[:n], stats


def memory_for_stages(store, stages: int) -> int:
    """Memory to declare per node so that `stages` nodes are all needed: each holds at
    most ceil(L / stages) layers plus their K/V for the planner's workload, and the token
    embedding besides, which whichever node is the head holds too. On loopback
    the selector rightly prefers fewer hops, so a test of an N-stage ring says so by
    giving nodes only the memory an N-way split needs (as small GPUs would)."""
    from coordinator.swarm.topology import TopologyConfig, model_spec

    topo = TopologyConfig()
    spec = model_spec(store, "f32", topo.kv_bytes_per_value)
    per_layer = spec.bytes_per_layer + spec.kv_bytes_per_token_layer * (topo.prompt_tokens + topo.output_tokens)
    return per_layer * -(-store.num_layers // stages) + per_layer // 2 + spec.head_bytes


@contextlib.asynccontextmanager
async def open_local_ring(store, nodes: int, *, wire_dtype: str = "f32", engine: EngineConfig = EngineConfig(),
                          node_config: dict | None = None, swarm: dict | None = None) -> AsyncIterator[LocalRing]:
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=nodes, swarm=SwarmConfig(wire_dtype=wire_dtype, **(swarm or {})),
                         engine=engine, receipts=ReceiptConfig(enabled=False))
    async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as coordinator:
        node_config = {"max_memory_bytes": memory_for_stages(store, nodes), **(node_config or {})}
        started = [await coordinator.nursery.start(_run_node, store, coordinator.addr, node_config)
                   for _ in range(nodes)]
        with trio.fail_after(60):
            await coordinator.swarm.wait_ring()
        yield LocalRing(coordinator.engine, coordinator.swarm, [s for s, _, _ in started], [p for _, p, _ in started],
                        [n for _, _, n in started])
