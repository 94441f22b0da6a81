"""Stages drop a finished job's logged frames once no audit needs them, on a real ring.

Guards issue 21's "memory is bounded under load" for frame logs: each stage kept every
frame of every job for grace_s (300 s) after its end, so a 5-minute load run only filled
its logs. On an in-process ring (coordinator swarm + engine + auditor, three Nodes over
libp2p on loopback, the tiny llama, receipts on) the coordinator's ReleaseFrames must empty
every stage's log soon after the jobs end, and at audit rate 1 the audits must still all
pass (a stage that dropped a job's frames before its audit would be accused of missing
records: so passing audits show the audited frames were kept until fetched). Only the
coordinator may release: the same message from the stage's ring predecessor, or from a
stranger, leaves the frames where they were.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random

import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.frame_release import FLUSH_S
from shard.errors import TransportError
from shard.identity import keypair_from_seed
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig
from shard.transport import open_host
from shard.wire.codec import encode
from shard.wire.release_frames import ReleaseFrames
from tests.e2e.test_stalling_stage import _serve_host, _tokenizer

PROMPT = [1, 3 + ord("h"), 3 + ord("i"), 3 + ord("!"), 5, 9, 17]
TOKENS = 8


async def _run(store, rate: float, body, engine: EngineConfig = EngineConfig(draft="none")):
    """Start a 3-stage ring auditing at `rate` (the engine as `engine`, no probation) and run
    `body(coordinator, nodes)`."""
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=dataclasses.replace(engine, frame_timeout_s=10, probation_rounds=0),
                         audit=AuditConfig(rate=rate, reply_timeout_s=10))
    with trio.fail_after(90):
        async with open_coordinator(config, store, _tokenizer(), keypair_from_seed(os.urandom(32)),
                                    audit_rng=random.Random(0)) as coordinator:
            nodes = []
            for _ in range(3):
                seed = os.urandom(32)
                host = await coordinator.nursery.start(_serve_host, seed)
                node = Node(NodeConfig(coordinator=coordinator.addr), host, store, signing_seed=seed)
                await coordinator.nursery.start(node.serve)
                nodes.append(node)
            swarm = coordinator.swarm
            while swarm.ring is None or len(swarm.ring.stages) < 3:
                await swarm.wait_ring()
            return await body(coordinator, nodes)


async def _generate(engine, *, close: bool = True):
    job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
    got = []
    async for block in job.next_tokens():
        got += block
        if len(got) >= TOKENS:
            break
    if close:
        await job.aclose()
    return job, got


async def _until_empty(nodes) -> float:
    """Seconds until every stage's frame log holds nothing (polled; fails after 15 s)."""
    start = trio.current_time()
    with trio.fail_after(15):
        while any(n.frame_log.nbytes for n in nodes):
            await trio.sleep(0.05)
    return trio.current_time() - start


def test_audited_frames_are_kept_until_their_audit_then_every_log_empties(tiny_llama_store):
    async def body(coordinator, nodes):
        for _ in range(2):
            _, got = await _generate(coordinator.engine)
            assert len(got) == TOKENS
        await coordinator.auditor.wait_idle()
        return await _until_empty(nodes), coordinator.auditor

    _, auditor = trio.run(_run, tiny_llama_store, 1.0, body)
    # Every (job, stage) was audited and passed: none was released before its frames were fetched.
    assert auditor.stats.audits == 2 * 3 and auditor.stats.frames_compared >= 2 * 3 * TOKENS
    assert auditor.evidence == [] and auditor.swarm.faulty == {}
    assert auditor.releaser.sent == 2 * 3 and auditor.releaser.dropped == 0


def test_unaudited_jobs_leave_the_logs_within_a_flush(tiny_llama_store):
    async def body(coordinator, nodes):
        job, _ = await _generate(coordinator.engine, close=False)
        held = [n.frame_log.nbytes for n in nodes]
        await job.aclose()
        return held, await _until_empty(nodes), coordinator.auditor

    held, waited_s, auditor = trio.run(_run, tiny_llama_store, 0.0, body)
    assert all(held)  # every stage had logged the running job's frames
    assert waited_s < FLUSH_S + 2.0 and auditor.stats.audits == 0  # not grace_s (300 s)


def test_only_the_coordinator_can_release(tiny_llama_store, caplog):
    caplog.set_level(logging.INFO, logger="shard.node")

    async def body(coordinator, nodes):
        job, _ = await _generate(coordinator.engine, close=False)  # running: its frames are logged
        ring = coordinator.swarm.ring
        (pred, _), (target_id, _) = ring.stages[0], ring.stages[1]
        target = next(n for n in nodes if n.host.peer_id == target_id)
        predecessor = next(n for n in nodes if n.host.peer_id == pred)
        held = target.frame_log.nbytes
        release = encode(ReleaseFrames(job_ids=[job.job_id], epochs=[ring.epoch]))
        stream = await predecessor.host.open_stream(target_id, RING_PROTOCOL)  # its ring stream: allowed to send frames
        await stream.send_frame(release)
        async with open_host(keypair_from_seed(os.urandom(32)), "/ip4/127.0.0.1/tcp/0") as stranger:
            await stranger.connect(target.host.addrs[0])
            try:
                await stranger.open_stream(target_id, CONTROL_PROTOCOL)  # nodes serve no control stream
                control_opened = True
            except TransportError:
                control_opened = False
            try:
                strange = await stranger.open_stream(target_id, RING_PROTOCOL)
                await strange.send_frame(release)
            except TransportError:
                pass  # refused at once
            with trio.fail_after(10):  # both refusals logged by the target
                while _refusals(caplog) != set(REFUSALS):
                    await trio.sleep(0.05)
            kept = target.frame_log.nbytes
        await job.aclose()
        return held, kept, control_opened, await _until_empty(nodes)

    held, kept, control_opened, _ = trio.run(_run, tiny_llama_store, 0.0, body)
    assert held > 0 and kept == held and not control_opened


# What the target logs for each refusal: the predecessor's message on its ring stream is
# decoded and ignored (no ring message releases), the stranger's stream is refused outright.
REFUSALS = ("ignoring ReleaseFrames on a ring stream", "refused a ring stream from")


def _refusals(caplog) -> set[str]:
    return {p for r in caplog.records for p in REFUSALS if r.getMessage().startswith(p)}
