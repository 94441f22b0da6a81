"""Probation through verifier nodes on a gateway that holds no layers (issue 20).

The coordinator and its HTTP gateway run in this process on a copy of the model's store
without its layer files (SmolLM2-135M: manifest, tokenizer, embedding and head only), so it
cannot recompute any slice: a newcomer's rounds are checked before release by the other
nodes (coordinator.trust.round_verifier). Three honest `shard-node join` processes (1
torch thread each) form a 3-stage ring: the first with a key the operator lists
(`--trusted-nodes`: only a trusted recomputation earns a newcomer credit), the other two
newcomers it verifies (a newcomer's agreeing check vouches for nothing).
Then, in order:
1. the price: greedy 8-token chat requests while the three are on probation (each round's
   frames of every stage replayed by a verifier node before release) until they have
   earned their clean rounds, then `--after` requests with nobody on probation; medians;
2. a lying newcomer (scripts/bench_hostile_ring.py's `node lie`: noise of half a row's std
   on every output, signed) joins as a fourth stage; then `--requests` requests, each
   compared with the honest ring's answer: wrong answers delivered (target 0 over 100).
Only this case runs (bench_hostile_ring runs the rest of issue 20's attacks).

    python scripts/bench_probation_verifiers.py --json OUT [--requests 100] [--tokens 8] [--after 5]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_hostile import rss_mb  # noqa: E402
from scripts.bench_hostile_ring import MODEL, PROMPT, Nodes, ask  # noqa: E402
from scripts.bench_ringkit import base_conditions  # noqa: E402


def layerless_copy(store, tmp: str):
    """The store's files linked into `tmp` without its layer files: a gateway holding no layer."""
    from shard.manifest import layer_file
    from shard.store import ModelStore

    root = os.path.join(tmp, "gateway-store")
    shutil.copytree(store.root, root, copy_function=os.symlink)
    for i in range(store.num_layers):
        os.unlink(os.path.join(root, layer_file(i)))
    return ModelStore.open(root)


async def run(args) -> dict:
    import httpx
    from transformers import AutoTokenizer

    from coordinator.assembly import open_coordinator
    from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
    from coordinator.gateway.api import ApiConfig, serve_http
    from coordinator.gateway.operator import create_gateway
    from coordinator.jobs.engine_config import EngineConfig
    from coordinator.swarm.formation import SwarmConfig
    from shard.identity import keypair_from_seed, load_or_create_identity, peer_id_of
    from shard.store import open_or_prepare

    store = await trio.to_thread.run_sync(open_or_prepare, MODEL, None)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    tmp = tempfile.mkdtemp(prefix="bench_probation_verifiers_")
    gateway_store = layerless_copy(store, tmp)
    api = ApiConfig(port=0)
    trusted = peer_id_of(load_or_create_identity(os.path.join(tmp, "honest0.key")))  # Nodes.spawn's key path
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3, swarm=SwarmConfig(planner="all_nodes", ready_timeout_s=120),
                         engine=EngineConfig(draft="none", trusted_nodes=(trusted,)), api=api)
    out: dict = {"conditions": {
        **base_conditions(store), "gateway_store": "the model's store without its layer files (it cannot recompute)",
        "process": "coordinator and gateway in this process; each node a process of its own (shard-node join, 1 torch "
                   "thread; the liar bench_hostile_ring's `node lie`)",
        "receipts": "signed by every stage, checked by the coordinator; audits at the default rate",
        "ring": "3 honest stages (planner all_nodes: each node a stage; honest0's key listed with --trusted-nodes), "
                "the liar a fourth",
        "drafter": "none", "prompt": PROMPT[0]["content"], "max_tokens": args.tokens,
        "probation_clean_rounds": config.engine.probation_rounds}}
    nodes = Nodes(tmp)
    try:
        async with open_coordinator(config, gateway_store, tokenizer, keypair_from_seed(os.urandom(32))) as c:
            swarm, engine = c.swarm, c.engine
            port = await c.nursery.start(lambda task_status: serve_http(create_gateway(engine, api), "127.0.0.1", 0,
                                                                        header_timeout_s=api.header_timeout_s,
                                                                        task_status=task_status))
            nodes.addr = c.addr
            for i in range(3):
                nodes.spawn(f"honest{i}")

            async def ring_of(count: int, timeout_s: float = 300) -> set:
                with trio.fail_after(timeout_s):
                    while swarm.ring is None or len(swarm.ring.stages) != count:
                        await (swarm.wait_ring() if swarm.ring is None else swarm.wait_change(swarm.ring.epoch, 5))
                return {p for p, _ in swarm.ring.stages}

            honest = await ring_of(3)
            verifier = engine.round_verifier
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
                during = [await ask(client, args.tokens)]
                reference = during[0][0]
                while engine.on_probation(swarm.ring):
                    during.append(await ask(client, args.tokens))
                checks_on_probation = verifier.checks
                info_on_probation = engine.info()["probation"]
                after = [await ask(client, args.tokens) for _ in range(args.after)]
                out["price"] = {
                    "requests_on_probation": len(during), "requests_after": len(after),
                    "median_s_on_probation": round(statistics.median(t for _, t in during), 3),
                    "median_s_after": round(statistics.median(t for _, t in after), 3),
                    "stage_checks_by_verifier_nodes": checks_on_probation, "checks_after": verifier.checks - checks_on_probation,
                    "all_equal_reference": all(a == reference for a, _ in during + after),
                    "gateway_shadow_on": engine.shadow is not None, "v1_ring_probation": info_on_probation,
                    "load_avg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()]}
                print("price", json.dumps(out["price"]), flush=True)
                out["conditions"]["reference_answer"] = reference

                before, rss_before, t0 = set(swarm.members), rss_mb(os.getpid()), time.perf_counter()
                nodes.spawn("liar", "lie")
                liar = (await ring_of(4)) - before
                answers = [await ask(client, args.tokens) for _ in range(args.requests)]
                out["lying_newcomer"] = {
                    "requests": len(answers), "wrong_answers_delivered": sum(a != reference for a, _ in answers),
                    "liar_faulty": [swarm.faulty.get(p) for p in liar], "catches": verifier.catches,
                    "evidence_signed": len(c.receipts.evidence), "honest_faulty": [p[-6:] for p in honest if p in swarm.faulty],
                    "first_request_s": round(answers[0][1], 3),
                    "median_s": round(statistics.median(t for _, t in answers), 3),
                    "seconds": round(time.perf_counter() - t0, 1), "gateway_rss_mb_before": round(rss_before, 1),
                    "gateway_rss_mb_after": round(rss_mb(os.getpid()), 1),
                    "load_avg_1_5_15_at_end": [round(x, 2) for x in os.getloadavg()]}
                print("lying_newcomer", json.dumps(out["lying_newcomer"]), flush=True)
            out["process_deaths"] = nodes.deaths()
            c.nursery.cancel_scope.cancel()
    finally:
        nodes.terminate_all()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--requests", type=int, default=100, help="greedy requests once the liar joined")
    p.add_argument("--tokens", type=int, default=8, help="max_tokens of every request")
    p.add_argument("--after", type=int, default=5, help="requests once nobody is on probation")
    args = p.parse_args()
    out = trio.run(run, args)
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
