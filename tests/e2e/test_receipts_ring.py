"""Receipts and audits on a real in-process ring: coordinator swarm + engine + auditor and
three Nodes (libp2p on loopback, each with its own host and key) over the tiny llama.

Guards issue 6's promises end to end: an honest ring's requests verify round by round and
its bundles verify offline (`shard-receipts verify`); a stage that does not sign fails the
request closed; cheating stages (injected here by wrapping the stage's batched forward, which runs
before the stage signs, so each cheater signs its own garbage: no production flag) are
caught by audits, evidence is signed, and the next ring leaves the cheater out; honest
rings on bf16 and fp8 wires raise no false alarm.

Detection maths. An audit selects each (job, epoch, stage) with probability p (default
AuditConfig.rate = 0.25, drawn after the job ended, so a stage cannot tell) and then
recomputes and compares every verified frame that stage served for the job
(tests/coordinator/test_audit_replay.py pins both halves). Each of the four cheats here
corrupts at least one verified frame of every request it serves (the latest-starting one,
replaying an old output, from its 2nd decode frame, so any request of 3+ tokens), so one
request escapes with probability 1 - p and 20 requests with (1 - p)^20 = 0.75^20 = 3.2e-3:
detection >= 99.6% within 20 requests, whatever the request length or how few frames are
corrupted. (p >= 1 - 0.01^(1/20) = 0.206 is the least rate that keeps 99%.) The tests here
audit at p = 1 so each cheat is caught deterministically in 2 requests of 8 tokens; what
they check is that the comparison catches every cheat, which is the other factor.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.trust.audit import AuditConfig
from coordinator.errors import CoordinatorError
from coordinator.trust.receipt_check import ReceiptConfig
from coordinator.errors import ReceiptRejected
from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.formation import SwarmConfig
from receipts import decode_evidence, encode_evidence, verify_evidence
from receipts.cli import main as receipts_cli
from shard.assignment_rules import public_key_of_peer
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.stage import Stage
from shard.transport import open_host
from shard.wire.codec import decode
from shard.wire.limits import Limits
from shard.wire.messages import AuditReply

PROMPT = [1, 3 + ord("h"), 3 + ord("i"), 3 + ord("!"), 5, 9, 17]
CHEATER = 1  # the second node to register cheats, wherever the ring places it


def _tokenizer():
    from tests.conftest import make_tiny_tokenizer

    return make_tiny_tokenizer()


# A cheat rewrites one frame's honest output: cheat(x, h) -> what the stage sends instead.
def skip_layers(stage: Stage):
    def cheat(x, h):
        if x.dim() == 1:  # the head: embed, then none of its layers
            return stage.embedding[x.long()]
        return x.to(h.dtype)  # forwards its input: none of its layers ran
    return cheat


def add_noise(stage: Stage):
    gen = torch.Generator().manual_seed(0)

    def cheat(x, h):
        return h + 0.05 * h.std() * torch.randn(h.shape, generator=gen)
    return cheat


def replay_old_output(stage: Stage):
    seen: list[torch.Tensor] = []

    def cheat(x, h):
        if h.shape[0] == 1:  # from its 2nd decode frame on: the previous decode output again
            if seen:
                return seen[-1]
            seen.append(h)
        return h
    return cheat


def cheating_batches(forward_batch, cheat):
    """Stage.forward_batch with `cheat` applied to each frame's output (the worker runs
    every frame, alone or batched, through forward_batch)."""
    def run(frames):
        outs = forward_batch(frames)
        return [out if isinstance(out, Exception) else (cheat(f.x, out[0]), out[1]) for f, out in zip(frames, outs)]
    return run


class CheatingNode(Node):
    """A node whose stage's outputs are rewritten by `cheat(stage)`; `other_stage`,
    if set, replaces its weights with another model's (it still claims the honest ones)."""

    cheat = None
    other_store = None
    silent = False  # never answer an audit request

    async def _send_control(self, msg) -> None:  # audit replies leave encoded (shard.audit_answers.reply)
        if self.silent and isinstance(msg, bytes) and isinstance(decode(msg, Limits()), AuditReply):
            return
        await super()._send_control(msg)

    async def _assume(self, a):
        await super()._assume(a)
        worker = self.state.worker
        if self.other_store is not None:
            s, r = worker.stage, worker.stage.layers
            worker.stage = Stage(s.cfg, r, self.other_store.load_layers(r), dtype=s.dtype, device=s.device,
                                 embedding=s.embedding)
        if self.cheat is not None:
            worker.stage.forward_batch = cheating_batches(worker.stage.forward_batch, self.cheat(worker.stage))


async def run_ring(store, *, wire_dtype="f32", rate=1.0, requests=2, tokens=8, cheat=None, other_store=None,
                   unsigned=False, receipts_dir=None, seed=0, draft="none", silent=False, reply_timeout_s=10,
                   aux_dtype=None, eagle_head=None):
    """Start the ring, serve `requests` greedy requests, wait for audits; return what happened."""
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2, swarm=SwarmConfig(wire_dtype=wire_dtype, aux_dtype=aux_dtype, ready_timeout_s=30,
                                                        planner="all_nodes"),
                         # Probation off: these rings are all newcomers, and a cheater must be caught by
                         # audits, with evidence, not before release (tests/e2e/test_probation_ring.py).
                         engine=EngineConfig(draft=draft, eagle_head=eagle_head, frame_timeout_s=10, max_resumes=3,
                                             resume_wait_s=5, probation_rounds=0),
                         receipts=ReceiptConfig(receipts_dir=receipts_dir),
                         audit=AuditConfig(rate=rate, reply_timeout_s=reply_timeout_s))
    with trio.fail_after(50):
        async with open_coordinator(config, store, _tokenizer(), keypair_from_seed(os.urandom(32)),
                                    audit_rng=random.Random(seed)) as coordinator:
            swarm, engine, auditor, nursery = coordinator.swarm, coordinator.engine, coordinator.auditor, coordinator.nursery
            out = {"errors": [], "job_ids": [], "outputs": [], "swarm": swarm, "auditor": auditor,
                   "checker": coordinator.receipts}
            nodes = []
            for i in range(3):
                bad = i == CHEATER and (cheat is not None or other_store is not None or unsigned or silent)
                cls = type("Cheater", (CheatingNode,), {"cheat": staticmethod(cheat) if cheat else None,
                                                         "other_store": other_store, "silent": silent}) if bad else Node
                seed_i = os.urandom(32)
                node_host = await nursery.start(_serve_host, seed_i)
                node = cls(NodeConfig(coordinator=coordinator.addr, receipts=not (bad and unsigned)), node_host,
                           store, signing_seed=seed_i)
                await nursery.start(node.serve)
                nodes.append(node)
            while swarm.ring is None or len(swarm.ring.stages) < 3:
                await swarm.wait_ring()
                await trio.sleep(0.01)
            out["cheater"] = nodes[CHEATER].host.peer_id
            for _ in range(requests):
                job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
                out["job_ids"].append(job.job_id)
                got = []
                try:
                    async for block in job.next_tokens():
                        got += block
                        if len(got) >= tokens:
                            break
                except CoordinatorError as exc:
                    out["errors"].append(exc)
                finally:
                    await job.aclose()
                out["outputs"].append(got)
            await auditor.wait_idle()
            if swarm.faulty:
                while swarm.ring is None or out["cheater"] in {p for p, _ in swarm.ring.stages}:
                    if swarm.ring is None:  # re-forming: wait_change would return at once
                        await swarm.wait_ring()
                    else:
                        await swarm.wait_change(swarm.ring.epoch, 5)
            out["final_ring"] = swarm.ring
    return out


async def _serve_host(seed, task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(keypair_from_seed(seed), "/ip4/127.0.0.1/tcp/0") as host:
        task_status.started(host)
        await trio.sleep_forever()


def test_honest_ring_verifies_and_bundles_verify_offline(tiny_llama_store, tmp_path, capsys):
    """Guards: receipts on by default end to end; the bundle written to --receipts-dir is
    exactly what the offline verifier accepts (so the coordinator and the CLI agree on the
    digested bytes); audits of honest stages at rate 1 raise nothing."""
    out = trio.run(lambda: run_ring(tiny_llama_store, rate=1.0, receipts_dir=str(tmp_path)))
    assert out["errors"] == [] and all(len(o) == 8 for o in out["outputs"])
    assert out["auditor"].evidence == [] and out["swarm"].faulty == {}
    assert out["auditor"].stats.frames_compared > 0
    for job_id in out["job_ids"]:
        bundle = out["checker"].bundle(job_id)
        assert bundle is not None and bundle["job_id"] == job_id and len(bundle["rounds"]) == 8
    paths = sorted(str(p) for p in tmp_path.glob("*.json"))
    assert len(paths) == 2
    code = receipts_cli(["verify", *paths, "--manifest", str(tiny_llama_store.root / "manifest.json")])
    assert code == 0, capsys.readouterr()


def test_unsigned_stage_fails_request_closed(tiny_llama_store):
    """Guards fail-closed: a stage that signs nothing makes the chain stop short; the
    request ends with ReceiptRejected (not resumed, not served) and leaves no bundle."""
    out = trio.run(lambda: run_ring(tiny_llama_store, unsigned=True, requests=1))
    [err] = out["errors"]
    # A missing middle receipt is a gap blamed on the next receipt; a missing tail one, truncation.
    assert isinstance(err, ReceiptRejected) and err.check in ("coverage_gap", "truncated"), err
    assert err.peer_id in {p for p, _ in out["swarm"].ring.stages}
    assert out["outputs"] == [[]]
    assert out["checker"].bundle(out["job_ids"][0]) is None


@pytest.mark.parametrize("cheat", [skip_layers, add_noise, replay_old_output], ids=lambda f: f.__name__)
def test_cheating_stage_is_caught_and_excluded(tiny_llama_store, cheat):
    """Guards the audit loop: a stage that signs wrong outputs passes every receipt check
    (its chain is consistent) but is caught by replay, with signed evidence naming its
    key, and the re-formed ring leaves it out."""
    out = trio.run(lambda: run_ring(tiny_llama_store, cheat=cheat))
    assert out["errors"] == []  # receipts alone cannot see this cheat
    check_caught(out)


def test_stage_with_other_weights_is_caught(tiny_llama_store, tiny_model_factory, tiny_store_factory):
    """Guards: claiming the assigned weights digest while computing with other weights."""
    other = tiny_store_factory(tiny_model_factory("llama", seed=1))
    out = trio.run(lambda: run_ring(tiny_llama_store, other_store=other))
    check_caught(out)


def test_stage_that_never_answers_audits_is_caught(tiny_llama_store):
    """Guards the way out of an audit that is not a cheat the replay can see: a stage that
    stays connected but never answers audit requests (here it also adds noise) is accused
    ("unanswered") with signed evidence, exactly as if its replay had failed."""
    out = trio.run(lambda: run_ring(tiny_llama_store, cheat=add_noise, silent=True, requests=1, reply_timeout_s=3))
    check_caught(out)
    assert "audit unanswered" in out["swarm"].faulty[out["cheater"]]


def check_caught(out):
    cheater = out["cheater"]
    assert set(out["swarm"].faulty) == {cheater}
    assert out["auditor"].evidence
    record = decode_evidence(encode_evidence(out["auditor"].evidence[0]))
    verify_evidence(record)
    assert record.node_key == public_key_of_peer(cheater)
    assert cheater not in {p for p, _ in out["final_ring"].stages}


@pytest.mark.parametrize("wire_dtype,draft", [("bf16", "none"), ("f8_e4m3fn", "none"), ("bf16", "ngram")])
def test_no_false_alarm_on_quantised_wires(tiny_llama_store, wire_dtype, draft):
    """Guards the tolerance calibration: replaying on the coordinator batches frames
    differently from the stage (all of an epoch's frames, draft trees and commits
    included, as one tree-masked forward), and the wire codec must not turn that into a
    mismatch."""
    out = trio.run(lambda: run_ring(tiny_llama_store, wire_dtype=wire_dtype, rate=1.0, requests=2, draft=draft))
    assert out["errors"] == [] and out["auditor"].evidence == [] and out["swarm"].faulty == {}
    assert out["auditor"].stats.frames_compared >= 2 * 3 * (8 if draft == "none" else 2)


def test_no_false_alarm_with_fp8_aux_on_a_bf16_wire(tiny_llama_store, tmp_path):
    """Guards audits of EAGLE rounds whose aux features ride in their own dtype (fp8 on a
    bf16 wire): the replay must encode them as the stages did and compare them with the
    fp8 tolerance, or every honest stage that attaches a layer would be accused."""
    from tests.e2e.test_spec_ring import random_eagle_head

    random_eagle_head(tiny_llama_store, tmp_path / "head")
    out = trio.run(lambda: run_ring(tiny_llama_store, wire_dtype="bf16", aux_dtype="f8_e4m3fn", rate=1.0, requests=2,
                                    draft="eagle", eagle_head=str(tmp_path / "head")))
    assert out["errors"] == [] and out["auditor"].evidence == [] and out["swarm"].faulty == {}
    assert out["auditor"].stats.frames_compared >= 2 * 3 * 2
    assert all(a.aux_dtype == "f8_e4m3fn" and a.wire_dtype == "bf16" for a in out["swarm"].ring.assignments)
