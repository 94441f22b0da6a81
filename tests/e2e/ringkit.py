"""An in-process ring for tests: a coordinator (swarm + ring engine) and N real Nodes, each
a libp2p host on loopback with its own key, all inside one trio run."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import trio
from transformers import AutoTokenizer

from coordinator.ring_engine import EngineConfig, RingEngine
from coordinator.swarm import Swarm, SwarmConfig
from shard.identity import keypair_from_seed
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig
from shard.transport import open_host


@contextlib.asynccontextmanager
async def open_local_ring(store, nodes: int, *, wire_dtype: str = "f32", engine: EngineConfig = EngineConfig(),
                          node_config: dict | None = None) -> AsyncIterator[RingEngine]:
    seed = os.urandom(32)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    swarm = Swarm(store, seed, SwarmConfig(min_nodes=nodes, wire_dtype=wire_dtype))
    async with contextlib.AsyncExitStack() as stack:
        host = await stack.enter_async_context(open_host(keypair_from_seed(seed)))
        ring_engine = RingEngine(swarm, host, tokenizer, engine)
        host.set_handler(CONTROL_PROTOCOL, swarm.handle_control)
        host.set_handler(RING_PROTOCOL, ring_engine.handle_ring_stream)
        node_hosts = [await stack.enter_async_context(open_host(keypair_from_seed(os.urandom(32)))) for _ in range(nodes)]
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.serve_formation)
            await nursery.start(ring_engine.serve)
            for node_host in node_hosts:
                node = Node(NodeConfig(coordinator=host.addrs[0], model=store.manifest.name, **(node_config or {})),
                            node_host, store)
                nursery.start_soon(node.serve)
            with trio.fail_after(60):
                await swarm.wait_ring()
            yield ring_engine
            nursery.cancel_scope.cancel()
