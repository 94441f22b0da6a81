"""Replica rings: one ring vs two over the same six half-model nodes, in one run (issue 21).

What a user runs: `shard-coord serve --min-nodes 6 --max-rings N` and six `shard-node join`
processes, each limited (--max-memory-bytes) to half the model's layers with their K/V for
the planner's workload, so a ring needs two of them and the pool holds three rings' worth.
With --max-rings 1 one ring serves and four nodes take roles; with --max-rings 2 two rings
form (the first ring keeps its two hot standbys, --ring-spares' default) and each request
is routed to the ring predicting its earliest completion (coordinator.jobs.ring_router).
Every link is the emulated WAN (25 ms one way, 50 Mbit/s uplinks, coordinator and nodes):
on the 2 shared CPU cores a compute-bound loopback ring cannot double, a latency-bound one
can. C closed-loop clients (16 by default) stream /v1/completions for a fixed window per
configuration, cycling a fixed mix of short prompts (greedy and seeded sampled, 64 and 128
new tokens; no 2k-token prompts: a half-model node's K/V budget holds ~8 short jobs).

Reported per configuration: rings formed, aggregate tok/s, p50/p95 TTFT and inter-token
gap, errors, whether every finished request equals the same request served alone (once,
on the one-ring pool, first), the most jobs each ring held at once (/v1/ring every 2 s),
the CPU seconds each process used in the window, and the load average (the cores are
shared); then the ratio of the two rings' tok/s to one ring's.

    python scripts/bench_rings.py --json OUT [--window-s 30] [--clients 16]
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
from scripts.bench_load import alone, closed_loop, cpu_s, rss_mb  # noqa: E402
from coordinator.jobs.engine import encode_chat  # noqa: E402
from coordinator.swarm.topology import TopologyConfig, model_spec  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from shard.store import ModelStore, default_store_dir, prepare  # noqa: E402

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


def half_model_bytes(store: ModelStore) -> int:
    """Memory for half the layers with their K/V for the planner's workload (as
    tests/e2e/ringkit.memory_for_stages(store, 2))."""
    topo = TopologyConfig()
    spec = model_spec(store, "f32", topo.kv_bytes_per_value)
    per_layer = spec.bytes_per_layer + spec.kv_bytes_per_token_layer * (topo.prompt_tokens + topo.output_tokens)
    return per_layer * -(-store.num_layers // 2) + per_layer // 2


class Pool:
    """A coordinator process and six node processes; all killed on close."""

    def __init__(self, store: ModelStore, home: Path, max_rings: int, name: str, wan: list[str] = WAN) -> None:
        self.log_path, self.procs = home / f"{name}.log", []
        env = {**os.environ, "SHARD_HOME": str(home / f"{name}-home"), "OMP_NUM_THREADS": "1"}
        log = open(self.log_path, "w")
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", "coordinator.cli", "serve", "--model", "smollm2-135m", "--store-dir", str(store.root),
             "--min-nodes", str(NODES), "--max-rings", str(max_rings), "--http", "127.0.0.1:0",
             "--listen", "/ip4/127.0.0.1/tcp/0", "--draft", "none", "--max-concurrent-jobs", "64",
             "--probation-rounds", "0", *wan], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        try:
            addr = self._wait_for(JOIN, 300)
            for i in range(NODES):
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", "shard.cli", "join", "--coordinator", addr, "--model", "smollm2-135m",
                     "--store-dir", str(store.root), "--key-path", str(home / f"{name}-node{i}.key"),
                     "--max-memory-bytes", str(half_model_bytes(store)), "--torch-threads", "1", *wan],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
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

    def close(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


async def _loop_watching_rings(pool: Pool, mix: list[dict], clients: int, window_s: float, refs: list[str],
                               seen: dict[int, int]) -> dict:
    """closed_loop, while /v1/ring is read every 2 s for the most jobs each ring held."""
    async def watch():
        async with httpx.AsyncClient(base_url=pool.base, timeout=30) as client:
            while True:
                await trio.sleep(2)
                for r in (await client.get("/v1/ring")).json().get("rings", []):
                    seen[r["ring_id"]] = max(seen.get(r["ring_id"], 0), r["jobs"])

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch)
        result = await closed_loop(pool.base, mix, clients, window_s, refs)
        nursery.cancel_scope.cancel()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", required=True, help="write the results here")
    ap.add_argument("--window-s", type=float, default=30.0, help="closed-loop window per configuration")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--latency-ms", type=float, default=25.0, help="one-way latency of every emulated link")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # pools closed on kill
    from transformers import AutoTokenizer

    out_dir = default_store_dir("smollm2-135m")
    prepare("smollm2-135m", out_dir, progress=False)
    store = ModelStore.open(out_dir)
    mix = request_mix(AutoTokenizer.from_pretrained(str(store.tokenizer_dir)))
    results = {"revision": git_revision(), "model": "smollm2-135m", "nodes": NODES,
               "node_memory_bytes": half_model_bytes(store), "links": f"emulated WAN: {args.latency_ms:g} ms one way, 50 Mbit/s uplinks",
               "clients": args.clients, "window_s": args.window_s, "cpus": os.cpu_count(), "configs": []}
    refs = None
    with tempfile.TemporaryDirectory(prefix="bench_rings_") as tmp:
        for max_rings in (1, 2):
            print(f"== --max-rings {max_rings}: starting 6 half-model nodes", flush=True)
            wan = ["--link-latency-ms", f"{args.latency_ms:g}", "--link-upload-mbps", "50"]
            pool = Pool(store, Path(tmp), max_rings, f"rings{max_rings}", wan)
            try:
                info = pool.wait_rings(max_rings)
                if refs is None:  # served alone once, on the first pool: both pools are held to it
                    refs = trio.run(alone, pool.base, mix)
                jobs_seen: dict[int, int] = {}
                rss_start, cpu_start = pool.rss(), pool.cpu()
                run = trio.run(_loop_watching_rings, pool, mix, args.clients, args.window_s, refs, jobs_seen)
                after, cpu_end = pool.ring(), pool.cpu()
                spent = [round(b - a, 1) if a is not None and b is not None else None for a, b in zip(cpu_start, cpu_end)]
                row = {"max_rings": max_rings, "rings": [{k: r[k] for k in ("ring_id", "epoch", "stages")}
                                                         for r in info["rings"]],
                       "jobs_moved": after.get("jobs_moved"), "max_jobs_seen_per_ring": jobs_seen, **run,
                       "cpu_s_in_window": {"coordinator": spent[0], "nodes": spent[1:]},
                       "rss_start": rss_start, "rss_end": pool.rss()}
            finally:
                pool.close()
            results["configs"].append(row)
            print(f"   rings {len(row['rings'])}: {row['tok_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_s']}, "
                  f"ITL p50/p95 {row['itl_p50_s']}/{row['itl_p95_s']}, errors {row['errors']}, "
                  f"equal alone {row['outputs_equal_alone']}, load {row['load_average']}, "
                  f"CPU s coordinator {spent[0]} nodes {spent[1:]}", flush=True)
    one, two = (c["tok_per_s"] for c in results["configs"])
    results["two_over_one"] = two / one if one else None
    print(f"two rings / one ring aggregate tok/s: {results['two_over_one']:.2f}x (target >= 1.8x)", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
