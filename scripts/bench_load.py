"""Many users at once: closed-loop clients against a real 3-stage ring, batching on and off (issue 21).

What a user runs: `shard-coord serve --local-nodes 3` (three `shard-node join` processes,
one stage each, receipts checked, no drafter) on the default model (SmolLM2-135M-Instruct,
f32), spoken to over HTTP by C closed-loop clients (C = 1, 4, 16, 32 by default), each
sending its next streamed /v1/completions request as soon as the last one ends: per C a
ramp (--ramp-s, every client's first request at once: reported, not measured; with
--ramp-until-first also until every client's first request has ended) and then the
measured window. Requests cycle through a fixed mix: greedy and seeded sampled, 64-256
new tokens, short prompts and ~2k-token ones. Rings: loopback, and the emulated WAN (25 ms
one way, 50 Mbit/s uplinks on every edge); on each, node batching on (the default token
budget) and off (--node-batch-token-budget 1), side by side in one run; and the gateway's
prefix cache on (its default) or, with --prefix-cache on,off, off beside it. The mix's kinds
resend the same prompts, all opening with the chat template's system prompt: with the cache
on, a prompt seen before forks from the K/V its last request left on the stages.

Reported per ring and C: aggregate tok/s (content chunks received in the window: with no
drafter each is one token), CPU ms per token (all four processes' CPU in the window over
its tokens), p50/p95 time to first token and inter-token gap, errors, the gateway's (job, stage) audits
done and skipped (stale: drawn, but their turn came too late),
and whether every request that finished equals the same request served alone (served
once each, one at a time, first, on a ring without the prefix cache); the prefix cache's
forks and the prompt tokens they did not compute again; and the window's timeline (tokens and prompt tokens
started, per second) with the rate between prompts (seconds with no prompt started in
them or the 4 before: what decoding alone reaches, against which the prefill of prompts
arriving together shows). A sustained run at the highest C records coordinator
and node RSS every 10 s (--sustain-s), each split by mapping (glibc's arenas, Python's,
other anonymous memory, file-backed pages). The machine's load average is recorded with each
figure: the 2 cores are shared.

Each ring's levels are set against the issue's targets (tok/s at 16 streams over one
stream's, ITL p95 likewise, errors, outputs equal alone), and the sustained run's RSS
growth is counted from --warmup-s on (the gateway's and nodes' first loads are warm-up).

    python scripts/bench_load.py --json OUT [--window-s 30] [--sustain-s 300] [--links loopback,wan]
    # a short smoke: C = 1 and 16 for 20 s each on loopback, batching on, short prompts only
    python scripts/bench_load.py --json OUT --concurrency 1,16 --window-s 20 --sustain-s 0 \
        --links loopback --batching on --kinds 0,1
"""

from __future__ import annotations

import argparse
import itertools
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

from scripts.bench_ringkit import git_revision, rss_by_mapping_mb  # noqa: E402
from scripts.load_clients import alone, closed_loop  # noqa: E402
from coordinator.jobs.engine import encode_chat  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from shard.store import ModelStore, default_store_dir, prepare  # noqa: E402

BANNER = re.compile(r"serving \S+ at (http://[0-9.]+:\d+)/v1")
LINKS = {"loopback": [], "wan": ["--link-latency-ms", "25", "--link-upload-mbps", "50"]}
# Batching on, but nowait: no forward (nor the head) waits for a burst; arrival: prefill oldest first.
BATCHING = {"on": [], "off": ["--node-batch-token-budget", "1"], "nowait": ["--burst-wait-ms", "0"],
            "arrival": ["--node-prefill-order", "arrival"]}
PREFIX = {"on": [], "off": ["--prefix-cache-tokens", "0"]}  # the prefix cache (coordinator.jobs.prefix_cache)


def request_mix(tokenizer) -> list[dict]:
    """The fixed request mix: 8 kinds through the chat template, 1 in 4 with a ~2k-token
    prompt (a passage repeated, then a question), 1 in 4 seeded sampling."""
    short = [p for _, p in spec_prompts.prompt_set(1)]
    filler = " ".join([spec_prompts.long_text()] * 6)
    out = []
    for i in range(8):
        text = f"{filler}\n\nIn one paragraph, what is this text about? ({i})" if i % 4 == 2 else short[i % len(short)]
        ids = encode_chat(tokenizer, spec_prompts.messages(text))
        body = {"prompt": ids, "max_tokens": (64, 128, 192, 256)[i % 4], "temperature": 0.0}
        if i % 4 == 1:
            body.update(temperature=0.8, top_p=0.95, seed=100 + i)
        out.append(body)
    return out


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def mapped_mb(pid: int) -> dict[str, float] | None:
    try:
        return rss_by_mapping_mb(pid)
    except OSError:
        return None


def cpu_s(pid: int) -> float | None:
    """User + system CPU seconds the process has used (/proc/PID/stat), None once gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    """The process's children, whichever of its threads started them (in start order)."""
    found: list[int] = []
    try:
        for task in sorted(Path(f"/proc/{pid}/task").iterdir(), key=lambda p: int(p.name)):
            found += [int(p) for p in (task / "children").read_text().split()]
    except OSError:
        pass
    return sorted(set(found))


class Ring:
    """One `shard-coord serve --local-nodes 3` process and its nodes; killed on close."""

    def __init__(self, store: ModelStore, home: Path, extra: list[str], name: str) -> None:
        self.log_path = home / f"{name}.log"
        env = {**os.environ, "SHARD_HOME": str(home / "shard-home"), "OMP_NUM_THREADS": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "coordinator.cli", "serve", "--model", "smollm2-135m", "--store-dir",
                 str(store.root), "--local-nodes", "3", "--http", "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0",
                 "--draft", "none", "--max-concurrent-jobs", "64", *extra],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + 300
        try:
            while time.monotonic() < deadline:
                m = BANNER.search(self.log_path.read_text(errors="replace"))
                if m:
                    self.base = m.group(1)
                    return
                if self.proc.poll() is not None:
                    break
                time.sleep(0.5)
        finally:
            if not hasattr(self, "base"):
                self.close()
        raise RuntimeError(f"{name}: no banner:\n{self.log_path.read_text(errors='replace')[-3000:]}")

    def rss(self, by_mapping: bool = False) -> dict:
        """RSS of the coordinator and each node; `by_mapping`: also each one's split by what
        holds it (bench_ringkit.rss_by_mapping_mb: glibc's arenas, Python's, other anonymous
        memory such as K/V blocks, files)."""
        nodes = [p for p in children(self.proc.pid)]
        out = {"coordinator_mb": rss_mb(self.proc.pid), "nodes_mb": [rss_mb(p) for p in nodes]}
        if by_mapping:
            out["by_mapping_mb"] = [mapped_mb(p) for p in [self.proc.pid, *nodes]]
        return out

    def cpu(self) -> dict:
        """CPU seconds used so far by the coordinator and each node (where the cores go)."""
        return {"coordinator_s": cpu_s(self.proc.pid), "nodes_s": [cpu_s(p) for p in children(self.proc.pid)]}

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def head_counts(base: str) -> dict:
    """From the gateway's /metrics: LM-head products run and ring rounds committed so far
    (their ratio over a level: rounds per product, how much the head batched), and the
    (job, stage) audits done and not done (all reasons; stale: drawn, their turn too late)."""
    text = httpx.get(f"{base.rsplit('/v1', 1)[0]}/metrics", timeout=30).text
    total = lambda name: sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # noqa: E731
                             if line.startswith(name) and not line.startswith("#"))
    return {"products": total("shard_lm_head_seconds_count"), "rounds": total("shard_traversals_total"),
            "audits": total("shard_audits_total"), "audits_skipped": total("shard_audits_skipped_total"),
            "audits_stale": total('shard_audits_skipped_total{reason="stale"}')}


def audits_between(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("audits", "audits_skipped", "audits_stale")}


def prefix_counts(base: str) -> dict:
    """The gateway's prefix cache so far (/v1/ring): forks, prompt tokens they did not
    compute again, sources kept and held now."""
    info = httpx.get(f"{base}/v1/ring", timeout=30).json().get("prefix_cache") or {}
    return {k: info.get(k, 0) for k in ("lookups", "hits", "tokens_reused", "kept", "sources", "tokens")}


def cpu_spent(before: dict, after: dict) -> dict:
    """CPU seconds each process used between two Ring.cpu() readings (0 for one gone)."""
    d = lambda a, b: (b - a) if a is not None and b is not None else 0.0  # noqa: E731
    return {"coordinator": d(before["coordinator_s"], after["coordinator_s"]),
            "nodes": [d(a, b) for a, b in zip(before["nodes_s"], after["nodes_s"])]}


def rss_growth(samples: list[dict], warmup_s: float) -> dict:
    """RSS growth over a sustained run after its warm-up: the first sample at or past
    `warmup_s` against the last one taken while the clients ran, per process (percent);
    and the lowest sample of the first third of those samples against the last third's."""
    running = [s for s in samples if not s.get("after_idle_5s")]
    warm = next((s for s in running if s["t_s"] >= warmup_s), None)
    if warm is None or warm is running[-1]:
        return {"warmup_s": warmup_s, "coordinator_pct": None, "nodes_pct": []}
    pct = lambda a, b: None if not a or b is None else round(100 * (b - a) / a, 1)  # noqa: E731
    end = running[-1]
    after = [s for s in running if s["t_s"] >= warm["t_s"]]
    first, last = after[: max(1, len(after) // 3)], after[-max(1, len(after) // 3):]

    def low(part: list[dict], key: str, i: int | None = None) -> float | None:
        values = [v for v in ((s[key] if i is None else s[key][i]) for s in part) if v is not None]
        return min(values) if values else None
    return {"warmup_s": warmup_s, "from_t_s": warm["t_s"], "to_t_s": end["t_s"],
            "coordinator_pct": pct(warm["coordinator_mb"], end["coordinator_mb"]),
            "nodes_pct": [pct(a, b) for a, b in zip(warm["nodes_mb"], end["nodes_mb"])],
            # The lowest sample of the first third after warm-up against the last third's: the
            # slices a stage's audits load (weights mapped from the store) and its running jobs'
            # K/V swing it by hundreds of MB, so two single samples read that cycle's phase, the
            # troughs what stays.
            "troughs_coordinator_pct": pct(low(first, "coordinator_mb"), low(last, "coordinator_mb")),
            "troughs_nodes_pct": [pct(low(first, "nodes_mb", i), low(last, "nodes_mb", i)) for i in range(len(end["nodes_mb"]))],
            # Where each process's trough moved (MB, last third's lowest against the first third's,
            # per kind of mapping): glibc's arenas, Python's, other anonymous memory, files.
            "troughs_by_mapping_mb": trough_shift_by_mapping(first, last)}


def trough_shift_by_mapping(first: list[dict], last: list[dict]) -> list[dict[str, float]]:
    """Per process (coordinator first, then the nodes), per kind of mapping, the lowest
    sample of `last` less the lowest of `first` (MB); [] where samples lack the split."""
    def split(sample: dict, proc: int) -> dict | None:
        maps = sample.get("by_mapping_mb") or []
        return maps[proc] if proc < len(maps) else None

    def low(part: list[dict], proc: int, kind: str) -> float | None:
        values = [m[kind] for s in part if (m := split(s, proc)) and kind in m]
        return min(values) if values else None
    out = []
    for proc in range(max((len(s.get("by_mapping_mb") or []) for s in first + last), default=0)):
        kinds = sorted({kind for s in first + last if (m := split(s, proc)) for kind in m})
        out.append({kind: round(b - a, 1) for kind in kinds
                    if (a := low(first, proc, kind)) is not None and (b := low(last, proc, kind)) is not None})
    return out


def against_targets(levels: list[dict]) -> dict:
    """The issue's targets on one ring's levels: tok/s at 16 streams over one stream's
    (>= 6x), ITL p95 at 16 over one stream's (<= 3x), errors (none), outputs equal alone."""
    by_c = {row["clients"]: row for row in levels}
    one, many = by_c.get(1), by_c.get(16)
    ratio = lambda a, b: None if a is None or not b else round(a / b, 2)  # noqa: E731
    return {"tok_s_16_over_1": ratio(many and many["tok_per_s"], one and one["tok_per_s"]),
            "itl_p95_16_over_1": ratio(many and many["itl_p95_s"], one and one["itl_p95_s"]),
            "errors": sum(row["errors"] for row in levels),
            "all_equal_alone": all(row["outputs_equal_alone"] is not False for row in levels)}


async def sustained(ring: Ring, mix: list[dict], clients: int, seconds: float, refs: list[str]) -> dict:
    samples = [{"t_s": 0.0, **ring.rss(by_mapping=True)}]
    t0, counts = time.monotonic(), head_counts(ring.base)

    async def sample():
        while True:
            await trio.sleep(10)
            samples.append({"t_s": time.monotonic() - t0, **ring.rss(by_mapping=True)})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample)
        result = await closed_loop(ring.base, mix, clients, seconds, refs)
        nursery.cancel_scope.cancel()
    await trio.sleep(5)
    samples.append({"t_s": time.monotonic() - t0, "after_idle_5s": True, **ring.rss(by_mapping=True)})
    return {**result, "rss": samples, "audits": audits_between(counts, head_counts(ring.base))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--window-s", type=float, default=30.0, help="closed-loop window per concurrency")
    ap.add_argument("--ramp-s", type=float, default=30.0,
                    help="each level's clients run this long before its window opens (not measured, reported)")
    ap.add_argument("--ramp-until-first", action="store_true",
                    help="the ramp also lasts until every client's first request has ended (steady mix in the window)")
    ap.add_argument("--ramp-max-s", type=float, default=600.0, help="the longest a --ramp-until-first ramp may last")
    ap.add_argument("--warmup-s", type=float, default=60.0, help="RSS growth of the sustained run is counted from here")
    ap.add_argument("--sustain-s", type=float, default=300.0, help="sustained run at the highest concurrency (0: none)")
    ap.add_argument("--links", default="loopback,wan")
    ap.add_argument("--wan-concurrency", default=None, help="levels on the WAN ring (default: --concurrency)")
    ap.add_argument("--batching", default="on,off", help="on, off, nowait (no burst waits), arrival (prefill oldest first), "
                    "waitN (N ms)")
    ap.add_argument("--kinds", default="0,1,2,3,4,5,6,7", help="which request kinds of the mix to send (indices)")
    ap.add_argument("--prefix-cache", default="on", help="on, off or both (on,off): the gateway's prefix cache; the "
                    "mix resends its prompts, as chat traffic resends system prompts and histories")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))  # rings closed on kill
    from transformers import AutoTokenizer

    out_dir = default_store_dir("smollm2-135m")
    prepare("smollm2-135m", out_dir, progress=False)
    store = ModelStore.open(out_dir)
    mix = request_mix(AutoTokenizer.from_pretrained(str(store.tokenizer_dir)))
    mix = [mix[int(i)] for i in args.kinds.split(",")]
    levels = [int(c) for c in args.concurrency.split(",")]
    result = {"conditions": {
        "model": "smollm2-135m", "manifest_digest": store.digest, "ring": "shard-coord serve --local-nodes 3 "
        "(one stage per node, 10 layers each), receipts on, --draft none, f32 wire, 1 torch thread per node",
        "requests": [{"prompt_tokens": len(b["prompt"]), "max_tokens": b["max_tokens"],
                      "temperature": b["temperature"]} for b in mix],
        "window_s": args.window_s, "ramp_s": args.ramp_s, "ramp_until_first": args.ramp_until_first,
        "sustain_s": args.sustain_s, "cpus": os.cpu_count(),
        "tokens": "content chunks of the stream received within the window (no drafter: one token a round)",
        "prefix_cache": "on: the gateway's default (--prefix-cache-tokens 8192); the mix's kinds resend the same "
                        "prompts (and share the chat template's system prompt), so after a kind's first request "
                        "its prompt forks from a kept one; off: --prefix-cache-tokens 0",
        "git_revision": git_revision(), "started_load_average": list(os.getloadavg())}, "runs": []}
    home = Path(tempfile.mkdtemp(prefix="bench_load_"))
    try:
        # The references: each request alone, one at a time, computed whole (no prefix cache).
        ring = Ring(store, home, PREFIX["off"], "reference")
        try:
            refs = trio.run(alone, ring.base, mix)
            result["conditions"]["reference"] = "each request alone on a loopback ring without the prefix cache, first"
        finally:
            ring.close()
        for link, batching, prefix in itertools.product(args.links.split(","), args.batching.split(","),
                                                        args.prefix_cache.split(",")):
            name = f"{link}-batching-{batching}" + (f"-prefix-{prefix}" if "," in args.prefix_cache else "")
            burst_wait = ["--burst-wait-ms", batching.removeprefix("wait")]  # waitN: bursts waited N ms
            ring = Ring(store, home, LINKS[link] + BATCHING.get(batching, burst_wait) + PREFIX[prefix], name)
            try:
                run = {"link": link, "batching": batching, "prefix_cache": prefix, "rss_start": ring.rss(),
                       "levels": []}
                for c in (levels if link != "wan" or not args.wan_concurrency
                          else [int(x) for x in args.wan_concurrency.split(",")]):
                    opened = {}
                    row = trio.run(closed_loop, ring.base, mix, c, args.window_s, refs, args.ramp_s,
                                   lambda: opened.update(cpu=ring.cpu(), heads=head_counts(ring.base),
                                                         prefix=prefix_counts(ring.base)),
                                   args.ramp_until_first, args.ramp_max_s)
                    before, heads = opened["cpu"], opened["heads"]
                    now = prefix_counts(ring.base)
                    row["prefix_cache"] = {**{k: now[k] - opened["prefix"][k] for k in ("lookups", "hits", "tokens_reused")},
                                           "sources": now["sources"], "source_tokens": now["tokens"]}
                    row["cpu_s"] = cpu_spent(before, ring.cpu())
                    spent = row["cpu_s"]["coordinator"] + sum(row["cpu_s"]["nodes"])
                    row["cpu_ms_per_token"] = round(1000 * spent / row["tokens"], 1) if row["tokens"] else None
                    time.sleep(2)  # jobs cut off at the window's end are counted once they end
                    after = head_counts(ring.base)
                    products = after["products"] - heads["products"]
                    row["head_rounds_per_product"] = (after["rounds"] - heads["rounds"]) / products if products else None
                    row["audits"] = audits_between(heads, after)  # of jobs ended in the window and the 2 s after
                    print(f"{name:28s} C={c:3d}  {row['tok_per_s']:6.1f} tok/s  TTFT p50/p95 "
                          f"{row['ttft_p50_s'] or 0:.2f}/{row['ttft_p95_s'] or 0:.2f} s  ITL p50/p95 "
                          f"{row['itl_p50_s'] or 0:.3f}/{row['itl_p95_s'] or 0:.3f} s  errors {row['errors']}  "
                          f"equal alone {row['outputs_equal_alone']}  CPU s coordinator/nodes {row['cpu_s']['coordinator']:.1f}/"
                          f"{'/'.join(f'{x:.1f}' for x in row['cpu_s']['nodes'])}  rounds per head product "
                          f"{row['head_rounds_per_product'] or 0:.2f}  CPU ms/token {row['cpu_ms_per_token']}  "
                          f"prompt tokens started per token {row['prompt_tokens_started'] / max(row['tokens'], 1):.1f}  "
                          f"reused {row['prefix_cache']['tokens_reused'] / max(row['tokens'], 1):.1f} "
                          f"({row['prefix_cache']['hits']} forks)  "
                          f"between prompts {row['quiet_tok_per_s'] or 0:.1f} tok/s  "
                          f"(ramp {row['ramp_s_taken']:.0f} s, {row['ramp_tok_per_s'] or 0:.1f} tok/s)  "
                          f"load {row['load_average'][0]:.1f}  audits {row['audits']}",
                          flush=True)
                    run["levels"].append(row)
                run["rss_end"] = ring.rss()
                if args.sustain_s and link == "loopback" and batching == "on" and prefix == "on":
                    run["sustained"] = trio.run(sustained, ring, mix, max(levels), args.sustain_s, refs)
                    s = run["sustained"]["rss"]
                    print(f"{name}: sustained {args.sustain_s:.0f} s at C={max(levels)}: coordinator "
                          f"{s[0]['coordinator_mb']:.0f} -> {s[-1]['coordinator_mb']:.0f} MB, nodes "
                          f"{[round(x) for x in s[0]['nodes_mb']]} -> {[round(x) for x in s[-1]['nodes_mb']]} MB, "
                          f"audits {run['sustained']['audits']}", flush=True)
                run["targets"] = against_targets(run["levels"])
                print(f"{name}: {run['targets']}", flush=True)
                if "sustained" in run:
                    run["sustained"]["rss_growth"] = rss_growth(run["sustained"]["rss"], args.warmup_s)
                    print(f"{name}: RSS growth after warm-up {run['sustained']['rss_growth']}", flush=True)
                result["runs"].append(run)
            finally:
                ring.close()
                if args.json:
                    Path(args.json).write_text(json.dumps(result, indent=2))
    finally:
        result["conditions"]["ended_load_average"] = list(os.getloadavg())
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
