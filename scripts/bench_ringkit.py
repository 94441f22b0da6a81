"""What the ring benchmarks share: an observed in-process ring, link conditions, and the
conditions block every result carries.

`open_bench_ring` runs what `shard-coord serve --local-nodes N` runs (open_coordinator:
swarm, ring engine with receipts checked; N real Nodes, each a libp2p host on loopback with
its own key and link emulation), all in one trio run, with a `FrameProbe` passed to the
engine and every node as their RingObserver (shard.ring_observer): it timestamps every
frame where it enters and leaves each stage and the coordinator, and counts the bytes
every sender puts on its ring edge. It changes no behaviour, only observes. A node
process's RSS by mapping and its CPU use over a window come from /proc.
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

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.jobs.ring_engine import RingEngine
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.audit import AuditConfig
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.ring_observer import RingObserver
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


@dataclass
class FrameProbe(RingObserver):
    """Per (job, round): when the coordinator started sending it, when each stage got it and
    started sending its output, when the tail's Result arrived, and each stage's compute_s.
    Edge e carries frames into stage e (e = 0: coordinator -> head); edge N: tail -> coord."""

    stages: int
    coordinator_id: str = ""
    # A stage's position in the current ring, -1 if none (the ring may re-form, e.g. after probes).
    stage_index: Callable[[str], int] = lambda peer: -1
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

    # -- RingObserver ----------------------------------------------------------------------
    def frame_sent(self, sender: str, nbytes: int) -> None:
        edge = 0 if sender == self.coordinator_id else self.stage_index(sender) + 1
        self.edge_sizes(edge).append(nbytes)

    def round_sent(self, fwd: Forward) -> None:
        key = (fwd.job_id, fwd.round)
        self.sent_s[key] = time.perf_counter()
        self.tokens[key] = int(fwd.positions.shape[0])

    def stage_received(self, stage: str, fwd: Forward) -> None:
        self.stage_in_s[(fwd.job_id, fwd.round)][self.stage_index(stage)] = time.perf_counter()

    def stage_computed(self, stage: str, fwd: Forward) -> None:
        self.stage_out_s[(fwd.job_id, fwd.round)][self.stage_index(stage)] = time.perf_counter()

    def result_arrived(self, result: Result) -> None:
        key = (result.job_id, result.round)
        self.arrived_s[key] = time.perf_counter()
        self.compute_s[key] = tuple(result.compute_s)

    def logits_computed(self, seconds: float) -> None:
        self.logits_s.append(seconds)

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
    """An observed ring of `stages` real nodes; receipts signed by every stage and checked
    by the coordinator (as `shard-coord serve` does; audits off)."""
    engine_config = dataclasses.replace(engine_config, link_latency_ms=link.one_way_latency_ms,
                                        link_upload_mbps=link.upload_mbps)
    hidden, _, aux = wire_dtype.partition("@")  # "bf16@fp8": hidden states bf16, EAGLE aux features fp8
    wire = WIRE_DTYPES.get(hidden, hidden)
    aux_dtype = WIRE_DTYPES.get(aux, aux) if aux else None
    # Every node a stage: a benchmark of an N-stage ring wants N, while ring.select_ring
    # rightly prefers fewer hops on loopback.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=stages, swarm=SwarmConfig(wire_dtype=wire, aux_dtype=aux_dtype, planner="all_nodes"),
                         engine=engine_config, audit=AuditConfig(rate=0.0))
    probe = FrameProbe(stages)
    async with contextlib.AsyncExitStack() as stack:
        # Node hosts first: they close after the coordinator has stopped the nodes.
        seeds = [os.urandom(32) for _ in range(stages)]
        node_hosts = [await stack.enter_async_context(open_host(keypair_from_seed(s))) for s in seeds]
        coordinator = await stack.enter_async_context(
            open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32)), observer=probe))
        swarm = coordinator.swarm

        def index_of(peer: str) -> int:
            """Position of `peer` in the current ring (it may re-form, e.g. after link probes)."""
            ring = swarm.ring
            order = [p for p, _ in ring.stages] if ring is not None else []
            return order.index(peer) if peer in order else -1

        probe.coordinator_id, probe.stage_index = coordinator.host.peer_id, index_of
        for s, node_host in zip(seeds, node_hosts):
            node = Node(NodeConfig(coordinator=coordinator.addr, model=store.manifest.name,
                                   link_latency_ms=link.one_way_latency_ms, link_upload_mbps=link.upload_mbps),
                        node_host, store, signing_seed=s, observer=probe)
            # One at a time: each node measures its compute speed (which sets the
            # layer split) alone, as it would on its own machine; started together
            # they would share these 2 cores at random and split the layers unevenly.
            await coordinator.nursery.start(node.serve)
        with trio.fail_after(300):
            ring = await swarm.wait_ring()
        # Every figure is over the ring actually formed.
        probe.stages = len(ring.stages)
        if probe.stages != stages:
            print(f"warning: {stages} nodes formed a {probe.stages}-stage ring", file=sys.stderr)
        yield BenchRing(coordinator.engine, probe, probe.stages, link, wire_dtype, [(r.start, r.end) for _, r in ring.stages])


def median(xs) -> float | None:
    xs = list(xs)
    return statistics.median(xs) if xs else None


def git_revision(here: str = os.path.dirname(os.path.abspath(__file__))) -> str:
    """The commit of the checkout holding `here` (+dirty with uncommitted changes); in a
    `git archive` snapshot, which has no .git, the commit it was made from (`here`'s
    revision.txt, filled in by the archive: .gitattributes export-subst); "" when neither says."""
    def run(*args: str) -> str:
        return subprocess.run(["git", "-C", here, *args], capture_output=True, text=True).stdout.strip()

    if rev := run("rev-parse", "--short", "HEAD"):
        return rev + ("+dirty" if run("status", "--porcelain", "--untracked-files=no") else "")
    try:
        with open(os.path.join(here, "revision.txt")) as f:
            archived = f.read().strip()
    except OSError:
        return ""
    return "" if archived.startswith("$Format") else archived


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


def rss_by_mapping_mb(pid: int) -> dict[str, float]:
    """A process's RSS split by what holds it (/proc/PID/smaps): [heap] (glibc's main
    arena), anonymous mappings starting on a 64 MiB boundary (glibc's thread arenas),
    1 MiB ones (CPython's object arenas), other anonymous ones (big blocks, stacks), the
    stages' K/V memory files (shard.kvcache, `/memfd:shard-kv`) and other files."""
    kinds = {"heap": 0, "thread_arenas": 0, "py_arenas": 0, "anon": 0, "kv": 0, "file": 0}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's header line
                name = head[5] if len(head) > 5 else ""
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                kind = ("heap" if name == "[heap]" else "kv" if name.startswith("/memfd:shard-kv") else
                        "file" if name.startswith("/") else "anon" if name else
                        "thread_arenas" if lo % (64 << 20) == 0 else "py_arenas" if hi - lo == 1 << 20 else "anon")
            elif head[0] == "Rss:":
                kinds[kind] += int(head[1])
    return {k: round(v / 1024, 1) for k, v in kinds.items()}


async def cpu_s_over(pid: int, window_s: float) -> float:
    """CPU seconds process `pid` used over the next `window_s` (/proc/PID/stat utime + stime)."""
    def cpu_s() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    start = cpu_s()
    await trio.sleep(window_s)
    return cpu_s() - start
