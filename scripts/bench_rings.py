"""Replica rings: one ring vs two over the same six half-model nodes, in one run (issue 21).

What a user runs: `shard-coord serve --min-nodes 6 --max-rings N` and six `shard-node join`
processes, each limited (--max-memory-bytes) to half the model's layers with their K/V for
the planner's workload, so a ring needs two of them and the pool holds three rings' worth.
With --max-rings 1 one ring serves and four nodes take roles; with --max-rings 2 two rings
form (the first ring keeps its two hot standbys, --ring-spares' default) and each request
is routed to the ring predicting its earliest completion (coordinator.jobs.ring_router).
Every link is the emulated WAN (25 ms one way, 50 Mbit/s uplinks, coordinator and nodes).
Volunteers also bring a machine each, which six processes on this 2-core machine do not:
with --node-cpu C each node process runs in its own cgroup limited to C cores
(scripts/cpu_quota.py; root), the coordinator unconstrained, so a ring is bound by its
nodes' compute as on separate hosts; 0 runs them on the shared cores as they are. Each
--node-cpu value runs one ring then two. Each configuration is warmed up (2 clients a ring,
so every ring has measured rounds before the load: a fresh ring's round deadlines rest on
the nodes' speed probe alone, which does not see a CPU quota), then C closed-loop clients
(16 by default) stream /v1/completions for a ramp and a fixed window, cycling a fixed mix
of short prompts (greedy and seeded sampled, 64 and 128 new tokens; no 2k-token prompts:
a half-model node's K/V budget holds ~8 short jobs, so on one ring half the clients wait
for K/V room: serve runs with --kv-wait-s 120 by default here, the 30 s default would turn
that wait into 429s).

Reported per configuration: rings formed, aggregate tok/s, p50/p95 TTFT and inter-token
gap, errors, whether every finished request equals the same request served alone (once,
on the one-ring pool, first), the most jobs each ring held at once (/v1/ring every 2 s),
the CPU seconds each process used in the window, the share of CFS periods each node was
throttled in (near 1: it wanted more than its quota), and the load average (the cores are
shared); then, per --node-cpu, the ratio of the two rings' tok/s to one ring's.

    python scripts/bench_rings.py --json OUT [--window-s 30 --warmup-s 20 --ramp-s 15] [--clients 16]
                                  [--node-cpu 0.25,0] [--log-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_ringkit import git_revision  # noqa: E402
from scripts.bench_load import cpu_s, rss_mb  # noqa: E402
from scripts.load_clients import alone, closed_loop  # noqa: E402
from scripts.cpu_quota import CpuQuotas, QuotaError, describe, throttling  # noqa: E402
from coordinator.jobs.engine import encode_chat  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from shard.store import ModelStore, default_store_dir, prepare  # noqa: E402
from tests.e2e.ringkit import memory_for_stages  # noqa: E402

BANNER = re.compile(r"serving \S+ at (http://[0-9.]+:\d+)/v1")
JOIN = re.compile(r"shard-node join --coordinator (\S+)")
WAN = ["--link-latency-ms", "25", "--link-upload-mbps", "50"]  # --latency-ms replaces the 25
NODES = 6


def request_mix(tokenizer) -> list[dict]:
    """8 short chat prompts: 64 or 128 new tokens, 1 in 4 seeded sampling."""
    short = [p for _, p in spec_prompts.prompt_set(1)]
    out = []
    for i in range(8):
        body = {"prompt": encode_chat(tokenizer, spec_prompts.messages(short[i % len(short)])),
                "max_tokens": (64, 128)[i % 2], "temperature": 0.0}
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.95, seed=100 + i)
        out.append(body)
    return out


class Pool:
    """A coordinator process and six node processes, each node in its own `node_cpu`-core
    cgroup when given (before it imports anything); all killed and the cgroups removed on close."""

    def __init__(self, store: ModelStore, home: Path, max_rings: int, name: str, wan: list[str] = WAN,
                 node_cpu: float = 0.0, kv_wait_s: float = 30.0) -> None:
        self.log_path, self.procs = home / f"{name}.log", []
        self.quotas = CpuQuotas(node_cpu) if node_cpu else None
        env = {**os.environ, "SHARD_HOME": str(home / f"{name}-home"), "OMP_NUM_THREADS": "1"}
        log = open(self.log_path, "w")
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--model", "smollm2-135m", "--store-dir", str(store.root),
             "--min-nodes", str(NODES), "--max-rings", str(max_rings), "--http", "127.0.0.1:0",
             "--listen", "/ip4/127.0.0.1/tcp/0", "--draft", "none", "--max-concurrent-jobs", "64",
             "--probation-rounds", "0", "--kv-wait-s", f"{kv_wait_s:g}", *wan], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        try:
            addr = self._wait_for(JOIN, 300)
            for i in range(NODES):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "shard.cli", "join", "--coordinator", addr, "--model", "smollm2-135m",
                     "--store-dir", str(store.root), "--key-path", str(home / f"{name}-node{i}.key"),
                     "--max-memory-bytes", str(memory_for_stages(store, 2)), "--torch-threads", "1", *wan],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
                if self.quotas is not None:
                    self.quotas.add(self.procs[-1].pid)
            self.base = self._wait_for(BANNER, 600)
        except BaseException:
            self.close()
            raise

    def _wait_for(self, pattern: re.Pattern, seconds: float) -> str:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            m = pattern.search(self.log_path.read_text(errors="replace"))
            if m:
                return m.group(1)
            if self.procs[0].poll() is not None:
                break
            time.sleep(0.5)
        raise RuntimeError(f"no {pattern.pattern!r}:\n{self.log_path.read_text(errors='replace')[-3000:]}")

    def ring(self) -> dict:
        return httpx.get(f"{self.base}/v1/ring", timeout=30).json()

    def wait_rings(self, count: int, seconds: float = 300) -> dict:
        """/v1/ring once `count` rings are formed and every node has its place."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            info = self.ring()
            if len(info.get("rings", [])) >= count and info["registered_nodes"] == NODES:
                return info
            time.sleep(1)
        raise RuntimeError(f"{count} rings did not form: {json.dumps(self.ring().get('rings'))[:2000]}")

    def rss(self) -> dict:
        return {"coordinator_mb": rss_mb(self.procs[0].pid), "nodes_mb": [rss_mb(p.pid) for p in self.procs[1:]]}

    def cpu(self) -> list[float | None]:
        """CPU seconds used so far: the coordinator's, then each node's."""
        return [cpu_s(p.pid) for p in self.procs]

    def throttle_stats(self) -> list[dict]:
        return self.quotas.stats() if self.quotas is not None else []

    def close(self) -> None:
        try:
            for p in reversed(self.procs):
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(10)
        finally:
            if self.quotas is not None:
                self.quotas.close()


async def _loop_watching_rings(pool: Pool, mix: list[dict], clients: int, window_s: float, refs: list[str],
                               seen: dict[int, int], ramp_s: float = 0.0, at_ramp_end=None) -> dict:
    """closed_loop, while /v1/ring is read every 2 s for the most jobs each ring held."""
    async def watch():
        async with httpx.AsyncClient(base_url=pool.base, timeout=30) as client:
            while True:
                await trio.sleep(2)
                for r in (await client.get("/v1/ring")).json().get("rings", []):
                    seen[r["ring_id"]] = max(seen.get(r["ring_id"], 0), r["jobs"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        result = await closed_loop(pool.base, mix, clients, window_s, refs, ramp_s, at_ramp_end)
        nursery.cancel_scope.cancel()
    return result


def _node_cpus(text: str) -> list[float]:
    try:
        cores = [float(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--node-cpu takes comma-separated cores per node (0: shared), got {text!r}")
    if not cores or any(c < 0 for c in cores):
        raise argparse.ArgumentTypeError(f"--node-cpu values must be >= 0 (0: shared cores), got {text!r}")
    return cores


def run_pool(store: ModelStore, home: Path, max_rings: int, node_cpu: float, wan: list[str], mix: list[dict],
             refs: list[str] | None, args) -> tuple[dict, list[str]]:
    """One pool's row, and the served-alone outputs (computed here when `refs` is None)."""
    pool = Pool(store, home, max_rings, f"rings{max_rings}-cpu{node_cpu:g}", wan, node_cpu, args.kv_wait_s)
    try:
        info = pool.wait_rings(max_rings)
        if refs is None:  # served alone once, on the first pool: every pool is held to it
            refs = trio.run(alone, pool.base, mix)
        # Warm-up, two clients a ring: every ring measures its rounds against the cost model
        # before the load (a fresh ring's round deadlines are the prediction alone).
        trio.run(closed_loop, pool.base, mix, 2 * max_rings, args.warmup_s, None)
        jobs_seen: dict[int, int] = {}
        start: dict = {}
        opened = lambda: start.update(rss=pool.rss(), cpu=pool.cpu(), thr=pool.throttle_stats())  # noqa: E731
        run = trio.run(_loop_watching_rings, pool, mix, args.clients, args.window_s, refs, jobs_seen, args.ramp_s, opened)
        after, cpu_end, thr_end = pool.ring(), pool.cpu(), pool.throttle_stats()
        rss_start, cpu_start, thr_start = start["rss"], start["cpu"], start["thr"]
        spent = [round(b - a, 1) if a is not None and b is not None else None for a, b in zip(cpu_start, cpu_end)]
        row = {"max_rings": max_rings, "node_cpu": node_cpu or None,
               "rings": [{k: r[k] for k in ("ring_id", "epoch", "stages")} for r in info["rings"]],
               "jobs_moved": after.get("jobs_moved"), "max_jobs_seen_per_ring": jobs_seen, **run,
               "cpu_s_in_window": {"coordinator": spent[0], "nodes": spent[1:]},
               "nodes_throttled_share": throttling(thr_start, thr_end) if pool.quotas else None,
               "rss_start": rss_start, "rss_end": pool.rss()}
    finally:
        pool.close()
    return row, refs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--window-s", type=float, default=30.0, help="closed-loop window per configuration")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=25.0, help="one-way latency of every emulated link")
    ap.add_argument("--warmup-s", type=float, default=20.0, help="2 clients a ring before each configuration's load")
    ap.add_argument("--ramp-s", type=float, default=15.0, help="the clients' first requests, before the window")
    ap.add_argument("--kv-wait-s", type=float, default=120.0,
                    help="serve's --kv-wait-s: how long a request waits for a ring with K/V room before 429 "
                         "(16 clients on one ring whose stages hold ~8 of these jobs: half of them wait a "
                         "job's length, ~45 s at one ring's rate)")
    ap.add_argument("--log-dir", help="keep the coordinator and node logs here (default: a temporary dir)")
    ap.add_argument("--node-cpu", type=_node_cpus, default=[0.25, 0.0],
                    help="CPU cores per node process, one pair of pools (1 ring, 2 rings) per value; "
                         "0: the shared cores, no quota (default 0.25,0)")
    args = ap.parse_args(argv)
    for cores in set(args.node_cpu) - {0.0}:
        try:
            CpuQuotas(cores).close()
        except QuotaError as exc:
            ap.error(str(exc))

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # pools closed on kill
    from transformers import AutoTokenizer

    out_dir = default_store_dir("smollm2-135m")
    prepare("smollm2-135m", out_dir, progress=False)
    store = ModelStore.open(out_dir)
    mix = request_mix(AutoTokenizer.from_pretrained(str(store.tokenizer_dir)))
    results = {"revision": git_revision(), "model": "smollm2-135m", "nodes": NODES,
               "node_memory_bytes": memory_for_stages(store, 2), "links": f"emulated WAN: {args.latency_ms:g} ms one way, 50 Mbit/s uplinks",
               "clients": args.clients, "kv_wait_s": args.kv_wait_s, "window_s": args.window_s, "warmup_s": args.warmup_s, "ramp_s": args.ramp_s, "cpus": os.cpu_count(),
               "node_cpu": {f"{c:g}": (describe(c) if c else "no quota: every process on the shared cores")
                            for c in args.node_cpu},
               "configs": [], "two_over_one": {}}
    refs = None
    wan = ["--link-latency-ms", f"{args.latency_ms:g}", "--link-upload-mbps", "50"]
    with tempfile.TemporaryDirectory(prefix="bench_rings_") as tmp:
        if args.log_dir:
            Path(args.log_dir).mkdir(parents=True, exist_ok=True)
            tmp = args.log_dir
        for cores in args.node_cpu:
            where = f"{cores:g} CPU each (own cgroup)" if cores else "the shared cores"
            for max_rings in (1, 2):
                print(f"== --max-rings {max_rings}: 6 half-model nodes on {where}", flush=True)
                row, refs = run_pool(store, Path(tmp), max_rings, cores, wan, mix, refs, args)
                results["configs"].append(row)
                spent = row["cpu_s_in_window"]
                print(f"   rings {len(row['rings'])}: {row['tok_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']}, "
                      f"ITL p50/p95 {row['itl_p50_s']}/{row['itl_p95_s']}, errors {row['errors']}, "
                      f"equal alone {row['outputs_equal_alone']}, load {row['load_average']}, CPU s coordinator "
                      f"{spent['coordinator']} nodes {spent['nodes']}, throttled {row['nodes_throttled_share']}", flush=True)
            one, two = (c["tok_per_s"] for c in results["configs"][-2:])
            results["two_over_one"][f"{cores:g}"] = ratio = two / one if one else None
            print(f"two rings / one ring aggregate tok/s on {where}: {ratio:.2f}x (target >= 1.8x)", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
