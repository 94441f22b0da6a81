"""Per-hop transfer times on a real ring whose senders each add a different, known one-way
latency (shard.linkemu): the three nodes 4, 24 and 44 ms, the coordinator 64 ms.

Guards that each hop's figure (coordinator.gateway.hop_times, from the stages' clock stamps
in Forward.clock_s) is that hop's own: the emulation delays what a sender sends, so hop i
must read its sender's latency plus loopback and framing, never a neighbour's and never a
stage's compute. Sound because any two senders' latencies differ by at least 20 ms while the
tolerance is 15 ms, so a figure attributed to another hop or missing its latency fails; all
the processes share one clock, so the stamps carry no clock offset.

The second test runs the same ring with the first node's clock (its `wall_clock`, what it
stamps frames and Pongs with) set 7 s ahead, as another machine's may be: the hops into and
out of it would read +7 s and -7 s uncorrected; corrected by the coordinator's Ping/Pong
estimate (coordinator.swarm.clock_offset) they must read their senders' latencies again.
"""

from __future__ import annotations

import os
import time

import trio
from transformers import AutoTokenizer

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.gateway.metrics import GatewayMetrics
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.clock_offset import Estimate
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.transport import open_host
from tests.e2e.ringkit import generate_greedy, memory_for_stages

COORDINATOR_MS = 64.0
NODE_MS = (4.0, 24.0, 44.0)
# Loopback, framing, decode and the receiver's inbox on top of the emulated latency, on a
# machine whose two cores run other tests too (observed: 1-4 ms).
SLACK_MS = 15.0


# The 4 ms node's clock in the second test: its offset estimate's bound is half its quickest
# of 3 round trips (2 ms: the emulated 4 ms are all on its way back, plus the loaded
# machine's scheduling: 4-9 ms observed), inside the tolerance.
SKEW_S = 7.0


async def _node(store, coordinator_addr: str, latency_ms: float, peers: dict, skew_s: float,
                task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(keypair_from_seed(os.urandom(32)), "/ip4/127.0.0.1/tcp/0") as host:
        peers[host.peer_id] = latency_ms
        node = Node(NodeConfig(coordinator=coordinator_addr, model=store.manifest.name, link_latency_ms=latency_ms,
                               max_memory_bytes=memory_for_stages(store, len(NODE_MS))), host, store,
                    wall_clock=lambda: time.time() + skew_s)
        async with trio.open_nursery() as nursery:
            await nursery.start(node.serve)
            task_status.started()


def _run_ring(store, skews_s: tuple[float, ...]):
    """A 3-stage ring (node i: NODE_MS[i] latency, clock skews_s[i] ahead) that generates 12
    greedy tokens once every node's clock has been measured; /v1/ring's info after."""
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=len(NODE_MS), receipts=ReceiptConfig(enabled=False),
                         engine=EngineConfig(draft="none", link_latency_ms=COORDINATOR_MS))

    async def main():
        metrics, peers = GatewayMetrics(), {}
        with trio.fail_after(180):
            async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32)),
                                        observer=metrics) as coordinator:
                for latency_ms, skew_s in zip(NODE_MS, skews_s):
                    await coordinator.nursery.start(_node, store, coordinator.addr, latency_ms, peers, skew_s)
                swarm = coordinator.swarm
                while (swarm.ring is None or len(swarm.ring.stages) < len(NODE_MS)
                       or any((swarm.clocks.get(p) or Estimate(0, 0, 0)).samples < 3 for p in peers)):
                    await trio.sleep(0.05)  # the ring forms, and three clock Pings (every 2 s) come back
                metrics.set_sources(coordinator.engine.info, dict, clock_offsets=coordinator.engine.clock_offsets_s)
                prompt = tokenizer("the ring of stages", add_special_tokens=False)["input_ids"]
                await generate_greedy(coordinator.engine, prompt, 12)
                return metrics.ring_info(), peers, metrics

    return trio.run(main)


def test_each_hop_reads_its_own_senders_latency(tiny_llama_store):
    info, peers, metrics = _run_ring(tiny_llama_store, (0.0,) * len(NODE_MS))
    # One clock for all: no correction is applied (a midpoint would add each link's
    # asymmetry, up to 22 ms here, to stamps that carry no error).
    assert [c["applied_s"] for c in info["topology"]["clocks"].values()] == [0.0] * len(NODE_MS)
    hops = info["topology"]["plan"]["hops"]
    senders = [m["peer_id"] for m in info["members"]]
    assert [h["dst"] for h in hops[:-1]] == senders and len(hops) == len(NODE_MS) + 1
    expected_ms = [COORDINATOR_MS] + [peers[p] for p in senders]  # hop i: its sender's emulated latency
    decode_ms = [h["measured"]["transfer_s"]["decode"] * 1e3 for h in hops]
    prefill_ms = [h["measured"]["transfer_s"]["prefill"] * 1e3 for h in hops]
    assert all(w <= g < w + SLACK_MS for g, w in zip(decode_ms, expected_ms)), (decode_ms, expected_ms)
    # One prefill frame, the epoch's first: it may also carry the opening of each stream.
    assert all(w <= g for g, w in zip(prefill_ms, expected_ms)), (prefill_ms, expected_ms)
    assert all(h["measured"]["frames"]["decode"] >= 10 for h in hops)
    # The histogram moved for every hop, and what it holds is the same measurement.
    for i, want in enumerate(expected_ms):
        count = metrics.registry.get_sample_value("shard_hop_transfer_seconds_count", {"hop": str(i), "phase": "decode"})
        total = metrics.registry.get_sample_value("shard_hop_transfer_seconds_sum", {"hop": str(i), "phase": "decode"})
        assert count >= 10 and want <= total / count * 1e3 < want + SLACK_MS, (i, count, total)
    # The hops exclude every stage's own time: with the stages' compute they stay within
    # the traversal the engine measured (which also holds queueing and the coordinator's
    # own encode and decode).
    decode = info["topology"]["measured"]["decode"]
    assert sum(decode_ms) + sum(s * 1e3 for s in decode["measured_stage_compute_s"]) < decode["measured_traversal_s"] * 1e3


def test_a_node_whose_clock_is_seconds_ahead_still_reads_the_emulated_latencies(tiny_llama_store):
    # Bug guarded: hop times across machines carrying the difference of their clocks (here
    # +7 s into the skewed node and -7 s out of it), or a correction applied to the wrong
    # stage. Sound: uncorrected, hops 0 and 1 miss their window by seconds; the correction
    # is off by at most the skewed node's stated bound (rtt/2), added to the tolerance of the
    # two hops it ends, and the unskewed nodes must get no correction at all.
    info, peers, metrics = _run_ring(tiny_llama_store, (SKEW_S, 0.0, 0.0))
    hops = info["topology"]["plan"]["hops"]
    senders = [m["peer_id"] for m in info["members"]]
    clocks = info["topology"]["clocks"]
    skewed = next(p for p in peers if peers[p] == NODE_MS[0])
    bound_s = clocks[skewed]["uncertainty_s"]
    assert abs(clocks[skewed]["applied_s"] - SKEW_S) <= bound_s < 0.020, clocks[skewed]
    assert all(clocks[p]["applied_s"] == 0.0 for p in peers if p != skewed), clocks
    # The gauge shows the same estimate.
    assert metrics.registry.get_sample_value("shard_node_clock_offset_seconds", {"peer": skewed}) == (
        clocks[skewed]["offset_s"])
    expected_ms = [COORDINATOR_MS] + [peers[p] for p in senders]
    decode_ms = [h["measured"]["transfer_s"]["decode"] * 1e3 for h in hops]
    ends = [(None, senders[0]), *zip(senders, [*senders[1:], None])]  # each hop's (sender, receiver)
    extra_ms = [bound_s * 1e3 * sum(p == skewed for p in end) for end in ends]
    assert all(w - x <= g < w + SLACK_MS + x for g, w, x in zip(decode_ms, expected_ms, extra_ms)), (
        decode_ms, expected_ms, extra_ms)
