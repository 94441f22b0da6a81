"""Hostile clients and peers against a live ring and its gateway (issue 20, coordinator side).

This script runs the coordinator (SmolLM2-135M, receipts on, audits at their default
rate, no drafter) with its HTTP gateway, and three honest `shard-node join` processes
(1 torch thread each) seated as a 3-stage ring. Then, in order:
1. probation: greedy requests while the three are newcomers (every round recomputed by the
   coordinator before release) and after they earned their clean rounds, side by side;
2. HTTP: bodies announcing 100 MB and 10 GB (413 by Content-Length), chunked bodies past
   the limit (413 mid-stream), bodies shorter than announced (408 at the body deadline),
   and slowloris connections dripping headers (closed at the header deadline);
3. a stalling stage: a newcomer that computes every frame and forwards none; a request
   must resume without it, and it must be out of the ring within 10 s of the missed deadline;
4. a lying newcomer: adds noise to every output it computes (and signs it); then N
   requests, none of which may deliver a wrong token;
5. frames_warmup, then frames: hostile frames (`--warmup-frames`, then `--frames`, scripts.bench_hostile's mutations at the ring's epoch) into
   the middle stage from its predecessor's own identity (its key file), then valid frames
   from strangers, each on its own stream, all sent by scripts/bench_hostile_frames.py in a
   process of its own; every node's RSS before, right after, and once its idle-job sweep
   has run (`--idle-timeout-s`);
6. window_abuse: strangers write far past the middle stage's yamux windows on ring, probe
   and weights streams; replayed_assignment: stages get their old, signed assignments
   (after a node joined and left: a newer epoch) and each other's (scripts/hostile_ring_attacks.py);
7. a new honest node joins afterwards and is seated.
Every answer is compared with the honest ring's answer to the same greedy request. Per
attack: the coordinator's RSS before, right after and settled, and whether every node
process is alive. The hostile nodes run as this script's own subprocesses (`node`).

    python scripts/bench_hostile_ring.py --json OUT [--requests 100] [--tokens 8] [--frames 100000]
        [--attacks frames_warmup,frames,new_node_joins_afterwards]   (a subset, in this order)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts.bench_hostile import rss_mb  # noqa: E402
from scripts.bench_ringkit import base_conditions, cpu_s_over, rss_by_mapping_mb  # noqa: E402
from scripts.hostile_ring_attacks import (coordinator_flood, http, middle_stage_window_abuse, post_head,  # noqa: E402
                                          replayed_assignment)

MODEL = "smollm2-135m"
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow."}]


def node_main(kind: str, coordinator: str, key_path: str) -> None:
    """A hostile node: `stall` computes every frame and forwards none; `lie` adds noise of
    half a row's std to every output before it signs it."""
    import shard.join
    from shard.node import Node
    from shard.node_config import NodeConfig

    class Stalling(Node):
        async def _send_ring(self, state, body: bytes) -> None:
            await trio.sleep_forever()

    class Lying(Node):
        async def _assume(self, a):
            await super()._assume(a)
            stage = self.state.worker.stage
            honest, gen = stage.forward_batch, torch.Generator().manual_seed(0)

            def lying(frames):
                return [out if isinstance(out, Exception) else
                        (out[0] + 0.5 * out[0].std() * torch.randn(out[0].shape, generator=gen), out[1])
                        for out in honest(frames)]

            stage.forward_batch = lying

    shard.join.Node = {"stall": Stalling, "lie": Lying}[kind]
    trio.run(shard.join.run_node, NodeConfig(coordinator=coordinator, model=MODEL, key_path=key_path, torch_threads=1))


async def ask(client, tokens: int) -> tuple[str, float]:
    t0 = time.perf_counter()
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": PROMPT, "max_tokens": tokens,
                                                        "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"], time.perf_counter() - t0


async def run(args) -> dict:
    from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
    from coordinator.gateway.api import ApiConfig
    from coordinator.jobs.engine_config import EngineConfig
    from coordinator.swarm.formation import SwarmConfig
    from shard.store import open_or_prepare
    from transformers import AutoTokenizer

    store = await trio.to_thread.run_sync(open_or_prepare, MODEL, None)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    api = ApiConfig(port=0, body_timeout_s=args.body_timeout_s, header_timeout_s=args.header_timeout_s)
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3, swarm=SwarmConfig(planner="all_nodes", ready_timeout_s=120),
                         engine=EngineConfig(draft="none"), api=api)
    tmp = tempfile.mkdtemp(prefix="bench_hostile_ring_")
    out: dict = {"conditions": {**base_conditions(store), "process": "coordinator and gateway in this process; each node "
                                "a process of its own (shard-node join, 1 torch thread; hostile ones this script's "
                                "`node`)", "receipts": "signed by every stage, checked by the coordinator; audits at "
                                "the default rate", "ring": "3 honest stages (planner all_nodes: each node a stage)",
                                "drafter": "none", "prompt": PROMPT[0]["content"], "max_tokens": args.tokens,
                                "requests_with_the_liar": args.requests, "attacks_run": args.attacks,
                                "node_job_idle_timeout_s": args.idle_timeout_s,
                                "node_env": args.node_env, "max_body_bytes": api.max_body_bytes,
                                "body_timeout_s": api.body_timeout_s, "header_timeout_s": api.header_timeout_s},
                 "attacks": {}}

    nodes = Nodes(tmp, idle_timeout_s=args.idle_timeout_s, env=dict(kv.split("=", 1) for kv in args.node_env))
    try:
        return await serve_and_attack(args, config, store, tokenizer, api, out, nodes)
    finally:
        nodes.terminate_all()


@dataclasses.dataclass
class Nodes:
    """The node processes this script started: honest `shard-node join`s and its own
    hostile `node`s. `stopped`: those it ended itself (not deaths)."""

    tmp: str
    addr: str = ""
    procs: dict[str, subprocess.Popen] = dataclasses.field(default_factory=dict)
    stopped: set[str] = dataclasses.field(default_factory=set)
    idle_timeout_s: float = 30.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # more environment for every node

    def spawn(self, name: str, kind: str | None = None) -> None:
        key = os.path.join(self.tmp, f"{name}.key")
        cmd = ([sys.executable, "-m", "shard.cli", "join", "--model", MODEL, "--torch-threads", "1", "--log-level",
                "ERROR", "--key-path", key, "--coordinator", self.addr, "--job-idle-timeout-s", str(self.idle_timeout_s)]
               if kind is None else
               [sys.executable, os.path.abspath(__file__), "node", kind, self.addr, key])
        with open(os.path.join(self.tmp, f"{name}.log"), "w") as log_file:
            self.procs[name] = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                                env={**os.environ, "OMP_NUM_THREADS": "1", **self.env})

    def named(self) -> dict[str, str]:
        """peer id -> name, of every node started."""
        from shard.identity import load_or_create_identity, peer_id_of
        return {peer_id_of(load_or_create_identity(os.path.join(self.tmp, f"{n}.key"))): n for n in self.procs}

    def stop(self, name: str) -> None:
        self.procs[name].terminate()
        self.stopped.add(name)

    def alive(self) -> dict[str, bool]:
        return {name: p.poll() is None for name, p in self.procs.items()}

    def deaths(self) -> int:
        return sum(p.poll() is not None for name, p in self.procs.items() if name not in self.stopped)

    def terminate_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            p.wait(timeout=30)


async def hostile_frames(args, swarm, nodes: Nodes, frames: int, seed: int) -> dict:
    """`frames` hostile frames into the ring's second stage from its predecessor's own
    identity, then `args.stranger_frames` valid ones from strangers, sent by
    scripts/bench_hostile_frames.py in a process of its own (what the attackers allocate is
    not the coordinator's RSS); every node's RSS before, right after and after its idle sweep."""
    ring = swarm.ring
    (pred, _), (target, _) = ring.stages[0], ring.stages[1]
    key_of = nodes.named()
    pids = {n: p.pid for n, p in nodes.procs.items() if p.poll() is None}
    rss = lambda: {n: round(rss_mb(pid), 1) for n, pid in pids.items()}  # noqa: E731
    before, before_by_mapping = rss(), {n: rss_by_mapping_mb(pid) for n, pid in pids.items()}
    cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_hostile_frames.py"),
           "--key", os.path.join(nodes.tmp, f"{key_of[pred]}.key"), "--addr", swarm.members[target].register.listen_addrs[0],
           "--target", target, "--epoch", str(ring.epoch), "--frames", str(frames),
           "--stranger-frames", str(args.stranger_frames), "--seed", str(seed)]
    done = await trio.run_process(cmd, capture_stdout=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    sent = json.loads(done.stdout.decode().strip().splitlines()[-1])
    right_after, t0 = rss(), time.perf_counter()
    # The nodes work through the frames queued after the attackers stop (~30 s at load 8):
    # a job opened then is freed an idle timeout after that, and the sweep runs every
    # idle_timeout / 4 (10 s at most): a fixed wait could end inside that work.
    while time.perf_counter() - t0 < 300 and max([await cpu_s_over(pid, 2.0) for pid in pids.values()]) > 0.1:
        pass
    busy_s = time.perf_counter() - t0
    await trio.sleep(args.idle_timeout_s + min(args.idle_timeout_s / 4, 10) + 5)
    return {"predecessor_frames": frames, **sent, "target_stage": f"{key_of[target]} ({target[-6:]})",
            "predecessor": f"{key_of[pred]} ({pred[-6:]})", "node_rss_mb_before": before,
            "node_rss_mb_right_after": right_after, "node_busy_s_after_attackers": round(busy_s, 1),
            "node_rss_mb_after_idle_sweep": rss(), "node_rss_by_mapping_mb_before": before_by_mapping,
            "node_rss_by_mapping_mb_after_idle_sweep": {n: rss_by_mapping_mb(pid) for n, pid in pids.items()},
            "deaths_so_far": nodes.deaths()}


async def serve_and_attack(args, config, store, tokenizer, api, out: dict, nodes: Nodes) -> dict:
    import httpx

    from coordinator.assembly import open_coordinator
    from coordinator.gateway.api import serve_http
    from coordinator.gateway.operator import create_gateway
    from shard.identity import keypair_from_seed

    async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as c:
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
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
            reference, _ = await ask(client, args.tokens)
            out["conditions"]["reference_answer"] = reference
            me = os.getpid()

            async def attack(name: str, body, settle_s: float = 2.0) -> None:
                # The audits of the requests before it done and their replay slices handed back
                # (AuditConfig.slice_idle_s): what they load is not the attack's.
                with trio.move_on_after(config.audit.slice_idle_s + 30):
                    await c.auditor.wait_idle()
                    while c.auditor.slices_loaded:
                        await trio.sleep(1.0)
                before, t0 = rss_mb(me), time.perf_counter()
                facts = await body()
                facts.update(seconds=round(time.perf_counter() - t0, 2), rss_mb_before=round(before, 1),
                             rss_mb_right_after=round(rss_mb(me), 1))
                await trio.sleep(settle_s)
                answer, _ = await ask(client, args.tokens)
                facts.update(rss_mb_settled=round(rss_mb(me), 1), answer_after_equals_reference=answer == reference,
                             node_processes_alive=nodes.alive(), load_avg_1_5_15_at_end=[round(x, 2) for x in os.getloadavg()])
                out["attacks"][name] = facts
                print(name, json.dumps(facts), flush=True)

            async def probation_side_by_side() -> dict:
                during = [await ask(client, args.tokens) for _ in range(3)]
                while any(engine.clean_rounds.get(p, 0) < engine.probation.clean_rounds for p in honest):
                    during.append(await ask(client, args.tokens))
                after = [await ask(client, args.tokens) for _ in range(3)]
                return {"requests_on_probation": len(during), "requests_after": len(after),
                        "median_s_on_probation": sorted(t for _, t in during)[len(during) // 2],
                        "median_s_after": sorted(t for _, t in after)[1],
                        "all_equal_reference": all(a == reference for a, _ in during + after),
                        "clean_rounds": {p[-6:]: n for p, n in engine.clean_rounds.items()}}

            async def http_attacks() -> dict:
                facts: dict = {}
                async with trio.open_nursery() as n:
                    results: dict[str, list] = {k: [] for k in ("announced_100MB", "announced_10GB", "chunked_past_limit",
                                                                "short_body", "slowloris")}

                    async def one(kind: str, raw: bytes) -> None:
                        results[kind].append(await http(port, raw))

                    for _ in range(8):
                        n.start_soon(one, "announced_100MB", post_head(100 << 20) + b"x" * (1 << 20))
                        chunk = b"%x\r\n%s\r\n" % (1 << 20, b"x" * (1 << 20))
                        n.start_soon(one, "chunked_past_limit", post_head(chunked=True) + chunk * 10)
                    for _ in range(50):
                        n.start_soon(one, "announced_10GB", post_head(10 * 10**9))
                    for _ in range(20):
                        n.start_soon(one, "short_body", post_head(1000) + b'{"model": ')
                    for _ in range(100):
                        n.start_soon(one, "slowloris", b"POST /v1/chat/completions HTTP/1.1\r\nHost: b")
                for kind, rs in results.items():
                    facts[kind] = {"connections": len(rs), "statuses": sorted({str(s) for s, _ in rs}),
                                   "max_s_to_answer_or_close": round(max(t for _, t in rs), 2)}
                return facts

            async def stalling_stage() -> dict:
                nodes.spawn("staller", "stall")
                staller = (await ring_of(4)) - honest
                missed: list[float] = []
                blame = engine.round_missed

                def round_missed(ring, round_):
                    missed.append(trio.current_time())
                    blame(ring, round_)

                engine.round_missed = round_missed
                answer, took_s = await ask(client, args.tokens)
                engine.round_missed = blame
                out_at = trio.current_time()
                nodes.stop("staller")  # or it rejoins when its sit-out ends, into the next attack
                struck = [swarm.unreachable.table.get(p) for p in staller]
                return {"request_s": round(took_s, 2), "answer_equals_reference": answer == reference,
                        "staller_struck_as_stalled": all(s is not None and s.kind == "stalled" for s in struck),
                        "s_from_missed_deadline_to_served_without_it": round(out_at - missed[0], 2) if missed else None,
                        "exclusion": {p[-6:]: dataclasses.asdict(s) for p, s in swarm.unreachable.table.items()}}

            async def lying_newcomer() -> dict:
                before = set(swarm.members)
                nodes.spawn("liar", "lie")
                liar = (await ring_of(4)) - before
                answers = [await ask(client, args.tokens) for _ in range(args.requests)]
                wrong = sum(a != reference for a, _ in answers)
                return {"requests": len(answers), "wrong_answers_delivered": wrong,
                        "liar_faulty": [swarm.faulty.get(p) for p in liar]}

            async def newcomer_joins() -> dict:
                before = set(swarm.members)
                nodes.spawn("late_honest")
                seated = await ring_of(4)
                new = set(swarm.members) - before
                return {"new_node_registered": bool(new), "new_node_seated": bool(new & seated)}

            async def bump_epoch() -> None:  # a node joins and leaves: the same stages at a newer epoch
                nodes.spawn("epoch_bump")
                await ring_of(4)
                nodes.stop("epoch_bump")
                await ring_of(3)

            async def frames() -> dict:
                return await hostile_frames(args, swarm, nodes, args.frames, args.seed)

            async def frames_warmup() -> dict:  # first use of every path the attack takes, not counted against it
                return await hostile_frames(args, swarm, nodes, args.warmup_frames, args.seed + 1)

            attacks = {"probation_side_by_side": (probation_side_by_side, 2.0), "http": (http_attacks, args.header_timeout_s),
                       "stalling_stage": (stalling_stage, 2.0), "lying_newcomer": (lying_newcomer, 2.0),
                       "frames_warmup": (frames_warmup, 2.0), "frames": (frames, 2.0), "new_node_joins_afterwards": (newcomer_joins, 2.0),
                       "coordinator_flood": (lambda: coordinator_flood(c.addr, args.connections), 2.0),
                       "window_abuse": (lambda: middle_stage_window_abuse(swarm, nodes, args.abuse_streams, args.abuse_mib << 20), 2.0),
                       "replayed_assignment": (lambda: replayed_assignment(swarm, bump_epoch), 2.0)}
            for name in args.attacks.split(","):
                await attack(name, *attacks[name])
        out["process_deaths"] = nodes.deaths()
        c.nursery.cancel_scope.cancel()
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--requests", type=int, default=100, help="greedy requests while the liar is a newcomer")
    p.add_argument("--tokens", type=int, default=8, help="max_tokens of every request")
    p.add_argument("--body-timeout-s", type=float, default=5.0)
    p.add_argument("--header-timeout-s", type=float, default=5.0)
    p.add_argument("--frames", type=int, default=10_000, help="hostile frames from the predecessor (the issue's: 100000)")
    p.add_argument("--stranger-frames", type=int, default=1_000, help="frames from strangers, each on its own stream")
    p.add_argument("--seed", type=int, default=0, help="of the hostile frames' mutations")
    p.add_argument("--warmup-frames", type=int, default=3_000, help="hostile frames of frames_warmup (another seed)")
    p.add_argument("--idle-timeout-s", type=float, default=30.0, help="the honest nodes' --job-idle-timeout-s")
    p.add_argument("--node-env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every node's environment (repeatable), e.g. MALLOC_ARENA_MAX=1")
    p.add_argument("--connections", type=int, default=1000, help="connections in the coordinator_flood attack")
    p.add_argument("--abuse-streams", type=int, default=4, help="window_abuse: streams per protocol, a fresh identity each")
    p.add_argument("--abuse-mib", type=int, default=64, help="window_abuse: MiB written past the window per stream")
    p.add_argument("--attacks", default="probation_side_by_side,http,stalling_stage,lying_newcomer,frames_warmup,frames,"
                                        "coordinator_flood,window_abuse,replayed_assignment,new_node_joins_afterwards",
                   help="which to run, in order")
    args = p.parse_args(argv)
    if unknown := set(args.attacks.split(",")) - set(p.get_default("attacks").split(",")):
        p.error(f"--attacks: unknown {sorted(unknown)}; known: {p.get_default('attacks')}")
    return args


def main() -> None:
    if sys.argv[1:2] == ["node"]:
        node_main(*sys.argv[2:5])
        return
    args = parse_args()
    out = trio.run(run, args)  # its node processes are ended on the way out, whatever happens
    with open(args.json, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
