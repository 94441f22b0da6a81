"""What the ring benchmarks share: an instrumented in-process ring, link conditions, and
the conditions block every result carries.

`open_bench_ring` assembles what `shard-coord serve --local-nodes N` runs (swarm, ring
engine with receipts checked, N real Nodes, each a libp2p host on loopback with its own
key and link emulation), all in one trio run, and attaches a `FrameProbe`: it timestamps
every frame where it enters and leaves each stage and the coordinator, and counts the
bytes on every ring edge. The probe wraps bound methods of the engine, its jobs and the
nodes (`open_job` and each job's `_send`, `_deliver`, `logits`, `_handle`, each stage
worker's `process_frame`, hosts' `open_stream`); it changes no behaviour, only observes.
It does not know what a benchmark measures or reports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import torch
import trio

from coordinator.trust.receipt_check import ReceiptChecker
from coordinator.jobs.ring_engine import EngineConfig, RingEngine
from coordinator.swarm.swarm import REPORT_BUFFER, Swarm, SwarmConfig
from coordinator.swarm.topology import TopologyConfig
from shard.identity import keypair_from_seed
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig
from shard.transport import open_host
from shard.wire.dtypes import from_cli_name
from shard.wire.messages import Forward, Result

# The activation dtypes the ring benchmarks compare, as flags name them -> wire name.
WIRE_DTYPES = {cli: from_cli_name(cli) for cli in ("f32", "bf16", "fp8")}


@dataclass(frozen=True)
class LinkSpec:
    """Emulated conditions on every ring edge (coordinator -> head, stage -> stage, tail ->
    coordinator). Zeros mean loopback as is."""

    one_way_latency_ms: float = 0.0
    upload_mbps: float = 0.0  # per sender; 0 = unlimited

    @property
    def upload_bytes_per_s(self) -> float:
        return self.upload_mbps * 1e6 / 8 if self.upload_mbps else float("inf")

    def describe(self) -> str:
        if not (self.one_way_latency_ms or self.upload_mbps):
            return "loopback, no emulation"
        return f"{self.one_way_latency_ms:g} ms one-way per hop, {self.upload_mbps:g} Mbit/s uplinks"


class _CountingStream:
    """A frame endpoint that counts what it sends; everything else goes to the inner one."""

    def __init__(self, inner, sizes: Callable[[], list[int]]) -> None:
        self._inner, self._sizes = inner, sizes

    async def send_frame(self, body: bytes) -> None:
        self._sizes().append(len(body) + 4)  # + the u32 length prefix
        await self._inner.send_frame(body)


def _count_ring_streams(host, sizes: Callable[[], list[int]]) -> None:
    """Count the bytes of every ring-protocol stream `host` opens (control streams and
    probes are not ring traffic). Below link emulation, so each frame counts once."""
    open_stream = host.open_stream

    async def counted(peer: str, protocol_id: str):
        stream = await open_stream(peer, protocol_id)
        return _CountingStream(stream, sizes) if protocol_id == RING_PROTOCOL else stream

    host.open_stream = counted

    def __getattr__(self, name):
        return getattr(self._inner, name)


@dataclass
class FrameProbe:
    """Per (job, round): when the coordinator started sending it, when each stage got it and
    started sending its output, when the tail's Result arrived, and each stage's compute_s.
    Edge e carries frames into stage e (e = 0: coordinator -> head); edge N: tail -> coord."""

    stages: int
    sent_s: dict[tuple[str, int], float] = field(default_factory=dict)
    stage_in_s: dict[tuple[str, int], dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    stage_out_s: dict[tuple[str, int], dict[int, float]] = field(default_factory=lambda: defaultdict(dict))
    arrived_s: dict[tuple[str, int], float] = field(default_factory=dict)
    compute_s: dict[tuple[str, int], tuple[float, ...]] = field(default_factory=dict)
    tokens: dict[tuple[str, int], int] = field(default_factory=dict)  # frame length T
    logits_s: list[float] = field(default_factory=list)
    frame_sizes: dict[int, list[int]] = field(default_factory=dict)  # edge -> bytes of each frame sent

    def edge_sizes(self, edge: int) -> list[int]:
        return self.frame_sizes.setdefault(edge, [])

    def total_bytes(self) -> int:
        return sum(sum(s) for s in self.frame_sizes.values())

    def hops(self, job_id: str) -> list[dict]:
        """One row per complete frame of `job_id`: T, traversal, per-edge transport and
        per-stage time (in the stage, incl. thread hand-off and signing) and compute_s."""
        rows = []
        for key, sent in self.sent_s.items():
            if key[0] != job_id or key not in self.arrived_s or len(self.stage_in_s[key]) != self.stages:
                continue
            ins, outs = self.stage_in_s[key], self.stage_out_s[key]
            marks_out = [sent] + [outs[i] for i in range(self.stages)]
            marks_in = [ins[i] for i in range(self.stages)] + [self.arrived_s[key]]
            rows.append({
                "round": key[1], "tokens": self.tokens[key], "traversal_s": self.arrived_s[key] - sent,
                "transport_s": [b - a for a, b in zip(marks_out, marks_in)],
                "in_stage_s": [outs[i] - ins[i] for i in range(self.stages)],
                "compute_s": list(self.compute_s.get(key, ())),
            })
        return sorted(rows, key=lambda r: r["round"])


def _instrument_engine(engine: RingEngine, probe: FrameProbe) -> None:
    open_job, deliver, logits = engine.open_job, engine._deliver, engine.head.logits

    async def timed_open_job(*args, **kwargs):
        job = await open_job(*args, **kwargs)
        send = job._send

        async def timed_send(ring, fwd: Forward) -> int:
            key = (job.job_id, job.round + 1)  # the round _send gives it
            probe.sent_s[key] = time.perf_counter()
            probe.tokens[key] = int(fwd.positions.shape[0])
            return await send(ring, fwd)

        job._send = timed_send
        return job

    def timed_deliver(msg):
        result = getattr(msg, "result", msg)  # a Result arrives wrapped with its digest
        if isinstance(result, Result):
            key = (result.job_id, result.round)
            probe.arrived_s[key] = time.perf_counter()
            probe.compute_s[key] = tuple(result.compute_s)
        deliver(msg)

    def timed_logits(hidden):
        t0 = time.perf_counter()
        out = logits(hidden)
        probe.logits_s.append(time.perf_counter() - t0)
        return out

    engine.open_job, engine._deliver, engine.head.logits = timed_open_job, timed_deliver, timed_logits
    _count_ring_streams(engine.host, lambda: probe.edge_sizes(0))  # job errors reach timed_deliver via serve()


def _instrument_node(node: Node, probe: FrameProbe, index_of: Callable[[str], int]) -> None:
    handle = node._handle
    peer = node.host.peer_id

    def time_worker(worker) -> None:
        """Stamp when the worker's output (encoded and signed) is ready to send."""
        process_frame = worker.process_frame

        def timed_process_frame(fwd: Forward, *args):
            out = process_frame(fwd, *args)
            probe.stage_out_s[(fwd.job_id, fwd.round)][index_of(peer)] = time.perf_counter()
            return out

        timed_process_frame.__wrapped_by_probe__ = True
        worker.process_frame = timed_process_frame

    async def timed_handle(state, msg, *args):
        if isinstance(msg, Forward):
            probe.stage_in_s[(msg.job_id, msg.round)][index_of(peer)] = time.perf_counter()
            if not hasattr(state.worker.process_frame, "__wrapped_by_probe__"):
                time_worker(state.worker)
        await handle(state, msg, *args)

    node._handle = timed_handle
    _count_ring_streams(node.host, lambda: probe.edge_sizes(index_of(peer) + 1))


@dataclass
class BenchRing:
    engine: RingEngine
    probe: FrameProbe
    stages: int
    link: LinkSpec
    wire_dtype: str
    layer_ranges: list[tuple[int, int]]

    def set_prefill_chunk(self, tokens: int, edge_tokens: int = EngineConfig.prefill_edge_chunk_tokens) -> None:
        """The engine reads its config per round; a frozen replacement changes the chunk
        plan (largest and first/last chunk, coordinator.jobs.prefill) for the next job without
        re-forming the ring."""
        self.engine.config = dataclasses.replace(self.engine.config, prefill_chunk_tokens=tokens,
                                                 prefill_edge_chunk_tokens=edge_tokens)


@contextlib.asynccontextmanager
async def open_bench_ring(store, tokenizer, stages: int, link: LinkSpec, wire_dtype: str = "f32",
                          engine_config: EngineConfig = EngineConfig()) -> AsyncIterator[BenchRing]:
    """An instrumented ring of `stages` real nodes; receipts signed by every stage and
    checked by the coordinator (as `shard-coord serve` does; audits off)."""
    engine_config = dataclasses.replace(engine_config, link_latency_ms=link.one_way_latency_ms,
                                        link_upload_mbps=link.upload_mbps)
    seed = os.urandom(32)
    hidden, _, aux = wire_dtype.partition("@")  # "bf16@fp8": hidden states bf16, EAGLE aux features fp8
    wire = WIRE_DTYPES.get(hidden, hidden)
    aux_dtype = WIRE_DTYPES.get(aux, aux) if aux else None
    # Every node a stage: a benchmark of an N-stage ring wants N, while ring.select_ring
    # rightly prefers fewer hops on loopback.
    job_errors_in, job_errors = trio.open_memory_channel(REPORT_BUFFER)
    ring_changes_in, ring_changes = trio.open_memory_channel(REPORT_BUFFER)
    swarm = Swarm(store, seed, SwarmConfig(min_nodes=stages, wire_dtype=wire, aux_dtype=aux_dtype, planner="all_nodes",
                                           topology=TopologyConfig(coordinator_link_latency_s=link.one_way_latency_ms / 1e3)),
                  job_errors=job_errors_in, ring_changes=ring_changes_in)
    probe = FrameProbe(stages)
    async with contextlib.AsyncExitStack() as stack:
        host = await stack.enter_async_context(open_host(keypair_from_seed(seed)))
        engine = RingEngine(swarm, host, tokenizer, engine_config, receipts=ReceiptChecker(store, seed),
                            job_errors=job_errors, ring_changes=ring_changes)
        _instrument_engine(engine, probe)
        host.set_handler(CONTROL_PROTOCOL, swarm.handle_control)
        host.set_handler(RING_PROTOCOL, engine.handle_ring_stream)
        seeds = [os.urandom(32) for _ in range(stages)]
        node_hosts = [await stack.enter_async_context(open_host(keypair_from_seed(s))) for s in seeds]

        def index_of(peer: str) -> int:
            """Position of `peer` in the current ring (it may re-form, e.g. after link probes)."""
            ring = swarm.ring
            order = [p for p, _ in ring.stages] if ring is not None else []
            return order.index(peer) if peer in order else -1
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.serve_formation)
            await nursery.start(engine.serve)
            for s, node_host in zip(seeds, node_hosts):
                node = Node(NodeConfig(coordinator=host.addrs[0], model=store.manifest.name,
                                       link_latency_ms=link.one_way_latency_ms, link_upload_mbps=link.upload_mbps),
                            node_host, store, signing_seed=s)
                _instrument_node(node, probe, index_of)
                # One at a time: each node measures its compute speed (which sets the
                # layer split) alone, as it would on its own machine; started together
                # they would share these 2 cores at random and split the layers unevenly.
                await nursery.start(node.serve)
            with trio.fail_after(300):
                ring = await swarm.wait_ring()
            # Every figure is over the ring actually formed.
            probe.stages = len(ring.stages)
            if probe.stages != stages:
                print(f"warning: {stages} nodes formed a {probe.stages}-stage ring", file=sys.stderr)
            try:
                yield BenchRing(engine, probe, probe.stages, link, wire_dtype, [(r.start, r.end) for _, r in ring.stages])
            finally:  # the nodes serve forever: stop them however the body ended
                nursery.cancel_scope.cancel()


def median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def git_revision() -> str:
    def run(*args: str) -> str:
        return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()

    return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")


def base_conditions(store) -> dict:
    """Facts every result carries; the benchmark adds its own (stages, links, lengths...)."""
    return {
        "model": store.manifest.name, "manifest_digest": store.digest[:16], "num_layers": store.num_layers,
        "compute_dtype": "float32", "device": "cpu", "git_revision": git_revision(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "cpus": os.cpu_count(), "load_avg_1_5_15_at_start": list(os.getloadavg()),
        "receipts": "signed by every stage, checked by the coordinator; audits off",
        "process": "one process: coordinator and every node in one trio run, nodes' compute in worker threads",
    }
