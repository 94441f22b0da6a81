"""An in-process ring for tests: a coordinator (swarm + ring engine) and N real Nodes, each
a libp2p host on loopback with its own key, all inside one trio run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import trio
from transformers import AutoTokenizer

from coordinator.jobs.ring_engine import EngineConfig, RingEngine
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.swarm import REPORT_BUFFER, Swarm, SwarmConfig
from shard.identity import keypair_from_seed
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig
from shard.transport import open_host


@dataclass
class LocalRing:
    engine: RingEngine
    swarm: Swarm
    node_scopes: list[trio.CancelScope]
    node_ids: list[str]

    def kill(self, peer_id: str) -> None:
        """Stop a node abruptly: its host closes, as when a volunteer's machine dies."""
        self.node_scopes[self.node_ids.index(peer_id)].cancel()


async def _run_node(store, coordinator: str, node_config: dict, task_status=trio.TASK_STATUS_IGNORED) -> None:
    with trio.CancelScope() as scope:
        async with open_host(keypair_from_seed(os.urandom(32))) as host:
            node = Node(NodeConfig(coordinator=coordinator, model=store.manifest.name, **node_config), host, store)
            task_status.started((scope, host.peer_id))
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
    most ceil(L / stages) layers plus their K/V for the planner's workload. On loopback
    the selector rightly prefers fewer hops, so a test of an N-stage ring says so by
    giving nodes only the memory an N-way split needs (as small GPUs would)."""
    from coordinator.swarm.topology import TopologyConfig, model_spec

    topo = TopologyConfig()
    spec = model_spec(store, "f32", topo.kv_bytes_per_value)
    per_layer = spec.bytes_per_layer + spec.kv_bytes_per_token_layer * (topo.prompt_tokens + topo.output_tokens)
    return per_layer * -(-store.num_layers // stages) + per_layer // 2


@contextlib.asynccontextmanager
async def open_local_ring(store, nodes: int, *, wire_dtype: str = "f32", engine: EngineConfig = EngineConfig(),
                          node_config: dict | None = None) -> AsyncIterator[LocalRing]:
    seed = os.urandom(32)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    job_errors_in, job_errors = trio.open_memory_channel(REPORT_BUFFER)
    ring_changes_in, ring_changes = trio.open_memory_channel(REPORT_BUFFER)
    swarm = Swarm(store, seed, SwarmConfig(min_nodes=nodes, wire_dtype=wire_dtype), job_errors=job_errors_in,
                  ring_changes=ring_changes_in)
    async with open_host(keypair_from_seed(seed)) as host:
        ring_engine = RingEngine(swarm, host, tokenizer, engine, job_errors=job_errors, ring_changes=ring_changes)
        host.set_handler(CONTROL_PROTOCOL, swarm.handle_control)
        host.set_handler(RING_PROTOCOL, ring_engine.handle_ring_stream)
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.serve_formation)
            await nursery.start(ring_engine.serve)
            config = {"max_memory_bytes": memory_for_stages(store, nodes), **(node_config or {})}
            started = [await nursery.start(_run_node, store, host.addrs[0], config) for _ in range(nodes)]
            with trio.fail_after(60):
                await swarm.wait_ring()
            yield LocalRing(ring_engine, swarm, [s for s, _ in started], [p for _, p in started])
            nursery.cancel_scope.cancel()
