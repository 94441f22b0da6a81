"""`shard-coord serve`: one process tree holding the coordinator's host, swarm, engine and
HTTP API, plus (with --local-nodes N) N `shard-node join` subprocesses on loopback.

Wires the pieces together and nothing else; each piece documents its own errors.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import trio

from coordinator.gateway.api import ApiConfig, create_app, serve_http
from coordinator.trust.audit import AuditConfig, Auditor
from coordinator.trust.receipt_check import ReceiptChecker, ReceiptConfig
from coordinator.jobs.ring_engine import EngineConfig, RingEngine, parse_tree
from coordinator.swarm.swarm import REPORT_BUFFER, Swarm, SwarmConfig
from coordinator.swarm.topology import TopologyConfig
from shard.identity import identity_signing_key, load_or_create_identity
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL
from shard.store import cache_root, open_or_prepare
from shard.transport import open_host
from shard.wire.dtypes import BY_CLI_NAME, from_cli_name

log = logging.getLogger("shard.coordinator")


def _opt(default, help: str, **meta):
    return field(default=default, metadata={"help": help, **meta})


@dataclass(frozen=True)
class CoordConfig:
    """Everything `shard-coord serve` takes; its flags are derived from these fields."""

    model: str = _opt("smollm2-135m", "model alias, HF dir or GGUF file (prepared into the store once)")
    store_dir: str | None = _opt(None, "model store dir (default: the shard cache)")
    listen: str = _opt("/ip4/127.0.0.1/tcp/0", "libp2p listen multiaddr")
    http: str = _opt("127.0.0.1:8000", "HOST:PORT for the OpenAI-compatible API (port 0 picks one)")
    key_path: str | None = _opt(None, "identity key file (default: <cache>/coordinator.key)")
    local_nodes: int = _opt(0, "spawn this many nodes on loopback and serve with them")
    min_nodes: int = _opt(0, "form a ring once this many nodes joined (default: local-nodes, else 1)")
    wire_dtype: str = _opt("f32", "activation dtype on the wire", choices=tuple(BY_CLI_NAME))
    aux_dtype: str | None = _opt(None, "dtype of the EAGLE aux features on the wire (default: the wire dtype; fp8 "
                                       "halves a draft row's aux bytes on a 16-bit wire)", choices=tuple(BY_CLI_NAME))
    link_latency_ms: float = _opt(0.0, "emulated one-way latency on every ring edge")
    link_upload_mbps: float = _opt(0.0, "emulated uplink of every ring sender in Mbit/s (0 = unlimited)")
    link_jitter_ms: float = _opt(0.0, "emulated jitter on every ring edge")
    draft: str = _opt("hybrid", "speculative drafter (hybrid = n-gram and the EAGLE head, routed per round)",
                      choices=("none", "ngram", "eagle", "hybrid"))
    eagle_head: str | None = _opt(None, "EAGLE head directory (default: the head shipped for the model)")
    eagle_tree: str | None = _opt(None, "fixed EAGLE tree NODES,DEPTH (default: each round sized by the head's "
                                        "confidence and the measured ring time)")
    pipeline_depth: int = _opt(EngineConfig.max_pipeline_depth, "most speculative rounds in flight per request, "
                               "later ones sent before earlier ones are verified (1 = no pipelining)")
    prefill_chunk_tokens: int = _opt(EngineConfig.prefill_chunk_tokens,
                                     "largest prefill chunk; chunks are pipelined through the ring")
    prefill_edge_chunk_tokens: int = _opt(EngineConfig.prefill_edge_chunk_tokens,
                                          "first and last prefill chunk (sizes ramp up and down by doubling)")
    max_concurrent_jobs: int = _opt(8, "requests beyond this get 429")
    node_threads: int = _opt(1, "torch threads per local node")
    receipts_dir: str | None = _opt(None, "append every job's signed receipt bundle here (default: memory only)")
    audit_rate: float = _opt(AuditConfig.rate, "probability a (job, stage) is audited by replay; cost in docs/receipts.md")


async def serve_coordinator(config: CoordConfig, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Run until cancelled. task_status.started((http_port, multiaddr, model id)), once the
    local ring is ready when there is one."""
    from transformers import AutoTokenizer

    store = await trio.to_thread.run_sync(lambda: open_or_prepare(config.model, config.store_dir))
    tokenizer = await trio.to_thread.run_sync(AutoTokenizer.from_pretrained, str(store.tokenizer_dir))
    keypair = load_or_create_identity(config.key_path or cache_root() / "coordinator.key")
    min_nodes = config.min_nodes or config.local_nodes or 1
    topology = TopologyConfig(prefill_chunk_tokens=config.prefill_chunk_tokens,
                              coordinator_link_latency_s=config.link_latency_ms / 1e3)
    # What one component reports to another travels on a channel, each read by one serve().
    job_errors_in, job_errors = trio.open_memory_channel(REPORT_BUFFER)
    ring_changes_in, ring_changes = trio.open_memory_channel(REPORT_BUFFER)
    audit_replies_in, audit_replies = trio.open_memory_channel(REPORT_BUFFER)
    audit_config = AuditConfig(rate=config.audit_rate)
    finished_in, finished = trio.open_memory_channel(audit_config.max_queued_jobs)
    swarm = Swarm(store, identity_signing_key(keypair), SwarmConfig(
        min_nodes=min_nodes, wire_dtype=from_cli_name(config.wire_dtype),
        aux_dtype=from_cli_name(config.aux_dtype) if config.aux_dtype else None, topology=topology),
        job_errors=job_errors_in, ring_changes=ring_changes_in, audit_replies=audit_replies_in)
    host_name, port = config.http.rsplit(":", 1)
    async with open_host(keypair, config.listen) as host:
        seed = identity_signing_key(keypair)
        checker = ReceiptChecker(store, seed, ReceiptConfig(receipts_dir=config.receipts_dir), finished=finished_in)
        auditor = Auditor(swarm, store, seed, audit_config, finished=finished, audit_replies=audit_replies)
        engine = RingEngine(swarm, host, tokenizer, EngineConfig(
            prefill_chunk_tokens=config.prefill_chunk_tokens, prefill_edge_chunk_tokens=config.prefill_edge_chunk_tokens,
            draft=config.draft, eagle_head=config.eagle_head, eagle_tree=parse_tree(config.eagle_tree),
            max_pipeline_depth=config.pipeline_depth,
            link_latency_ms=config.link_latency_ms,
            link_upload_mbps=config.link_upload_mbps, link_jitter_ms=config.link_jitter_ms), receipts=checker,
            job_errors=job_errors, ring_changes=ring_changes)
        host.set_handler(CONTROL_PROTOCOL, swarm.handle_control)
        host.set_handler(RING_PROTOCOL, engine.handle_ring_stream)
        addr = host.addrs[0]
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.serve_formation)
            await nursery.start(engine.serve)
            await nursery.start(auditor.serve)
            app = create_app(engine, ApiConfig(host=host_name, port=int(port), max_concurrent_jobs=config.max_concurrent_jobs))
            http_port = await nursery.start(serve_http, app, host_name, int(port))
            for i in range(config.local_nodes):
                nursery.start_soon(run_local_node, config, store.root, addr, i)
            log.info("coordinator %s listening; HTTP on %s:%d", addr, host_name, http_port)
            if config.local_nodes:
                log.info("waiting for %d local nodes to load their slices and form the ring", config.local_nodes)
                await swarm.wait_ring()
            task_status.started((http_port, addr, engine.model_id))


async def run_local_node(config: CoordConfig, store_dir, coordinator_addr: str, index: int) -> None:
    """One `shard-node join` subprocess on loopback; killed when the coordinator stops."""
    key = cache_root() / "local-nodes" / f"node{index}.key"
    cmd = [sys.executable, "-m", "shard.cli", "join", "--coordinator", coordinator_addr, "--model", config.model,
           "--store-dir", str(store_dir), "--key-path", str(key), "--torch-threads", str(config.node_threads),
           "--link-latency-ms", str(config.link_latency_ms), "--link-upload-mbps", str(config.link_upload_mbps),
           "--link-jitter-ms", str(config.link_jitter_ms)]
    env = {**os.environ, "OMP_NUM_THREADS": str(config.node_threads)}
    await trio.run_process(cmd, env=env, check=False)
    log.warning("local node %d exited", index)
