"""Hostile peers against a live node process (issue 20, node side): what each attack costs.

One `shard-node join` process (SmolLM2-135M, all 30 layers: head and tail of a one-stage
ring, fp32 on CPU, 1 torch thread, receipts signed) joins this script, which plays its
coordinator and so its predecessor; strangers are fresh libp2p identities. Attacks, in
order, each followed by a good prefill frame whose Result must equal, bit for bit, the one
served before any attack:
1. predecessor: hostile frames (mutated Forwards: nonce, job id, positions, ctx_len, token
   ids, hidden for the head, commits, aux layers, stale epochs; random bytes; truncated
   frames), about 1 in 20 a valid frame, and over-long length prefixes;
2. strangers: valid frames, each on its own stream, which the node must reset unread; then
   16 MiB frames pushed by strangers;
3. a connection flood: connections opened and closed one at a time, past py-libp2p's 250
   inbound slots, then a fresh identity probes the node (it must still be served);
4. never-ended jobs: 64-token prefills of jobs never ended, then --idle-timeout-s waited out;
5. slow senders: predecessor streams announcing 1 MiB and sending 10 bytes.
Per attack: whether the node process is alive, its RSS before, right after and once the
attack's resources are due back, what was answered, and the good frame's check.

    python scripts/bench_hostile.py --json OUT [--frames 5000] [--connections 300]  (issue: 100000, 1000)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import msgpack
import torch
import trio
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_ringkit import base_conditions  # noqa: E402
from scripts.hostile_ring_attacks import flood  # noqa: E402
from shard.errors import TransportError  # noqa: E402
from shard.identity import keypair_from_seed  # noqa: E402
from shard.linkprobe import PROBE_PROTOCOL, measure_rtt  # noqa: E402
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402
from shard.transport import open_host  # noqa: E402
from shard.wire.codec import HEADER_PREFIX, decode, encode  # noqa: E402
from shard.wire.limits import FRAME_PREFIX, Limits  # noqa: E402
from shard.wire.messages import Assignment, EndJob, Forward, JobError, Ping, Pong, Ready, Register, Result  # noqa: E402

MODEL = "smollm2-135m"
GOOD_IDS = [1, 504, 2632, 314, 253, 5248, 30, 198]


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    """/proc/PID/status's VmRSS, or RssAnon / RssFile (file pages: mapped weights touched)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for pid {pid}")


# Streams one stranger (a key, a connection) opens before a fresh one takes over: py-libp2p's
# client wedged past ~16k streams on one connection (no CPU, deaf to cancellation) while the
# node stayed up (a fresh peer's probe answered in 0.8 ms); real strangers are many keys anyway.
STREAMS_PER_STRANGER = 1000


def forward(job_id: str, ids: list[int], round_: int = 1, ctx: int = 0, epoch: int = 1) -> Forward:
    return Forward(job_id=job_id, epoch=epoch, round=round_, nonce=os.urandom(16), phase="prefill", ctx_len=ctx,
                   positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


def tampered(msg, **header) -> bytes:
    """msg's frame body with header fields replaced after encoding (skipping our encoder's checks)."""
    body = encode(msg)
    (n,) = HEADER_PREFIX.unpack_from(body, 0)
    head = msgpack.unpackb(body[HEADER_PREFIX.size:HEADER_PREFIX.size + n], raw=False)
    head.update(header)
    packed = msgpack.packb(head, use_bin_type=True)
    return HEADER_PREFIX.pack(len(packed)) + packed + body[HEADER_PREFIX.size + n:]


KINDS = ("nonce", "job_id", "positions", "ctx_len", "token", "hidden_for_head", "commit", "aux_layer", "stale_epoch",
         "random_bytes", "truncated", "header_junk", "valid")


def hostile_frame(rng: random.Random, i: int, cfg, kinds: tuple[str, ...] = KINDS, epoch: int = 1) -> tuple[str, bytes]:
    """(kind, body): one hostile frame from the predecessor of a stage serving `epoch`; job
    ids are unique per frame."""
    n = rng.randint(1, 6)
    ids = [rng.randrange(cfg.vocab_size) for _ in range(n)]
    base = forward(f"h{i}", ids, round_=i, epoch=epoch)
    kind = rng.choice(kinds)
    if kind == "nonce":
        return kind, tampered(base, nonce=os.urandom(rng.choice([0, 3, 15, 33, 40])))
    if kind == "job_id":
        return kind, tampered(base, job_id=rng.choice(["", "../x", "a b", "j" * 65, "é", "-lead"]))
    if kind == "positions":
        far = rng.choice([cfg.max_context_tokens, 10**6, 1 << 40, (1 << 62)])
        return kind, encode(dataclasses.replace(base, positions=torch.arange(n) + far))
    if kind == "ctx_len":
        return kind, tampered(base, ctx_len=rng.choice([cfg.max_context_tokens + 1, 1 << 40, (1 << 63) - 1]))
    if kind == "token":
        return kind, encode(dataclasses.replace(base, tokens=torch.tensor([cfg.vocab_size + rng.randrange(1 << 30)] * n)))
    if kind == "hidden_for_head":
        return kind, encode(dataclasses.replace(base, tokens=None, hidden=torch.randn(n, cfg.hidden_size)))
    if kind == "commit":
        return kind, tampered(base, ctx_len=8, commit_src=[rng.randrange(1 << 40) for _ in range(4)], commit_dst=0)
    if kind == "aux_layer":
        return kind, tampered(base, want_aux_layers=[cfg.num_layers + rng.randrange(100)])
    if kind == "stale_epoch":
        return kind, encode(dataclasses.replace(base, epoch=rng.choice([0, 2, 1 << 40])))
    if kind == "random_bytes":
        return kind, os.urandom(rng.randint(0, 4096))
    if kind == "truncated":
        body = encode(base)
        return kind, body[:rng.randrange(len(body))]
    if kind == "header_junk":
        head = msgpack.packb({"v": 2, "kind": "forward", rng.choice(["x", "tensors", "job_id"]): [[[1]]] * 3})
        return kind, HEADER_PREFIX.pack(len(head)) + head
    return kind, encode(base)


class Coordinator:
    """This script's side: a signed assignment for the node, and every message it sends back."""

    def __init__(self, host, seed: bytes, store, limits: Limits) -> None:
        self.host, self.seed, self.store, self.limits = host, seed, store, limits
        self.ready = trio.Event()
        self.node_id = self.node_addr = ""
        self.inbox_send, self.inbox = trio.open_memory_channel(100_000)

    async def on_control(self, stream) -> None:
        msg = decode(await stream.recv_frame(self.limits.max_frame_bytes), self.limits)
        while isinstance(msg, Ping):
            await stream.send_frame(encode(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns, payload=bytes(msg.reply_bytes))))
            msg = decode(await stream.recv_frame(self.limits.max_frame_bytes), self.limits)
        assert isinstance(msg, Register), msg
        self.node_addr = msg.listen_addrs[0]
        a = Assignment(epoch=1, peer_id=msg.peer_id, role="stage", layer_start=0, layer_end=self.store.num_layers,
                       predecessor=None, successor=None, model=MODEL, manifest_digest=self.store.digest, wire_dtype="f32")
        a = dataclasses.replace(a, signature=Ed25519PrivateKey.from_private_bytes(self.seed).sign(a.signing_bytes()))
        await stream.send_frame(encode(a))
        while True:
            msg = decode(await stream.recv_frame(self.limits.max_frame_bytes), self.limits)
            if isinstance(msg, Ready):
                self.node_id = msg.peer_id
                self.ready.set()
            else:
                self.inbox_send.send_nowait(msg)

    async def on_ring(self, stream) -> None:
        while True:
            self.inbox_send.send_nowait(decode(await stream.recv_frame(self.limits.max_frame_bytes), self.limits))

    async def good_frame(self, stream, tag: str) -> tuple[torch.Tensor, list]:
        """Send a good prefill; (its Result's hidden, everything that arrived before it)."""
        await stream.send_frame(encode(forward(tag, GOOD_IDS)))
        before = []
        with trio.fail_after(120):
            while True:
                msg = await self.inbox.receive()
                if isinstance(msg, Result) and msg.job_id == tag:
                    await stream.send_frame(encode(EndJob(job_id=tag, epoch=1)))
                    return msg.hidden, before
                before.append(msg)


async def expect_refused(stream_opener, body: bytes) -> bool:
    """True if the node refuses a stranger's stream (the open, send or read fails) within 10 s."""
    try:
        with trio.fail_after(10):
            stream = await stream_opener()
            await stream.send_frame(body)
            await stream.recv_frame(1 << 20)
    except (TransportError, trio.TooSlowError) as exc:
        return isinstance(exc, TransportError)
    return False


async def run(args) -> dict:
    store = await trio.to_thread.run_sync(open_or_prepare, MODEL, None)
    cfg = store.config
    limits = Limits.for_model(cfg, max_tokens_per_frame=2048)
    seed = os.urandom(32)
    rng = random.Random(args.seed)
    out: dict = {"conditions": {**base_conditions(store), "node": "shard-node join subprocess, 1 stage (all layers), "
                                "1 torch thread, receipts on", "frames": args.frames, "connections": args.connections,
                                "never_ended_jobs": args.jobs, "idle_timeout_s": args.idle_timeout_s,
                                "slow_senders": args.slow, "seed": args.seed, "kinds": list(args.kinds),
                                "node_malloc_mmap_threshold_bytes": args.mmap_threshold_bytes or "glibc default"}, "attacks": {}}
    async with open_host(keypair_from_seed(seed)) as host:
        coord = Coordinator(host, seed, store, limits)
        host.set_handler(CONTROL_PROTOCOL, coord.on_control)
        host.set_handler(RING_PROTOCOL, coord.on_ring)
        tmp = tempfile.mkdtemp(prefix="bench_hostile_")
        log_path = os.path.join(tmp, "node.log")
        cmd = [sys.executable, "-m", "shard.cli", "join", "--coordinator", host.addrs[0], "--model", MODEL,
               "--key-path", os.path.join(tmp, "node.key"), "--torch-threads", "1",
               "--job-idle-timeout-s", str(args.idle_timeout_s), "--log-level", "ERROR"]
        env = dict(os.environ)
        if args.mmap_threshold_bytes:
            # glibc otherwise raises its mmap threshold after the first freed KV block, and
            # later blocks come from arenas it keeps: RSS that is free memory, not a leak.
            env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold_bytes)
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            with trio.fail_after(300):
                await coord.ready.wait()
            ring = await host.open_stream(coord.node_id, RING_PROTOCOL)
            reference, _ = await coord.good_frame(ring, "good-0")
            # Warm-up: every frame size the attacks run (1..6 tokens, 64-token prefills),
            # so the allocator's growth on first use is not counted against an attack.
            for t in (*range(1, 7), 64):
                await ring.send_frame(encode(forward(f"warm-{t}", [5] * t)))
                await ring.send_frame(encode(EndJob(job_id=f"warm-{t}", epoch=1)))
            await coord.good_frame(ring, "good-warm")
            out["conditions"]["rss_mb_serving_warm"] = round(rss_mb(proc.pid), 1)

            async def attack(name: str, body, settle_s: float = 2.0) -> None:
                nonlocal ring
                split = lambda: {f: round(rss_mb(proc.pid, f), 1) for f in ("RssAnon", "RssFile")}  # noqa: E731
                before, split_before = rss_mb(proc.pid), split()
                t0 = time.perf_counter()
                facts = await body()
                elapsed = time.perf_counter() - t0
                peak = rss_mb(proc.pid)
                await trio.sleep(settle_s)
                if proc.poll() is None:
                    ring = await host.open_stream(coord.node_id, RING_PROTOCOL)
                    hidden, late = await coord.good_frame(ring, f"good-{name}")
                    facts["late_answers_before_good_frame"] = len(late)
                    facts["good_frame_identical"] = bool(torch.equal(hidden, reference))
                settled = rss_mb(proc.pid) if proc.poll() is None else None
                await trio.sleep(args.idle_timeout_s + min(args.idle_timeout_s / 4, 10) + 1)  # K/V freed by the sweep
                alive = proc.poll() is None
                facts.update(node_alive=alive, seconds=round(elapsed, 1), rss_mb_before=round(before, 1),
                             rss_mb_right_after=round(peak, 1), rss_mb_settled=round(settled, 1) if settled else None,
                             settle_s=settle_s, rss_mb_after_idle_sweep=round(rss_mb(proc.pid), 1) if alive else None,
                             rss_split_mb_before=split_before, rss_split_mb_after_idle_sweep=split() if alive else None)
                out["attacks"][name] = facts
                print(name, json.dumps(facts), flush=True)

            async def predecessor_frames() -> dict:
                kinds: dict[str, int] = {}
                stream = await host.open_stream(coord.node_id, RING_PROTOCOL)
                for i in range(1, args.frames + 1):
                    kind, body = hostile_frame(rng, i, cfg, args.kinds)
                    kinds[kind] = kinds.get(kind, 0) + 1
                    await stream.send_frame(body)
                    if kind == "valid":
                        await stream.send_frame(encode(EndJob(job_id=f"h{i}", epoch=1)))
                _, answers = await coord.good_frame(stream, "sentinel-1")
                over_long = 0
                for _ in range(10):  # a length past the cap: the node resets the stream unread
                    s = await host.open_stream(coord.node_id, RING_PROTOCOL)
                    await s._stream.write(FRAME_PREFIX.pack(limits.max_frame_bytes + 1) + b"x" * 1024)
                    over_long += await wait_reset(s, 10)
                return {"frames_sent": args.frames, "by_kind": kinds,
                        "answered": {k: sum(isinstance(m, t) for m in answers) for k, t in
                                     (("Result", Result), ("JobError", JobError))},
                        "over_long_prefix_streams_reset": over_long}

            async def stranger_frames() -> dict:
                refused, strangers = 0, 0
                n = args.stranger_frames if args.stranger_frames is not None else max(args.frames // 5, 1)
                body = encode(forward("stranger", GOOD_IDS))
                big, big_refused = bytes(16 << 20), 0
                for first in range(0, n, STREAMS_PER_STRANGER):
                    async with open_host(keypair_from_seed(os.urandom(32))) as stranger:
                        strangers += 1
                        await stranger.connect(coord.node_addr)
                        for _ in range(min(STREAMS_PER_STRANGER, n - first)):
                            refused += await expect_refused(lambda: stranger.open_stream(coord.node_id, RING_PROTOCOL),
                                                            body)
                        if first + STREAMS_PER_STRANGER >= n:
                            for _ in range(8):
                                big_refused += await expect_refused(
                                    lambda: stranger.open_stream(coord.node_id, RING_PROTOCOL), big)
                leaked = []
                while True:
                    try:
                        leaked.append(coord.inbox.receive_nowait())
                    except trio.WouldBlock:
                        break
                return {"stranger_frames": n, "strangers": strangers, "refused": refused, "big_16mib_frames": 8,
                        "big_refused": big_refused, "answers_leaked_to_coordinator": len(leaked)}

            async def connection_flood() -> dict:
                ok, _ = await flood(coord.node_addr, coord.node_id, args.connections)
                async with open_host(keypair_from_seed(os.urandom(32))) as newcomer:
                    await newcomer.connect(coord.node_addr)
                    probe = await newcomer.open_stream(coord.node_id, PROBE_PROTOCOL)
                    with trio.fail_after(10):
                        rtt = (await measure_rtt(probe, 3)).min_s
                    await probe.aclose()
                return {"connections": args.connections, "accepted": ok, "newcomer_probe_rtt_ms": round(rtt * 1e3, 2)}

            async def never_ended_jobs() -> dict:
                stream = await host.open_stream(coord.node_id, RING_PROTOCOL)
                ids = [rng.randrange(cfg.vocab_size) for _ in range(64)]
                for j in range(args.jobs):
                    await stream.send_frame(encode(forward(f"open-{j}", ids)))
                results = 0
                with trio.fail_after(600):
                    while results < args.jobs:
                        msg = await coord.inbox.receive()
                        results += isinstance(msg, Result) and msg.job_id.startswith("open-")
                held = rss_mb(proc.pid)
                await trio.sleep(args.idle_timeout_s + min(args.idle_timeout_s / 4, 10) + 1)
                await stream.send_frame(encode(forward("open-0", [5], ctx=64)))  # a late frame of a freed job
                with trio.fail_after(60):
                    late = await coord.inbox.receive()
                return {"jobs": args.jobs, "prefill_tokens": 64, "rss_mb_holding_them": round(held, 1),
                        "late_frame_answer": f"{type(late).__name__}: {getattr(late, 'message', '')}"}

            async def slow_senders() -> dict:
                streams = []
                for _ in range(args.slow):
                    s = await host.open_stream(coord.node_id, RING_PROTOCOL)
                    await s._stream.write(FRAME_PREFIX.pack(1 << 20) + b"x" * 10)
                    streams.append(s)
                t0 = time.perf_counter()
                reset_at = []
                for s in streams:
                    ok = await wait_reset(s, 120)
                    reset_at.append(round(time.perf_counter() - t0, 1) if ok else None)
                return {"streams": args.slow, "announced_bytes": 1 << 20, "sent_bytes": 10,
                        "seconds_until_reset": reset_at}

            await attack("predecessor_hostile_frames", predecessor_frames)
            await attack("stranger_frames", stranger_frames)
            await attack("connection_flood", connection_flood)
            await attack("never_ended_jobs", never_ended_jobs, settle_s=1.0)
            await attack("slow_senders", slow_senders)
        finally:
            alive = proc.poll() is None
            out["process_deaths"] = 0 if alive else 1
            out["node_exit_code"] = proc.returncode
            if alive:
                proc.terminate()
                proc.wait(30)
            with open(log_path) as f:
                out["node_log_tail"] = f.read()[-2000:]
    return out


async def wait_reset(stream, timeout_s: float) -> bool:
    """True if the node resets (or closes) `stream` within timeout_s."""
    try:
        with trio.fail_after(timeout_s):
            await stream.recv_frame(1 << 20)
    except TransportError:
        return True
    except trio.TooSlowError:
        return False
    return False


def main() -> None:
    import logging

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # refused streams are the point, not news
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--frames", type=int, default=5000, help="hostile frames from the predecessor (strangers: a fifth)")
    p.add_argument("--stranger-frames", type=int, default=None, help="frames from strangers (default: a fifth of --frames)")
    p.add_argument("--connections", type=int, default=300, help="connections in the flood (past 250 slots)")
    p.add_argument("--jobs", type=int, default=30, help="never-ended jobs")
    p.add_argument("--idle-timeout-s", type=float, default=5.0, help="the node's --job-idle-timeout-s")
    p.add_argument("--slow", type=int, default=6, help="slow-sender streams")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", type=lambda v: tuple(v.split(",")), default=KINDS,
                   help=f"predecessor frame kinds, comma-separated (default: all of {','.join(KINDS)})")
    p.add_argument("--mmap-threshold-bytes", type=int, default=0,
                   help="MALLOC_MMAP_THRESHOLD_ for the node process (0: glibc's dynamic default)")
    args = p.parse_args()
    result = trio.run(run, args)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"process deaths: {result['process_deaths']}; wrote {args.json}")


if __name__ == "__main__":
    main()
