"""`shard-coord serve`: one process tree holding the coordinator (coordinator.assembly) and
its HTTP API, plus (with --local-nodes N) N `shard-node join` subprocesses on loopback.

Loads the model and identity, then adds HTTP and local nodes on top of open_coordinator;
each piece documents its own errors.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from functools import partial

import trio

from coordinator.assembly import open_coordinator
from coordinator.config import CoordConfig
from coordinator.gateway.api import serve_http
from coordinator.gateway.metrics import GatewayMetrics
from coordinator.gateway.operator import create_gateway
from coordinator.trust.report import trust_report
from shard.identity import load_or_create_identity
from shard.quant import effective_scheme
from shard.store import cache_root, open_or_prepare

log = logging.getLogger("shard.coordinator")


async def serve_coordinator(config: CoordConfig, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled. task_status.started((http_port, multiaddr, model id, the
    coordinator's receipt-signing public key as hex or None with receipts off, an async
    function returning once a ring is formed)), once the local ring is ready when there is one."""
    from transformers import AutoTokenizer

    config = dataclasses.replace(config, engine=dataclasses.replace(
        config.engine, max_groups=local_groups(config.engine.max_groups, config.local_nodes,
                                               emulated=config.engine.link_latency_ms > 0)))
    store = await trio.to_thread.run_sync(lambda: open_or_prepare(config.model, config.store_dir))
    if config.local_nodes:  # a --node-quant the store cannot run: one line now, not N failed nodes
        effective_scheme(store.manifest.quant, config.node_quant)
    tokenizer = await trio.to_thread.run_sync(AutoTokenizer.from_pretrained, str(store.tokenizer_dir))
    keypair = load_or_create_identity(config.key_path or cache_root() / "coordinator.key")
    host_name, port = config.http.rsplit(":", 1)
    api = dataclasses.replace(config.api, host=host_name, port=int(port))
    metrics = GatewayMetrics()  # the ring's rounds are observed from the start
    async with open_coordinator(config, store, tokenizer, keypair, observer=metrics) as coordinator:
        nursery = coordinator.nursery
        gateway = create_gateway(coordinator.engine, api, metrics=metrics,
                                 trust=lambda: trust_report(coordinator.receipts, coordinator.auditor))
        http_port = await nursery.start(partial(serve_http, gateway, api.host, api.port,
                                                header_timeout_s=api.header_timeout_s))
        for i in range(config.local_nodes):
            nursery.start_soon(run_local_node, config, store.root, coordinator.addr, i)
        log.info("coordinator %s listening; HTTP on %s:%d", coordinator.addr, api.host, http_port)
        if config.local_nodes:
            log.info("waiting for %d local nodes to load their slices and form the ring", config.local_nodes)
            await coordinator.swarm.wait_ring()
        key = coordinator.receipts.key.public_bytes().hex() if coordinator.receipts is not None else None
        task_status.started((http_port, coordinator.addr, coordinator.engine.model_id, key, coordinator.swarm.wait_ring))
        await trio.sleep_forever()


def local_groups(max_groups: int, local_nodes: int, *, emulated: bool = False, cores: int | None = None) -> int:
    """--max-groups as the engine takes it: -1 (auto) is this machine's cores where its local
    nodes and the gateway (each a process wanting a core) outnumber them, else no bound (0);
    local nodes on emulated WAN links stand for separate machines, so no bound there either."""
    if max_groups >= 0:
        return max_groups
    cores = cores or os.cpu_count() or 1
    return cores if local_nodes and not emulated and local_nodes + 1 > cores else 0


async def run_local_node(config: CoordConfig, store_dir, coordinator_addr: str, index: int) -> None:
    """One `shard-node join` subprocess on loopback, on the coordinator's emulated links;
    killed when the coordinator stops."""
    env = {**os.environ, "OMP_NUM_THREADS": str(config.node_threads)}
    await trio.run_process(local_node_command(config, store_dir, coordinator_addr, index), env=env, check=False)
    log.warning("local node %d exited", index)


def local_node_command(config: CoordConfig, store_dir, coordinator_addr: str, index: int) -> list[str]:
    """The `shard-node join` command line of local node `index`: the coordinator's model,
    store, emulated links and node options (threads, quantisation)."""
    key = cache_root() / "local-nodes" / f"node{index}.key"
    link = config.engine
    return [sys.executable, "-m", "shard.cli", "join", "--coordinator", coordinator_addr, "--model", config.model,
            "--store-dir", str(store_dir), "--key-path", str(key), "--torch-threads", str(config.node_threads),
            "--quant", config.node_quant, "--batch-token-budget", str(config.node_batch_token_budget),
            "--burst-wait-ms", str(link.burst_wait_ms), "--prefill-order", config.node_prefill_order,
            "--link-latency-ms", str(link.link_latency_ms), "--link-upload-mbps", str(link.link_upload_mbps),
            "--link-jitter-ms", str(link.link_jitter_ms), "--exit-with-parent-pid", str(os.getpid())]
