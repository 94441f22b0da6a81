"""Cost of receipts and audits on a real in-process ring (3 libp2p nodes on loopback).

Runs the same greedy requests on two rings side by side in one process: receipts off
(nodes do not sign, the coordinator checks nothing) and receipts on with audits at the
given rate. Prints and writes (--json) ring tok/s for both, stage compute per frame, and
audit replay seconds against the ring's compute (sum of every stage's compute_s).

    python scripts/bench_receipts_ring.py --json OUT [--model smollm2-135m] [--requests 4] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.audit import AuditConfig, Auditor  # noqa: E402
from coordinator.engine import encode_chat  # noqa: E402
from coordinator.receipt_check import ReceiptChecker  # noqa: E402
from coordinator.ring_engine import EngineConfig, RingEngine  # noqa: E402
from coordinator.sampling import SamplingParams  # noqa: E402
from coordinator.swarm import Swarm, SwarmConfig  # noqa: E402
from shard.identity import keypair_from_seed  # noqa: E402
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402
from shard.transport import open_host  # noqa: E402

PROMPT = "Explain in two sentences why the sky is blue."


async def _host(seed, task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(keypair_from_seed(seed), "/ip4/127.0.0.1/tcp/0") as host:
        task_status.started(host)
        await trio.sleep_forever()


async def run(store, tokenizer, *, receipts: bool, rate: float, requests: int, tokens: int, wire_dtype: str) -> dict:
    seed = os.urandom(32)
    swarm = Swarm(store, seed, SwarmConfig(min_nodes=3, wire_dtype=wire_dtype))
    checker = ReceiptChecker(store, seed) if receipts else None
    auditor = Auditor(swarm, store, seed, AuditConfig(rate=rate))
    if checker is not None:
        checker.listeners.append(auditor.submit_nowait)
    compute = {"s": 0.0, "frames": 0}
    async with open_host(keypair_from_seed(seed), "/ip4/127.0.0.1/tcp/0") as host:
        engine = RingEngine(swarm, host, tokenizer, EngineConfig(), receipts=checker)
        deliver = engine._deliver

        def counting(msg):  # the ring's compute: every stage's compute_s on every Result
            compute["s"] += sum(getattr(msg, "compute_s", ()))
            compute["frames"] += len(getattr(msg, "compute_s", ()))
            deliver(msg)

        engine._deliver = counting
        host.set_handler(CONTROL_PROTOCOL, swarm.handle_control)
        host.set_handler(RING_PROTOCOL, engine.handle_ring_stream)
        async with trio.open_nursery() as nursery:
            await nursery.start(swarm.serve_formation)
            await nursery.start(auditor.serve)
            for _ in range(3):
                s = os.urandom(32)
                node_host = await nursery.start(_host, s)
                node = Node(NodeConfig(coordinator=host.addrs[0], receipts=receipts), node_host, store, signing_seed=s)
                await nursery.start(node.serve)
            await swarm.wait_ring()
            ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
            generated, started = 0, time.perf_counter()
            for _ in range(requests):
                job = await engine.open_job(ids, SamplingParams(temperature=0.0))
                async for block in job.next_tokens():
                    generated += len(block)
                    if generated % tokens == 0:
                        break
                await job.aclose()
            elapsed = time.perf_counter() - started
            await auditor.wait_idle()
            nursery.cancel_scope.cancel()
    return {"receipts": receipts, "tok_per_s": generated / elapsed, "generated": generated, "elapsed_s": elapsed,
            "ring_compute_s": compute["s"], "stage_frames": compute["frames"],
            "stage_ms_per_frame": 1e3 * compute["s"] / max(compute["frames"], 1),
            "audits": auditor.stats.audits, "audit_frames_compared": auditor.stats.frames_compared,
            "audit_replay_s": auditor.stats.replay_s, "audit_over_ring_compute": auditor.stats.replay_s / max(compute["s"], 1e-9),
            "evidence": len(auditor.evidence)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--rate", type=float, default=AuditConfig.rate)
    p.add_argument("--wire-dtype", default="f32")
    args = p.parse_args()
    from transformers import AutoTokenizer

    store = open_or_prepare(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    kw = dict(rate=args.rate, requests=args.requests, tokens=args.tokens, wire_dtype=args.wire_dtype)
    off = trio.run(lambda: run(store, tokenizer, receipts=False, **kw))
    on = trio.run(lambda: run(store, tokenizer, receipts=True, **kw))
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    conditions = {"model": store.manifest.name, "stages": 3, "requests": args.requests, "tokens_per_request": args.tokens,
                  "prompt": PROMPT, "wire_dtype": args.wire_dtype, "audit_rate": args.rate, "link": "loopback, no emulation",
                  "drafter": "engine default", "git": rev, "python": platform.python_version(), "machine": platform.machine(),
                  "omp_threads": os.environ.get("OMP_NUM_THREADS", "default"), "cpus": os.cpu_count()}
    result = {"conditions": conditions, "off": off, "on": on,
              "tok_per_s_cost": 1 - on["tok_per_s"] / off["tok_per_s"],
              "stage_time_cost": on["stage_ms_per_frame"] / off["stage_ms_per_frame"] - 1}
    print(json.dumps(result, indent=2))
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
