"""Audits on a layerless gateway whose every node is a stage (issue 20): the stages audit
each other.

The gateway's store has no layer file, so it cannot recompute an audited slice, and the
three Nodes are all stages (planner all_nodes), so none has the spot-check verifier role.
Audits used to be skipped there (no verifier node), so a liar that behaved through its
probation and then cheated was never checked again. Now an audit asks any other member
whose node keeps the slice (coordinator.trust.opinions.audit_order).

A TurningLiar computes honestly until the test turns it, once every node has left
probation (the first node is the operator's trusted key, and its recomputations earn the
others their credit: newcomers checking newcomers earn none) (its rounds are then released unverified, as for any trusted stage); from then
on it adds noise to every output it computes and signs it (receipts pass). At the default
audit rate (0.25 of each (job, stage)), a job of the liar is audited with probability 1/4,
so it is caught within MAX_JOBS = 40 jobs with probability 1 - 0.75^40 > 99.99%.
"""

from __future__ import annotations

import os

import torch
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.report import trust_report
from receipts import verify_evidence
from shard.assignment_rules import public_key_of_peer
from shard.identity import keypair_from_seed, peer_id_from_public_key, peer_id_of
from shard.node import Node, NodeConfig
from shard.wire.roles import ROLE_SPOT_CHECK_VERIFIER
from tests.e2e.test_stalling_stage import _generate, _serve_host, _stages, _tokenizer
from tests.e2e.test_verifier_ring import layerless_store

CLEAN_ROUNDS = 6  # an 8-token request is 9 rounds: each node leaves probation in its first
MAX_JOBS = 40
SEED_TRUSTED = bytes(range(32))  # the key the operator lists (--trusted-nodes): it vouches for the newcomers


class TurningLiar(Node):
    """Honest until `turned` is set, then adds noise (half the row's std) to every output."""

    turned = False

    async def _assume(self, a):
        await super()._assume(a)
        stage = self.state.worker.stage
        honest = stage.forward_batch

        def maybe_lying(frames):
            outs = honest(frames)
            if not self.turned:
                return outs
            return [out if isinstance(out, Exception) else (out[0] + 0.5 * out[0].std() * torch.randn(out[0].shape), out[1])
                    for out in outs]

        stage.forward_batch = maybe_lying


def test_a_liar_past_probation_is_caught_by_another_stage_auditing_it(tiny_llama_store, tmp_path):
    # Bug guarded: audits on a layerless gateway skipped whenever no node has the verifier
    # role, or answered by the audited stage itself, or an honest stage blamed for the
    # liar's garbage it was fed. Sound: the gateway holds no layer (by_coordinator stays 0,
    # its shadow is off) and no node is a verifier-role node, so only another stage can
    # have recomputed the liar's slice; the liar corrupts every frame once turned, so every
    # audit of it is a catch, and it is off probation first (no round check catches it).
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10, probation_rounds=CLEAN_ROUNDS,
                                             # only a trusted recomputation earns credit: the operator's own key
                                             trusted_nodes=(peer_id_of(keypair_from_seed(SEED_TRUSTED)),)))

    async def main():
        with trio.fail_after(300):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, auditor, nursery = c.swarm, c.engine, c.auditor, c.nursery
                nodes = []
                for cls, seed in ((Node, SEED_TRUSTED), (Node, os.urandom(32)), (TurningLiar, os.urandom(32))):
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    await nursery.start(node.serve)
                    nodes.append(node)
                liar = nodes[2].host.peer_id
                out = {"liar": liar, "ring": await _stages(swarm, 3)}
                while engine.on_probation(swarm.ring):
                    out["reference"] = await _generate(engine, 8)
                    await auditor.wait_idle()
                out["audits_before"] = auditor.stats.audits
                nodes[2].turned = True
                out["answers"] = []
                while liar not in swarm.faulty and len(out["answers"]) < MAX_JOBS:
                    out["answers"].append(await _generate(engine, 8))
                    await auditor.wait_idle()
                if liar in swarm.faulty:  # else the assertions below say so (no ring of 2 to wait for)
                    out["after"] = await _stages(swarm, 2)
                    out["answer_after"] = await _generate(engine, 8)
                out["roles"] = {p: m.assignment.role for p, m in swarm.members.items() if m.assignment is not None}
                out["report"] = trust_report(c.receipts, auditor)["audits"]
                nursery.cancel_scope.cancel()
                out.update(swarm=swarm, stats=auditor.stats, evidence=auditor.evidence, coordinator=c.host.peer_id,
                           shadow=engine.shadow)
                return out

    out = trio.run(main)
    liar, swarm, stats = out["liar"], out["swarm"], out["stats"]
    jobs = len(out["answers"])
    wrong = sum(a != out["reference"] for a in out["answers"])
    print(f"turned liar caught by an audit after {jobs} jobs ({wrong} wrong answers; rate 0.25, "
          f"{out['audits_before']} audits before it turned); load average {os.getloadavg()[0]:.1f}")
    assert liar in out["ring"] and out["shadow"] is None
    assert ROLE_SPOT_CHECK_VERIFIER not in out["roles"].values()  # no verifier-role node to ask
    assert liar in swarm.faulty and swarm.faulty[liar].startswith("audit "), swarm.faulty
    assert set(swarm.faulty) == {liar}  # the honest stages it fed garbage were never blamed
    assert liar not in out["after"] and out["answer_after"] == out["reference"]  # the ring without it is right
    assert stats.by_coordinator == 0 and stats.by_verifiers == 0 and stats.by_members >= stats.audits > 0
    assert stats.skipped_no_verifier == 0
    record = next(r for r in out["evidence"] if peer_id_from_public_key(r.receipt.signer) == liar)
    verify_evidence(record, coordinator_key=public_key_of_peer(out["coordinator"]))
    assert not record.check.passed and len(out["evidence"]) == 1
    report = out["report"]
    assert report["by_members"] == stats.by_members and report["recomputed_by"].startswith("verifier nodes only")
    assert report["recent_evidence"][0]["found_by"] == "audit" and report["recent_evidence"][0]["peer_id"] == liar
