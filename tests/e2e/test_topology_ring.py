"""The topology selector wired into a running in-process ring (issue 5, measurement and wiring).

Four real nodes join over loopback; one has an emulated slow uplink and every node's
memory holds at most two of the tiny model's five layers, so the ring needs three
stages and has exactly one node to spare. Guards: the coordinator feeding the selector
loopback numbers instead of the emulated ones (the slow node would then be as good as
any and could land on the ring), off-ring nodes left without a role (or serving ring
frames anyway), GET /v1/ring losing the plan's predictions, and re-formation after a
departure ignoring the layers that survivors (and the hot standby) already hold.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import trio
from transformers import AutoTokenizer

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.ring_engine import RingEngine
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.swarm.topology import TopologyConfig
from coordinator.trust.receipt_check import ReceiptConfig
from ring import ChurnPolicy
from shard.identity import keypair_from_seed
from shard.layers import LayerRange
from shard.node import Node, NodeConfig
from shard.transport import open_host
from tests.e2e.ringkit import generate_greedy

LATENCY_MS = 5.0
SLOW_UPLINK_MBPS = 2.0  # 250 kB/s: a 64-token prefill chunk of f32 hidden states (16 KiB) takes 66 ms
PROBE_BYTES = 32 << 10


@contextlib.asynccontextmanager
async def open_topology_ring(store, node_configs: list[dict], min_nodes: int
                             ) -> AsyncIterator[tuple[RingEngine, list[trio.CancelScope], list[Node]]]:
    """A coordinator and one Node per config, each with its own libp2p host inside its own
    cancel scope: cancelling one is a node process dying. Yields once a ring is ready."""
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    # The prefill chunk and the coordinator's link latency reach the topology from the
    # engine's config (coordinator.assembly).
    topo = TopologyConfig(prompt_tokens=256, output_tokens=32)
    # The tiny model's layers (150 kB) move faster than loopback latency noise (a few ms per
    # hop, times every decode traversal); charge moves as a real model's layers would cost.
    churn = ChurnPolicy(amortise_over_requests=0.01)
    # Seated on the speeds each node measured alone: the coordinator's speed probe times a
    # node from this one shared event loop, and in a loaded suite it read an honest node's
    # decode 30x its claim (11.6 ms per tiny layer) on every confirming round, so the
    # selector rightly traded that node for the slow uplink. The probe has its own tests
    # (tests/coordinator/swarm/test_speed_probe*.py); this one is about measured uplinks.
    probe = ProbeConfig(enabled=False)
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=min_nodes,
                         swarm=SwarmConfig(probe_wait_s=20.0, topology=topo, churn=churn, speed_probe=probe),
                         engine=EngineConfig(draft="none", prefill_chunk_tokens=64, link_latency_ms=LATENCY_MS),
                         receipts=ReceiptConfig(enabled=False))
    async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as coordinator:
        scopes, nodes = [], []

        async def run(extra: dict, task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                async with open_host(keypair_from_seed(os.urandom(32))) as node_host:
                    node = Node(NodeConfig(coordinator=coordinator.addr, model=store.manifest.name, probe_bytes=PROBE_BYTES,
                                           link_latency_ms=LATENCY_MS, **extra), node_host, store)
                    scopes.append(scope)
                    nodes.append(node)
                    # Started once registered: each node times its compute alone, as on its
                    # own machine (measured together on 2 cores, one could time 2-3x slow at
                    # random and the selector would rightly trade it for the slow uplink).
                    await node.serve(task_status=task_status)

        for extra in node_configs:
            await coordinator.nursery.start(run, extra)
        with trio.fail_after(60):
            await coordinator.swarm.wait_ring()
        yield coordinator.engine, scopes, nodes


def _two_layer_memory(store) -> int:
    """Memory for two layers with the KV cache of the workload's context, not three."""
    cfg = store.config
    per_layer = store.layer_bytes(LayerRange(0, 1))
    kv = 2 * cfg.num_kv_heads * cfg.head_dim * 4 * (256 + 32)
    return int(2.5 * (per_layer + kv))


def test_slow_uplink_stays_off_the_ring_and_survivors_keep_their_layers(tiny_llama_store):
    memory = _two_layer_memory(tiny_llama_store)
    configs = [{"max_memory_bytes": memory} for _ in range(4)]
    configs[2]["link_upload_mbps"] = SLOW_UPLINK_MBPS

    async def main():
        async with open_topology_ring(tiny_llama_store, configs, min_nodes=4) as (engine, scopes, nodes):
            swarm = engine.swarm
            slow = nodes[2].host.peer_id
            info = engine.info()
            topo = info["topology"]
            # Measured, not configured: the slow node's reported uplink is the emulated one
            # (within loopback noise), the others' (unshaped loopback) are clearly faster.
            slow_up = topo["nodes"][slow]["upload_bytes_per_s"]
            assert 0.5 * SLOW_UPLINK_MBPS * 125e3 < slow_up < 1.5 * SLOW_UPLINK_MBPS * 125e3, slow_up
            ups = {p: n["upload_bytes_per_s"] for p, n in topo["nodes"].items()}
            assert all(up > 3 * slow_up for p, up in ups.items() if p != slow), ups  # loopback is noisy, not slow
            # Every pair of nodes was probed: no hop of the plan is an estimate.
            assert not any(h["latency_estimated"] for h in topo["plan"]["hops"]), topo["plan"]["hops"]
            ring_peers = [m["peer_id"] for m in info["members"]]
            assert len(ring_peers) == 3 and slow not in ring_peers, (ring_peers, slow)
            assert set(topo["roles"]) == {slow} and topo["roles"][slow]["reason"]
            assert nodes[2].state is None  # holds a role, serves no ring frames
            predicted = topo["plan"]["predicted"]
            assert 0 < predicted["ttft_s"] < predicted["total_s"] and predicted["decode_step_s"] > 0
            assert len(topo["plan"]["hops"]) == 4

            out = await generate_greedy(engine, [1, 40, 41, 42, 43], 6)
            measured = engine.info()["topology"]["measured"]
            assert measured["prefill"]["rounds"] == 1 and measured["decode"]["rounds"] >= 4
            for kind in ("prefill", "decode"):
                assert measured[kind]["predicted_traversal_s"] > 0 and measured[kind]["measured_traversal_s"] > 0
                assert len(measured[kind]["measured_stage_compute_s"]) == 3

            # The middle stage leaves: the spare (slow) node must join, since two can't hold five layers.
            before = {p: tuple(r) for p, r in ((m["peer_id"], m["layers"]) for m in info["members"])}
            leaving = ring_peers[1]
            epoch = info["epoch"]
            warm = (swarm.held[slow].start, swarm.held[slow].end)  # its hot-standby slice, Ready by now
            scopes[[n.host.peer_id for n in nodes].index(leaving)].cancel()
            with trio.fail_after(30):
                while swarm.ring is None or swarm.ring.epoch == epoch:
                    await swarm.wait_change(epoch, 1.0)
                    await swarm.wait_ring()
            after = {p: (r.start, r.end) for p, r in swarm.ring.stages}
            assert set(after) == set(before) - {leaving} | {slow}, (before, after)
            # Re-selection saw what every node held (survivors their slices, the standby its
            # warm one): each move is exactly the layers its node lacked.
            held = {**before, slow: warm}
            moved = {m.peer: m.missing_layers for m in swarm.plan.moves}
            for peer, (a, b) in after.items():
                overlap = max(0, min(b, held[peer][1]) - max(a, held[peer][0]))
                assert moved.get(peer, 0) == (b - a) - overlap, (peer, held, after, swarm.plan.moves)
            assert moved, "nobody else held the departed slice, so someone must fetch it"
            # Still the same model: greedy output is unchanged on the repaired ring.
            assert await generate_greedy(engine, [1, 40, 41, 42, 43], 6) == out

    trio.run(main)
