"""Audits by verifier nodes, on a real in-process ring whose coordinator holds no layers.

Eight Nodes (libp2p on loopback) join a coordinator whose store has the manifest, the
tokenizer, the embedding and the head but no layer file: it cannot recompute any slice.
Each node's memory holds at most three of the tiny model's five layers and its uplink is
emulated at 50 Mbit/s, so the selector (select_ring) seats two or three stages (as the
measured compute falls), gives each a hot standby, and makes the rest spot-check
verifiers, each keeping one stage's slice warm (no node can hold the whole model, so none
is a decode replica; none has the uplink of a seeder).

Guards: the auditor sending every audit to a verifier (not the audited stage, not
itself), verifiers' recomputations catching the four cheats of test_receipts_ring (skip,
noise, replay, other weights) with signed evidence and the cheater left out of the next
ring; honest f32, bf16 and fp8 rings raising no false alarm through verifiers; and a
verifier that lies being outvoted by the second opinion and excluded, while the honest
stage it accused stays.

Detection maths (computed from the rate, as in test_receipts_ring): each request of a
cheater is audited with probability p = AuditConfig.rate = 0.25 (drawn after the job
ended), and an audited cheat is caught when an honest verifier recomputes it, which here
is certain: every audit reaches a verifier (stats.skipped_no_verifier stays 0) and each
cheat corrupts a verified frame of every request. So 20 requests escape with probability
0.75^20 = 0.3%: detection >= 99.6%. The tests run at p = 1 so each cheat is caught in one
run of two requests; what they check is that verifier audits catch every cheat.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.errors import CoordinatorError
from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.receipt_check import ReceiptConfig
from coordinator.trust.report import trust_report
from receipts import decode_evidence, encode_evidence, verify_evidence
from shard.assignment_rules import public_key_of_peer
from shard.identity import keypair_from_seed
from shard.manifest import layer_file
from shard.node import Node, NodeConfig
from shard.stage import Stage
from shard.store import ModelStore
from shard.wire.roles import ROLE_HOT_STANDBY, ROLE_SPOT_CHECK_VERIFIER
from shard.wire.verify import VerifyReply
from tests.e2e.ringkit import memory_for_stages
from tests.e2e.test_receipts_ring import PROMPT, _serve_host, _tokenizer, add_noise, cheating_batches, replay_old_output, \
    skip_layers

NODES = 8  # up to three stages and their standbys, and at least two verifiers
CHEAT_STAGE = 1  # the tail cheats (skip_layers on the head is covered by test_receipts_ring)


def layerless_store(store: ModelStore, tmp_path) -> ModelStore:
    """A copy of `store` without its layer files: what a gateway that holds no layers has."""
    shutil.copytree(store.root, tmp_path / "gateway")
    for i in range(store.num_layers):
        (tmp_path / "gateway" / layer_file(i)).unlink()
    return ModelStore.open(tmp_path / "gateway")


class LyingNode(Node):
    """A verifier whose recomputations are 5% off (a verifier that frames honest stages)."""

    async def _send_control(self, msg) -> None:
        if isinstance(msg, VerifyReply) and msg.hidden is not None:
            msg.hidden.mul_(1.05)
        await super()._send_control(msg)


async def run_verified_ring(store, gateway_store, *, wire_dtype="f32", cheat=None, other_store=None, liar=False,
                            requests=2, tokens=8, seed=0):
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=NODES,
                         swarm=SwarmConfig(wire_dtype=wire_dtype, ready_timeout_s=30, probe_wait_s=20, max_rings=1,
                                           # one ring: the spares are its verifiers (by default a pool
                                           # this big forms more rings: coordinator.swarm.ring_set)
                                           speed_probe=ProbeConfig(enabled=False)),  # counts audits' verify requests only
                         engine=EngineConfig(draft="none", frame_timeout_s=10, max_resumes=3, resume_wait_s=5,
                                             probation_rounds=0),  # probation recomputes here: no layers here
                         receipts=ReceiptConfig(), audit=AuditConfig(rate=1.0, reply_timeout_s=10))
    node_config = dict(max_memory_bytes=memory_for_stages(store, 2), link_upload_mbps=50.0)
    with trio.fail_after(120):
        async with open_coordinator(config, gateway_store, _tokenizer(), keypair_from_seed(os.urandom(32)),
                                    audit_rng=random.Random(seed)) as coordinator:
            swarm, engine, auditor, nursery = coordinator.swarm, coordinator.engine, coordinator.auditor, coordinator.nursery
            nodes = {}
            for i in range(NODES):
                seed_i = os.urandom(32)
                host = await nursery.start(_serve_host, seed_i)
                node = Node(NodeConfig(coordinator=coordinator.addr, **node_config), host, store, signing_seed=seed_i)
                nodes[host.peer_id] = node
                await nursery.start(node.serve)
            ring = await swarm.wait_ring()
            with trio.fail_after(30):  # roles go out with the ring; wait until every one is loaded
                while not all(m.assignment is not None and m.ready_epoch >= ring.epoch for m in swarm.members.values()):
                    await trio.sleep(0.05)
            roles = {p: m.assignment.role for p, m in swarm.members.items()}
            out = {"swarm": swarm, "auditor": auditor, "ring": ring, "roles": roles, "errors": [], "outputs": []}
            cheater = ring.stages[CHEAT_STAGE][0]
            worker = nodes[cheater].state.worker
            if other_store is not None:
                s, r = worker.stage, worker.stage.layers
                worker.stage = Stage(s.cfg, r, other_store.load_layers(r), dtype=s.dtype, device=s.device,
                                     embedding=s.embedding)
            if cheat is not None:
                worker.stage.forward_batch = cheating_batches(worker.stage.forward_batch, cheat(worker.stage))
            if liar:  # the verifier of the cheat stage's slice lies (no stage cheats)
                liar_id = next(p for p, r in roles.items() if r == ROLE_SPOT_CHECK_VERIFIER
                               and swarm.held.get(p) == ring.stages[CHEAT_STAGE][1])
                nodes[liar_id].__class__ = LyingNode
                out["liar"] = liar_id
            out["cheater"] = cheater
            for _ in range(requests):
                await swarm.wait_ring()  # re-forming after a catch: the next request waits for the ring
                job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
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
                if liar and nodes[out["liar"]].verifier is not None:
                    break  # the liar has been asked
            if cheat is not None or other_store is not None:
                while swarm.ring is None or cheater in {p for p, _ in swarm.ring.stages}:
                    await (swarm.wait_ring() if swarm.ring is None else swarm.wait_change(swarm.ring.epoch, 5))
            out["final_ring"] = swarm.ring
            out["verified"] = {p: n.verifier.answered for p, n in nodes.items() if n.verifier is not None}
    return out


@pytest.fixture
def gateway(tiny_llama_store, tmp_path):
    return layerless_store(tiny_llama_store, tmp_path)


def check_through_verifiers(out):
    """Every audit was recomputed by verifier nodes, none by the layerless coordinator."""
    a = out["auditor"]
    assert not any(a.holds(r) for _, r in out["ring"].stages)
    assert a.stats.by_coordinator == 0 and a.stats.skipped_no_verifier == 0
    assert trust_report(None, a)["audits"]["recomputed_by"].startswith("verifier nodes only")
    assert a.stats.audits > 0 and a.stats.by_verifiers >= a.stats.audits
    verifiers = {p for p, r in out["roles"].items() if r == ROLE_SPOT_CHECK_VERIFIER}
    assert set(out["verified"]) <= verifiers and sum(out["verified"].values()) == a.stats.by_verifiers
    assert list(out["roles"].values()).count(ROLE_HOT_STANDBY) == len(out["ring"].stages) and len(verifiers) >= 2


@pytest.mark.parametrize("wire_dtype", ["f32", "bf16", "f8_e4m3fn"])
def test_honest_rings_raise_no_alarm_through_verifiers(tiny_llama_store, gateway, wire_dtype):
    out = trio.run(lambda: run_verified_ring(tiny_llama_store, gateway, wire_dtype=wire_dtype))
    assert out["errors"] == [] and all(len(o) == 8 for o in out["outputs"])
    assert out["auditor"].evidence == [] and out["swarm"].faulty == {}
    assert out["auditor"].stats.frames_compared >= 2 * 2 * 8
    check_through_verifiers(out)


def check_caught(out):
    cheater = out["cheater"]
    assert set(out["swarm"].faulty) == {cheater}
    record = decode_evidence(encode_evidence(out["auditor"].evidence[0]))
    verify_evidence(record)
    assert record.node_key == public_key_of_peer(cheater)
    assert cheater not in {p for p, _ in out["final_ring"].stages}
    check_through_verifiers(out)


@pytest.mark.parametrize("cheat", [skip_layers, add_noise, replay_old_output], ids=lambda f: f.__name__)
def test_verifiers_catch_a_cheating_stage(tiny_llama_store, gateway, cheat):
    out = trio.run(lambda: run_verified_ring(tiny_llama_store, gateway, cheat=cheat))
    assert out["errors"] == []
    check_caught(out)


def test_verifiers_catch_a_stage_with_other_weights(tiny_llama_store, gateway, tiny_model_factory, tiny_store_factory):
    other = tiny_store_factory(tiny_model_factory("llama", seed=1))
    out = trio.run(lambda: run_verified_ring(tiny_llama_store, gateway, other_store=other))
    check_caught(out)


def test_a_lying_verifier_is_outvoted_by_the_second_opinion_and_excluded(tiny_llama_store, gateway):
    """The liar keeps the audited slice warm, so it is drawn first among that slice's holders
    (requests go on until it has been asked); its 5% error disagrees with the honest
    stage, a second verifier sides with the stage, a third (when there is one) too, and
    the liar is outvoted."""
    out = trio.run(lambda: run_verified_ring(tiny_llama_store, gateway, liar=True, requests=12))
    a = out["auditor"]
    assert out["errors"] == [] and a.evidence == [] and len(out["outputs"]) < 12
    assert set(out["swarm"].faulty) == {out["liar"]} and "verifier outvoted" in out["swarm"].faulty[out["liar"]]
    assert a.stats.lying_verifiers == 1 and a.stats.second_opinions >= 1
    assert out["cheater"] not in out["swarm"].faulty
