"""Probation for newcomers on a real in-process ring (issue 20): a lying newcomer's rounds
are recomputed before release, so it delivers no wrong token and is excluded.

The red team's lying stage had 2 and 14 wrong HTTP 200 answers delivered before audits
(which run after a job ends) caught it. Here two honest Nodes serve, then a third joins
whose stage adds noise to every output it computes (and signs it: receipts pass); every
request after it joins must still equal the honest ring's answer, and the newcomer must
end up excluded, with the honest stages never blamed, and the catch signed as evidence
against the liar's own receipt, as an audit's catch is.
"""

from __future__ import annotations

import os

import torch
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.report import trust_report
from receipts import verify_evidence
from shard.assignment_rules import public_key_of_peer
from shard.identity import keypair_from_seed, peer_id_from_public_key
from shard.node import Node, NodeConfig
from tests.e2e.test_stalling_stage import _generate, _serve_host, _stages, _tokenizer


class LyingNode(Node):
    """Adds noise to every output its stage computes, before it signs it."""

    async def _assume(self, a):
        await super()._assume(a)
        stage = self.state.worker.stage
        honest = stage.forward_batch
        gen = torch.Generator().manual_seed(0)

        def lying(frames):
            outs = honest(frames)
            return [out if isinstance(out, Exception) else
                    (out[0] + 0.5 * out[0].std() * torch.randn(out[0].shape, generator=gen), out[1]) for out in outs]

        stage.forward_batch = lying


def test_a_lying_newcomer_delivers_no_wrong_token_and_is_excluded(tiny_llama_store):
    # Sound: the liar corrupts every frame it computes, so any of its rounds released
    # unverified would change the greedy tokens (noise of half the row's std); every
    # answer is compared with the honest ring's for the same greedy request, and audits
    # are off (rate 0), so only the probation check can have excluded it.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10), audit=AuditConfig(rate=0.0))

    async def main():
        with trio.fail_after(150):
            async with open_coordinator(config, tiny_llama_store, _tokenizer(), keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, nursery = c.swarm, c.engine, c.nursery
                nodes = []
                for cls in (Node, Node, LyingNode):
                    seed = os.urandom(32)
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    if cls is LyingNode:
                        honest = await _stages(swarm, 2)
                        reference = await _generate(engine, 8)
                    await nursery.start(node.serve)
                    nodes.append(node)
                liar = nodes[2].host.peer_id
                assert liar in await _stages(swarm, 3)
                answers = [await _generate(engine, 8) for _ in range(4)]
                clean = dict(engine.clean_rounds)
                nursery.cancel_scope.cancel()
                report = trust_report(c.receipts, c.auditor)["audits"]
                assert engine.info()["probation"] == {"clean_rounds": 64, "rounds_verified": "before release",
                                                      "verified_by": "gateway", "why_not": None, "policy": "serve",
                                                      "seated_unverified": None, "disputes": []}
                return honest, reference, answers, liar, swarm, clean, c.receipts.evidence, c.host.peer_id, report

    honest, reference, answers, liar, swarm, clean, evidence, coordinator, report = trio.run(main)
    assert len(reference) == 8 and answers == [reference] * 4
    assert liar in swarm.faulty and "differs from the coordinator's recomputation" in swarm.faulty[liar]
    assert all(p not in swarm.faulty and swarm.unreachable.table.get(p) is None for p in honest)
    assert clean.get(liar, 0) == 0 and all(clean[p] > 0 for p in honest)
    # The evidence (issue 20): signed by this coordinator over the liar's own signed
    # receipt for the caught round, its check failed, and the digest the coordinator
    # recomputed for the liar's output is not the one the liar signed.
    (record,) = evidence
    verify_evidence(record, coordinator_key=public_key_of_peer(coordinator))
    assert peer_id_from_public_key(record.receipt.signer) == liar and not record.check.passed
    assert record.recomputed_digest not in (record.claimed_output_digest, bytes(32))
    assert report["evidence"] == 1 and report["recent_evidence"][0]["found_by"] == "probation"
    assert report["recent_evidence"][0]["peer_id"] == liar
