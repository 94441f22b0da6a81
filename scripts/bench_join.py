"""How long a node takes to join and serve, measured on emulated links (issue 24).

One function per measurement, each starting its own in-process coordinator and real
nodes (libp2p on loopback, uploads shaped by shard.linkemu as in the ring benchmarks),
and `main` runs each in turn and writes one JSON with the conditions:

- `join_from_seeders(args, seeders)`: a node with an empty store joins a ring that needs
  it: from `shard-node join --fetch-weights` (the coordinator's signed manifest) until the
  ring it serves on is formed, and then its first token; the fetch part measured against
  the prediction the coordinator made from ring.churn.fetch_seconds for the sources it
  handed out. "From one seeder": the only other node (a stage) holds the model; "from
  three": two more nodes that hold the model but no memory for a layer stand off the ring.
  Every run seats the newcomer as the tail (its slice is layers only; see join_from_seeders).

- `stage_death(args, with_standby)`: a greedy request streams on SmolLM2 over two stages of
  15 layers; after a few tokens a stage is killed (its host closes) and the time from the
  kill to the next token is measured (tests/e2e/test_standby_ring.death_to_next_token).
  With a standby: four nodes, every stage has a hot standby keeping its slice warm, and
  the killed stage's takes over without loading anything. Without: three nodes, the
  killed stage has none (the spare stands by for the other stage), so re-selection seats
  a node that must load the slice (from its own disk here: weights are local).

Add a measurement by writing one more function of `args` that returns a dict, and naming
it in MEASUREMENTS.

  .venv/bin/python scripts/bench_join.py --json docs/results/bench_join.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import trio  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from coordinator.assembly import open_coordinator  # noqa: E402
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig  # noqa: E402
from coordinator.jobs.engine_config import EngineConfig  # noqa: E402
from coordinator.swarm.formation import SwarmConfig  # noqa: E402
from coordinator.swarm.topology import TopologyConfig, model_spec  # noqa: E402
from coordinator.trust.receipt_check import ReceiptConfig  # noqa: E402
from shard.identity import keypair_from_seed  # noqa: E402
from shard.manifest import slice_files  # noqa: E402
from shard.node import Node, NodeConfig  # noqa: E402
from shard.store import ModelStore, default_store_dir, prepare  # noqa: E402
from shard.transport import open_host  # noqa: E402
from shard.weight_fetch import open_fetched_store  # noqa: E402
from shard.weight_plan import WeightsConfig  # noqa: E402
from tests.e2e.ringkit import generate_greedy, open_local_ring  # noqa: E402
from tests.e2e.test_standby_ring import TAKEOVER_ENGINE, death_to_next_token  # noqa: E402

PROMPT = [1, 504, 3458, 282, 260, 2657, 4365, 30]  # a few SmolLM2 token ids


def per_layer_memory(store: ModelStore) -> tuple[int, int]:
    """(one layer with the K/V of the selector's workload: what `max_memory_bytes` must
    hold per layer for the selector to seat it, the embedding a head stage holds besides)
    (as tests/e2e/ringkit.memory_for_stages)."""
    topo = TopologyConfig()
    spec = model_spec(store, "f32", topo.kv_bytes_per_value)
    return spec.bytes_per_layer + spec.kv_bytes_per_token_layer * (topo.prompt_tokens + topo.output_tokens), spec.head_bytes


async def _join(store: ModelStore, args: argparse.Namespace, seeders: int) -> dict:
    per_layer, head = per_layer_memory(store)
    newcomer_layers = args.newcomer_layers
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=1, swarm=SwarmConfig(),
                         engine=EngineConfig(draft="none"), receipts=ReceiptConfig(enabled=False))
    shaped = {"link_upload_mbps": args.uplink_mbps}
    # The anchor fits every layer but the newcomer's; the extra seeders fit none (they hold
    # the model on disk only), so the one ring is anchor + newcomer.
    holders = [{"max_memory_bytes": per_layer * (store.num_layers - newcomer_layers) + per_layer // 2 + head, **shaped}]
    holders += [{"max_memory_bytes": per_layer // 2, **shaped}] * (seeders - 1)
    with tempfile.TemporaryDirectory(prefix="bench_join_") as empty:
        async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as coordinator:

            ids: list[str] = []

            async def run(node_config: dict, full: bool, task_status=trio.TASK_STATUS_IGNORED) -> None:
                async with open_host(keypair_from_seed(os.urandom(32))) as host:
                    ids.append(host.peer_id)
                    node_store = store if full else await open_fetched_store(host, coordinator.addr, empty)
                    node = Node(NodeConfig(coordinator=coordinator.addr, model=store.manifest.name, **node_config),
                                host, node_store)
                    await node.serve(task_status=task_status)  # started once registered

            for h in holders:
                await coordinator.nursery.start(run, h, True)
            t0 = time.perf_counter()
            await coordinator.nursery.start(run, {"max_memory_bytes": per_layer * newcomer_layers + per_layer // 2},
                                            False)
            newcomer = ids[-1]
            registered_s = time.perf_counter() - t0
            with trio.fail_after(args.timeout_s):
                while True:
                    ring = await coordinator.swarm.wait_ring()
                    if newcomer in dict(ring.stages):
                        break
                    await coordinator.swarm.wait_change(ring.epoch, args.timeout_s)
            serving_s = time.perf_counter() - t0
            tokens = await generate_greedy(coordinator.engine, PROMPT, 4)
            first_token_s = time.perf_counter() - t0
            (fetch,) = [f for f in coordinator.swarm.fetches.summary() if f["peer"] == newcomer]
            layers = dict(ring.stages)[newcomer]
            regs = {p: m.register for p, m in coordinator.swarm.members.items()}
            # What the prediction was made from: the sources' measured uploads (their token
            # buckets run at the seeding share of these) and the newcomer's measured download.
            inputs = {"source_uploads_mb_per_s": sorted((round(regs[p].upload_bytes_per_s / 1e6, 2)
                                                         for p in fetch["by_source"]), reverse=True),
                      "newcomer_download_mb_per_s": round(regs[newcomer].download_bytes_per_s / 1e6, 2)}
    slice_bytes = sum(store.manifest.files[f].bytes for f in slice_files(layers))
    return {
        "seeders": seeders,
        "newcomer_layers": [layers.start, layers.end],
        "newcomer_is_head": layers.start == 0,  # then its slice includes the embedding file
        "slice_files": len(slice_files(layers)),
        "slice_bytes": slice_bytes,
        "fetched_bytes": fetch["bytes"],
        "by_source_bytes": sorted(fetch["by_source"].values(), reverse=True),
        "registered_s": round(registered_s, 2),  # manifest fetched, compute timed, registered
        "nothing_to_serving_s": round(serving_s, 2),  # ... the ring it serves on formed
        "nothing_to_first_token_s": round(first_token_s, 2),
        "fetch_measured_s": round(fetch["measured_s"], 2),
        "fetch_predicted_s": round(fetch["predicted_s"], 2) if fetch["predicted_s"] is not None else None,
        "fetch_measured_over_predicted": round(fetch["measured_s"] / fetch["predicted_s"], 3)
        if fetch["predicted_s"] else None,
        "fetch_measured_mb_per_s": round(fetch["bytes"] / fetch["measured_s"] / 1e6, 2),
        "prediction_inputs": inputs,
        "tokens": tokens,
    }


def join_from_seeders(args: argparse.Namespace, seeders: int) -> dict:
    """The newcomer's place in the ring is a tie the selector breaks on measured latencies'
    noise (the two orders cost the same), and as the head its slice also holds the embedding
    (113 MB on SmolLM2, as much as its 8 layers): a run that seats it as the head is run
    again, up to `--tries`, so that every scenario fetches the same kind of slice."""
    store = prepare(args.model, default_store_dir(args.model), progress=False).store
    for attempt in range(1, args.tries + 1):
        result = trio.run(_join, store, args, seeders)
        if not result["newcomer_is_head"]:
            break
        print(f"  run {attempt}: seated as the head (slice with the embedding); running again", flush=True)
    return {**result, "runs": attempt}


def stage_death(args: argparse.Namespace, with_standby: bool) -> dict:
    """Seconds from a stage's death to the next token, with or without a hot standby for it."""
    store = prepare(args.model, default_store_dir(args.model), progress=False).store
    per_layer, head = per_layer_memory(store)
    node_config = {"max_memory_bytes": per_layer * -(-store.num_layers // 2) + per_layer // 2 + head,
                   "link_upload_mbps": args.uplink_mbps}

    async def run() -> dict:
        async with open_local_ring(store, 4 if with_standby else 3, engine=TAKEOVER_ENGINE,
                                   node_config=node_config) as ring:
            with trio.fail_after(args.timeout_s):
                return await death_to_next_token(ring, PROMPT, tokens=32, kill_after=8, with_standby=with_standby)

    return trio.run(run)


MEASUREMENTS = {
    "join_from_1_seeder": lambda args: join_from_seeders(args, 1),
    "join_from_3_seeders": lambda args: join_from_seeders(args, 3),
    "stage_death_with_standby": lambda args: stage_death(args, True),
    "stage_death_without_standby": lambda args: stage_death(args, False),
}


def conditions(args: argparse.Namespace) -> dict:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    return {"model": args.model, "seeder_uplink_mbps": args.uplink_mbps, "newcomer_layers": args.newcomer_layers,
            "tries": args.tries,
            "seed_upload_share": WeightsConfig().seed_upload_share, "links": "loopback, uploads shaped by "
            "shard.linkemu (no added latency); downloads unshaped", "wire": "f32", "drafter": "none",
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
            "git": rev}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--uplink-mbps", type=float, default=50.0, help="each seeder's emulated upload")
    p.add_argument("--newcomer-layers", type=int, default=8, help="layers the newcomer's memory holds")
    p.add_argument("--tries", type=int, default=4, help="runs of a measurement at most, until the newcomer is "
                                                          "not seated as the head")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--only", nargs="*", choices=sorted(MEASUREMENTS), help="run only these measurements")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("shard.weights").setLevel(logging.INFO)  # the fetch's progress lines
    out = {"conditions": conditions(args)}
    for name, measure in MEASUREMENTS.items():
        if args.only and name not in args.only:
            continue
        print(f"{name} ...", flush=True)
        out[name] = measure(args)
        print(json.dumps(out[name]), flush=True)
    out["conditions"]["load_after"] = round(os.getloadavg()[0], 1)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
