"""What the stages' audit frame logs hold under load, sampled every 10 s (issue 21: RSS flat).

An in-process ring (coordinator swarm + engine + auditor and three Nodes, each its own
libp2p host on loopback; SmolLM2-135M f32, 10 layers a stage, receipts on, audits at
--audit-rate, no drafter) serves C closed-loop greedy clients for --seconds (prompts of
~100-470 tokens, --new-tokens each), and every 10 s records each stage's FrameLog bytes
and (job, epoch) entries, the jobs done and the audits run; then once more 5 s after the
last job ended. Frame logs live inside the node processes, so this reads them in-process:
a stage that keeps every ended job for FrameLogConfig.grace_s (300 s) grows here by its
share of each finished job; one whose frames the coordinator releases (ReleaseFrames) holds
its running jobs' frames and those awaiting an audit. It runs at any revision with this
API (to compare before and after a change, run it at each). The 2 cores are shared:
the load average is recorded with the figures.

    python scripts/bench_frame_logs.py --json OUT [--seconds 90] [--clients 8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shard.heap import bound_kernel_caches, fix_mmap_threshold  # noqa: E402

bound_kernel_caches()  # before torch is imported (shard.heap)
fix_mmap_threshold()

import torch  # noqa: E402
import trio  # noqa: E402

from coordinator.assembly import open_coordinator  # noqa: E402
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig  # noqa: E402
from coordinator.jobs.engine import encode_chat  # noqa: E402
from coordinator.jobs.engine_config import EngineConfig  # noqa: E402
from coordinator.spec.sampling import SamplingParams  # noqa: E402
from coordinator.swarm.formation import SwarmConfig  # noqa: E402
from coordinator.trust.audit import AuditConfig  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from scripts.bench_ringkit import git_revision  # noqa: E402
from shard.identity import keypair_from_seed  # noqa: E402
from shard.node import Node, NodeConfig  # noqa: E402
from shard.store import ModelStore, default_store_dir, prepare  # noqa: E402
from shard.transport import open_host  # noqa: E402
from tests.e2e.ringkit import memory_for_stages  # noqa: E402

SAMPLE_S = 10.0
PROMPT_WORDS = (60, 120, 250, 400)  # of the long passage, then a question: ~100-470 tokens


async def _serve_host(seed, task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(keypair_from_seed(seed), "/ip4/127.0.0.1/tcp/0") as host:
        task_status.started(host)
        await trio.sleep_forever()


async def run(store: ModelStore, tokenizer, args) -> list[dict]:
    words = spec_prompts.long_text().split()
    prompts = [encode_chat(tokenizer, spec_prompts.messages(" ".join(words[:n]) + f"\n\nSummarise this ({i})."))
               for i, n in enumerate(PROMPT_WORDS)]
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3, swarm=SwarmConfig(ready_timeout_s=120, planner="all_nodes"),
                         engine=EngineConfig(draft="none", probation_rounds=0), audit=AuditConfig(rate=args.audit_rate))
    samples: list[dict] = []
    async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32)),
                                audit_rng=random.Random(0)) as coord:
        nodes = []
        for _ in range(3):
            seed = os.urandom(32)
            host = await coord.nursery.start(_serve_host, seed)
            node = Node(NodeConfig(coordinator=coord.addr, max_memory_bytes=memory_for_stages(store, 3)), host, store,
                        signing_seed=seed)
            await coord.nursery.start(node.serve)
            nodes.append(node)
        while coord.swarm.ring is None or len(coord.swarm.ring.stages) < 3:
            await coord.swarm.wait_ring()
        order = [next(n for n in nodes if n.host.peer_id == p) for p, _ in coord.swarm.ring.stages]  # head first
        done, t0 = [0], trio.current_time()

        async def client(i: int) -> None:
            k = i
            while trio.current_time() - t0 < args.seconds:
                job = await coord.engine.open_job(prompts[k % len(prompts)], SamplingParams(temperature=0.0))
                k, got = k + 1, 0
                try:
                    async for block in job.next_tokens():
                        got += len(block)
                        if got >= args.new_tokens:
                            break
                finally:
                    await job.aclose()
                done[0] += 1

        def sample(note: str = "") -> None:
            s = {"t_s": round(trio.current_time() - t0, 1), "jobs_done": done[0],
                 "frame_log_mb": [round(n.frame_log.nbytes / 2**20, 2) for n in order],
                 "frame_log_entries": [len(n.frame_log._jobs) for n in order],
                 "audits": coord.auditor.stats.audits, "load_average": round(os.getloadavg()[0], 1), "note": note}
            samples.append(s)
            print(s, flush=True)

        async def sampler() -> None:
            while True:
                sample()
                await trio.sleep(SAMPLE_S)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            async with trio.open_nursery() as clients:
                for i in range(args.clients):
                    clients.start_soon(client, i)
            await trio.sleep(5)
            sample("5 s after the last job ended")
            nursery.cancel_scope.cancel()
        coord.nursery.cancel_scope.cancel()
    return samples


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--seconds", type=float, default=90.0, help="clients start new jobs for this long")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--audit-rate", type=float, default=AuditConfig.rate)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    out_dir = default_store_dir("smollm2-135m")
    prepare("smollm2-135m", out_dir, progress=False)
    store = ModelStore.open(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    conditions = {"model": "smollm2-135m", "ring": "3 in-process Nodes (10 layers each, f32 wire, 1 torch thread in "
                  "all), receipts on, no drafter", "audit_rate": args.audit_rate, "clients": args.clients,
                  "seconds": args.seconds, "new_tokens": args.new_tokens, "prompt_words": PROMPT_WORDS,
                  "frame_log_mb": "per stage, head first", "git_revision": git_revision(), "cpus": os.cpu_count(),
                  "started_load_average": list(os.getloadavg())}
    samples = trio.run(run, store, tokenizer, args)
    conditions["ended_load_average"] = list(os.getloadavg())
    result = {"conditions": conditions, "samples": samples}
    last = samples[-1]
    print(f"{last['jobs_done']} jobs at C={args.clients}: frame logs {last['frame_log_mb']} MB "
          f"({last['frame_log_entries']} entries) 5 s after the last job; the most held "
          f"{[max(s['frame_log_mb'][i] for s in samples) for i in range(3)]} MB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
