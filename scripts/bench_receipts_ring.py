"""Cost of receipts and audits on real in-process rings (libp2p on loopback), side by side.

Two rings run in one process, each a coordinator (swarm + engine) and 3 nodes over the
same model: "off" (nodes do not sign or log frames, the coordinator checks nothing) and
"on" (every frame signed and logged, every round's chain checked, bundles signed). Requests
alternate between them, for each drafter, in ABBA order (the order flips every
repetition, so drift in the machine's load falls on both sides), and each figure is the
median over repetitions of a paired on/off ratio, with its spread (min, max).

Measured directly as well, since the ring's tok/s on a loaded machine is noisy:
- receipts' share of stage time: seconds in the stage's signer per frame (SHA-256 of the
  received and sent canonical bytes, frame log, Ed25519, encoding) over the stage's
  compute_s for the same frames;
- the coordinator's checking per round (chain verify, digests, bundle) over the ring's
  compute for the round.
Each "on" job is audited right after it finishes, before the next request starts (so
audits do not compete with requests for the CPU): every (job, stage) (rate 1), giving the
replay's cost as a fraction of the ring compute it checks; the expected cost at rate p is
p times that. The same job is audited again replaying one frame per forward, to show
what batching saves.

    python scripts/bench_receipts_ring.py --json OUT [--reps 6] [--tokens 48] [--wire-dtype f32]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import shard.node  # noqa: E402
from coordinator.trust.audit import AuditConfig, Auditor  # noqa: E402
from coordinator.jobs.engine import encode_chat  # noqa: E402
from coordinator.trust.receipt_check import ReceiptChecker  # noqa: E402
from coordinator.jobs.ring_engine import EngineConfig, RingEngine  # noqa: E402
from coordinator.spec.sampling import SamplingParams  # noqa: E402
from coordinator.swarm.swarm import REPORT_BUFFER, Swarm, SwarmConfig  # noqa: E402
from shard.identity import keypair_from_seed  # noqa: E402
from shard.node import CONTROL_PROTOCOL, RING_PROTOCOL, Node, NodeConfig  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402
from shard.transport import open_host  # noqa: E402

PROMPT = "List the days of the week, then the months of the year, one per line."
DRAFTERS = ("none", "ngram")
STAGES = 3

# Seconds each stage spent in its receipt signer, summed over all rings (the bench's
# instrumentation, installed by wrapping the node's signer factory).
SIGN_S = {"s": 0.0, "frames": 0}


def _timed_make_signer(make):
    def make_timed(*args, **kw):
        sign = make(*args, **kw)

        def timed(*args):
            t0 = time.perf_counter()
            try:
                return sign(*args)
            finally:
                SIGN_S["s"] += time.perf_counter() - t0
                SIGN_S["frames"] += 1
        return timed
    return make_timed


shard.node.make_signer = _timed_make_signer(shard.node.make_signer)


async def _host(seed, task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(keypair_from_seed(seed), "/ip4/127.0.0.1/tcp/0") as host:
        task_status.started(host)
        await trio.sleep_forever()


class Ring:
    """One coordinator + STAGES nodes; counts the ring's compute and the coordinator's checking."""

    def __init__(self, store, tokenizer, receipts: bool, wire_dtype: str) -> None:
        self.store, self.tokenizer, self.receipts, self.wire_dtype = store, tokenizer, receipts, wire_dtype
        self.compute = {"s": 0.0, "frames": 0}  # sum of stage compute_s over Results
        self.check_s = 0.0
        self._finished: list = []  # FinishedJob, audited after the timed runs

    async def start(self, nursery) -> None:
        seed = os.urandom(32)
        job_errors_in, job_errors = trio.open_memory_channel(REPORT_BUFFER)
        ring_changes_in, ring_changes = trio.open_memory_channel(REPORT_BUFFER)
        audit_replies_in, audit_replies = trio.open_memory_channel(REPORT_BUFFER)
        finished_in, self._finished_out = trio.open_memory_channel(1024)
        self.audit_in, audit_jobs = trio.open_memory_channel(AuditConfig.max_queued_jobs)
        self.swarm = Swarm(self.store, seed, SwarmConfig(min_nodes=STAGES, wire_dtype=self.wire_dtype,
                                                               # every node a stage: on loopback with
                                                               # memory to spare the topology selector
                                                               # would seat one node alone
                                                               planner="all_nodes"),
                           job_errors=job_errors_in, ring_changes=ring_changes_in, audit_replies=audit_replies_in)
        self.checker = ReceiptChecker(self.store, seed, finished=finished_in) if self.receipts else None
        self.auditor = Auditor(self.swarm, self.store, seed, AuditConfig(rate=1.0), finished=audit_jobs,
                               audit_replies=audit_replies)
        if self.checker is not None:
            open_job = self.checker.open_job

            def timed_open_job(*args):  # time what the engine calls per round and per job
                jr = open_job(*args)
                for name in ("sent", "check", "finish"):
                    setattr(jr, name, self._timed(getattr(jr, name)))
                return jr

            self.checker.open_job = timed_open_job
        host = await nursery.start(_host, seed)
        self.engine = RingEngine(self.swarm, host, self.tokenizer, EngineConfig(), receipts=self.checker,
                                 job_errors=job_errors, ring_changes=ring_changes)
        deliver = self.engine._deliver

        def counting(msg):  # an Arrived (a Result and its digest) or a JobError
            result = getattr(msg, "result", None)
            times = result.compute_s if result is not None else ()
            self.compute["s"] += sum(times)
            self.compute["frames"] += len(times)
            deliver(msg)

        self.engine._deliver = counting
        host.set_handler(CONTROL_PROTOCOL, self.swarm.handle_control)
        host.set_handler(RING_PROTOCOL, self.engine.handle_ring_stream)
        await nursery.start(self.swarm.serve_formation)
        await nursery.start(self.engine.serve)
        await nursery.start(self.auditor.serve)
        for _ in range(STAGES):
            s = os.urandom(32)
            node_host = await nursery.start(_host, s)
            node = Node(NodeConfig(coordinator=host.addrs[0], receipts=self.receipts), node_host, self.store,
                        signing_seed=s)
            await nursery.start(node.serve)
        while self.swarm.ring is None or len(self.swarm.ring.stages) < STAGES:
            await self.swarm.wait_ring()
            await trio.sleep(0.01)

    @property
    def finished(self) -> list:
        """Every FinishedJob the checker handed over so far, oldest first."""
        while True:
            try:
                self._finished.append(self._finished_out.receive_nowait())
            except trio.WouldBlock:
                return self._finished

    def _timed(self, fn):
        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.check_s += time.perf_counter() - t0
        return timed

    async def request(self, ids: list[int], drafter: str, tokens: int) -> dict:
        """One greedy request; its tok/s and the compute, signing and checking it caused."""
        self.engine.config = dataclasses.replace(self.engine.config, draft=drafter)
        c0, f0, k0, s0, n0 = self.compute["s"], self.compute["frames"], self.check_s, SIGN_S["s"], SIGN_S["frames"]
        started, got = time.perf_counter(), 0
        job = await self.engine.open_job(ids, SamplingParams(temperature=0.0))
        async for block in job.next_tokens():
            got += len(block)
            if got >= tokens:
                break
        elapsed = time.perf_counter() - started
        stats = job.stats()
        await job.aclose()
        return {"tokens": got, "elapsed_s": elapsed, "tok_per_s": got / elapsed, "traversals": stats["traversals"],
                "compute_s": self.compute["s"] - c0, "stage_frames": self.compute["frames"] - f0,
                "check_s": self.check_s - k0, "sign_s": SIGN_S["s"] - s0, "signed_frames": SIGN_S["frames"] - n0}


async def _audit(auditor: Auditor, audit_in: trio.MemorySendChannel, job, into: dict) -> None:
    """Audit every (job, stage) (the auditor's rate is 1) and add what it cost to `into`.
    max_replay_rows=1 replays one frame per forward, as the stage ran them."""
    st = auditor.stats
    before = (st.audits, st.frames_compared, st.replay.forwards, st.replay.rows, st.replay_s)
    audit_in.send_nowait(dataclasses.replace(job, finished_s=time.monotonic()))  # its wait starts now
    await auditor.wait_idle()
    now = (st.audits, st.frames_compared, st.replay.forwards, st.replay.rows, st.replay_s)
    for name, b, a in zip(("audits", "frames_compared", "replay_forwards", "replay_rows", "replay_s"), before, now):
        into[name] = into.get(name, 0) + a - b
    into["evidence"] = len(auditor.evidence)
    into["skipped_stale"] = st.skipped_stale


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


async def bench(store, tokenizer, args) -> dict:
    ids = encode_chat(tokenizer, [{"role": "user", "content": PROMPT}])
    runs: dict[str, dict[str, list[dict]]] = {d: {"off": [], "on": []} for d in DRAFTERS}
    async with trio.open_nursery() as nursery:
        rings = {"off": Ring(store, tokenizer, False, args.wire_dtype), "on": Ring(store, tokenizer, True, args.wire_dtype)}
        for ring in rings.values():
            await ring.start(nursery)
        for drafter in DRAFTERS:  # warm-up: first requests pay allocator and cache growth
            for ring in rings.values():
                await ring.request(ids, drafter, args.tokens)
        rings["on"].finished.clear()
        on = rings["on"]
        batched = on.auditor.config
        audits = {d: {m: {} for m in ("tree", "frame_by_frame")} for d in DRAFTERS}
        for rep in range(args.reps):
            for drafter in DRAFTERS:
                for side in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    runs[drafter][side].append(await rings[side].request(ids, drafter, args.tokens))
                    if side == "on":  # audit the job now, while no request runs
                        for mode, rows in (("tree", batched.max_replay_rows), ("frame_by_frame", 1)):
                            on.auditor.config = dataclasses.replace(batched, max_replay_rows=rows)
                            await _audit(on.auditor, on.audit_in, on.finished[-1], audits[drafter][mode])
        on.auditor.config = batched
        nursery.cancel_scope.cancel()
    out: dict = {}
    for drafter in DRAFTERS:
        off_runs, on_runs = runs[drafter]["off"], runs[drafter]["on"]
        ring_compute_on = sum(r["compute_s"] for r in on_runs)
        a = audits[drafter]
        for mode in a.values():
            mode["over_ring_compute_at_rate_1"] = mode["replay_s"] / ring_compute_on
            mode["over_ring_compute_at_rate"] = {str(args.rate): args.rate * mode["over_ring_compute_at_rate_1"]}
        out[drafter] = {
            "tok_per_s": {"off": _spread([r["tok_per_s"] for r in off_runs]),
                          "on": _spread([r["tok_per_s"] for r in on_runs])},
            "tok_per_s_on_over_off": _spread([b["tok_per_s"] / a_["tok_per_s"] for a_, b in zip(off_runs, on_runs)]),
            "stage_ms_per_frame": {s: _spread([1e3 * r["compute_s"] / r["stage_frames"] for r in rs])
                                   for s, rs in (("off", off_runs), ("on", on_runs))},
            "sign_over_stage_compute": _spread([r["sign_s"] / r["compute_s"] for r in on_runs]),
            "sign_ms_per_frame": _spread([1e3 * r["sign_s"] / r["signed_frames"] for r in on_runs]),
            "check_over_ring_compute": _spread([r["check_s"] / r["compute_s"] for r in on_runs]),
            "check_ms_per_traversal": _spread([1e3 * r["check_s"] / r["traversals"] for r in on_runs]),
            "tokens_per_traversal": _spread([r["tokens"] / r["traversals"] for r in on_runs]),
            "audit": a, "runs": runs[drafter]}
    return out


def _git_rev() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    got = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty"], capture_output=True, text=True)
    return got.stdout.strip() or "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=6, help="ABBA repetitions per drafter")
    p.add_argument("--tokens", type=int, default=48, help="tokens per request")
    p.add_argument("--rate", type=float, default=AuditConfig.rate, help="audit rate the expected cost is given at")
    p.add_argument("--wire-dtype", default="f32")
    p.add_argument("--git-rev", default=None, help="revision to report (default: git describe of this checkout)")
    args = p.parse_args()
    from transformers import AutoTokenizer
    import torch

    store = open_or_prepare(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    load_before = os.getloadavg()
    started = time.time()
    results = trio.run(bench, store, tokenizer, args)
    conditions = {
        "model": store.manifest.name, "stages": STAGES, "rings": "off and on side by side in one process",
        "link": "loopback, no emulation", "wire_dtype": args.wire_dtype, "drafters": list(DRAFTERS),
        "prompt": PROMPT, "tokens_per_request": args.tokens, "reps_per_drafter_and_side": args.reps,
        "order": "ABBA per drafter after one warm-up request each", "audit_rate_default": AuditConfig.rate,
        "git": args.git_rev or _git_rev(), "python": platform.python_version(), "torch": torch.__version__,
        "machine": platform.machine(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "omp_threads": os.environ.get("OMP_NUM_THREADS", "default"),
        "loadavg_1_5_15_before": load_before, "loadavg_1_5_15_after": os.getloadavg(),
        "wall_s": time.time() - started,
    }
    result = {"conditions": conditions, **results}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    brief = {"conditions": conditions}
    for d in DRAFTERS:
        r = results[d]
        brief[d] = {k: r[k] for k in ("tok_per_s", "tok_per_s_on_over_off", "stage_ms_per_frame", "sign_over_stage_compute",
                                      "sign_ms_per_frame", "check_over_ring_compute", "check_ms_per_traversal",
                                      "tokens_per_traversal", "audit")}
    print(json.dumps(brief, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
