"""`open_coordinator`: the one place a coordinator is put together: its libp2p host, swarm,
receipt checker, auditor and ring engine, the channels between them, and their serve tasks.

`shard-coord serve` (coordinator.server) adds the HTTP API and local nodes on top; the
end-to-end tests and the ring benchmarks add in-process nodes. What a benchmark watches it
passes in as a RingObserver (shard.ring_observer) instead of patching methods.
Does not load models, read flags or speak HTTP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio
from libp2p.crypto.keys import KeyPair

from coordinator.config import CoordConfig
from coordinator.gateway.api import ApiConfig
from coordinator.jobs.ring_engine import RingEngine
from coordinator.swarm.seeding import Seeding
from coordinator.swarm.swarm import REPORT_BUFFER, Swarm
from coordinator.trust import probation
from coordinator.trust.audit import Auditor
from coordinator.trust.frame_release import FrameReleaser
from coordinator.trust.receipt_check import ReceiptChecker
from coordinator.trust.round_verifier import RoundVerifier
from shard.addresses import refuse_if_in_use
from shard.identity import identity_signing_key
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL
from shard.ring_observer import NO_OBSERVER, RingObserver
from shard.stage_worker import WorkerConfig
from shard.store import ModelStore
from shard.transport import Host, open_host
from shard.weight_fetch import SOURCES_PROTOCOL
from shard.weight_server import WEIGHTS_PROTOCOL
from shard.wire.limits import MAX_OPEN_JOBS


@dataclass(frozen=True)
class Coordinator:
    """A running coordinator. `nursery` holds its serve tasks; more (HTTP, nodes) may be
    started there, and all are cancelled when open_coordinator's block ends."""

    config: CoordConfig  # as assembled: derived values filled in
    host: Host
    addr: str  # the multiaddr nodes join (…/p2p/<peer id>)
    swarm: Swarm
    engine: RingEngine
    receipts: ReceiptChecker | None  # None: receipts off
    auditor: Auditor | None  # None: receipts off (with them on, AuditConfig.rate 0 audits nothing)
    nursery: trio.Nursery


def assembled(config: CoordConfig) -> CoordConfig:
    """`config` with the values one component takes from another filled in: the swarm's
    first-ring size, the topology's prefill chunk and coordinator link latency (the
    engine's own), the open-jobs cap every Assignment carries (the gateway's), and with
    --local-nodes one stage per node (planner "all_nodes"): on loopback the selector
    rightly seats every layer on one node, and a newcomer would never see the pipeline
    (--local-selector-split keeps the selector's choice)."""
    swarm, engine = config.swarm, config.engine
    topology = dataclasses.replace(swarm.topology, prefill_chunk_tokens=engine.prefill_chunk_tokens,
                                   coordinator_link_latency_s=engine.link_latency_ms / 1e3)
    planner = "all_nodes" if config.local_nodes > 1 and not config.local_selector_split else swarm.planner
    return dataclasses.replace(config, swarm=dataclasses.replace(
        swarm, min_nodes=config.first_ring_nodes, topology=topology, planner=planner,
        max_open_jobs=swarm.max_open_jobs or open_jobs_per_stage(config.api)))


def open_jobs_per_stage(api: ApiConfig) -> int:
    """The jobs a stage must be able to hold K/V for at once (Assignment.max_open_jobs)
    to serve this gateway: one per generation it runs (--max-concurrent-jobs counts each
    choice; a queued request holds nothing on the ring), and as many again for jobs that
    ended or failed elsewhere while their K/V here waits for the EndJob or the idle
    timeout; never below a node's own default (WorkerConfig.max_open_jobs, 128), which
    in-process benchmarks driving the engine past the gateway rely on, nor above what
    the wire carries (MAX_OPEN_JOBS)."""
    return min(MAX_OPEN_JOBS, max(WorkerConfig.max_open_jobs, 2 * api.max_concurrent_jobs))


@contextlib.asynccontextmanager
async def open_coordinator(config: CoordConfig, store: ModelStore, tokenizer: Any, keypair: KeyPair, *,
                           observer: RingObserver = NO_OBSERVER,
                           audit_rng: random.Random | None = None) -> AsyncIterator[Coordinator]:
    """Assemble a coordinator for `store` on `config.listen` and serve it until the block
    ends. With receipts checked (config.receipts.enabled) finished jobs go to an auditor;
    `audit_rng` picks what it audits (None: unpredictable, as stages must find it).

    Error handling: TransportError if the host cannot listen (or another process already
    listens on its fixed port); NotReadyError if the config's
    drafter needs an EAGLE head there is none of. Resource handling: the host closes and every
    serve task (those started in `nursery` too) is cancelled when the block ends, however
    it ends.
    """
    config = assembled(config)
    seed = identity_signing_key(keypair)
    # What one component reports to another travels on a channel, each read by one serve().
    job_errors_in, job_errors = trio.open_memory_channel(REPORT_BUFFER)
    ring_changes_in, ring_changes = trio.open_memory_channel(REPORT_BUFFER)
    audit_replies_in, audit_replies = trio.open_memory_channel(REPORT_BUFFER)
    finished_in, finished = trio.open_memory_channel(config.audit.max_queued_jobs)
    checked = config.receipts.enabled
    swarm = Swarm(store, seed, config.swarm, job_errors=job_errors_in, ring_changes=ring_changes_in,
                  audit_replies=audit_replies_in if checked else None)
    releaser = FrameReleaser(swarm.send_control)  # stages drop the frames no audit will ask for
    checker = (ReceiptChecker(store, seed, config.receipts, finished=finished_in, unaudited=releaser.release_job)
               if checked else None)
    auditor = (Auditor(swarm, store, seed, config.audit, audit_rng, finished=finished, audit_replies=audit_replies,
                       releaser=releaser) if checked else None)
    refuse_if_in_use(config.listen)
    async with open_host(keypair, config.listen, relay_hop=True) as host:  # relays for nodes behind NATs
        engine = RingEngine(swarm, host, tokenizer, config.engine, receipts=checker, job_errors=job_errors,
                            ring_changes=ring_changes, observer=observer,
                            round_verifier=RoundVerifier(swarm, auditor, checker) if auditor is not None else None)
        if auditor is not None:  # members past the verifier-role nodes: those off probation first
            auditor.on_probation = lambda peer: probation.on_probation(engine.clean_rounds, peer, engine.probation)
            engine.prefixes.pins = releaser  # prefix sources' frames stay until their forks' audits are over
        host.set_handler(CONTROL_PROTOCOL, swarm.handle_control)
        host.set_handler(RING_PROTOCOL, engine.handle_ring_stream)
        seeding = Seeding(swarm, store, seed, config.swarm.churn, swarm.fetches)  # weights from peers
        host.set_handler(SOURCES_PROTOCOL, seeding.handle)
        host.set_handler(WEIGHTS_PROTOCOL, seeding.server.serve)
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.serve_formation)
            await nursery.start(engine.serve)
            if auditor is not None:
                await nursery.start(auditor.serve)
            try:
                yield Coordinator(config, host, host.addrs[0], swarm, engine, checker, auditor, nursery)
            finally:
                nursery.cancel_scope.cancel()
