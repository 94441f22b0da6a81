"""Probation through verifier nodes, on a real in-process ring whose gateway holds no layers
(issue 20): a newcomer's rounds are recomputed by other nodes before release.

The gateway's store has the manifest, tokenizer, embedding and head but no layer file, so
its shadow cannot recompute the ring. Two honest Nodes serve first: one the operator lists
as trusted (--trusted-nodes: the bootstrap of a layerless gateway, as only a trusted
recomputation earns credit), the other on probation, verified by it, earning its clean
rounds that way and leaving probation. Then a
third joins whose stage adds noise to every output it computes (and signs it: receipts
pass): every request after it joins must still equal the honest ring's greedy answer, the
newcomer must be excluded with evidence signed over its own receipt, and the honest
stages never blamed.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.report import trust_report
from receipts import verify_evidence
from shard.assignment_rules import public_key_of_peer
from shard.identity import keypair_from_seed, peer_id_from_public_key, peer_id_of
from shard.node import Node, NodeConfig
from tests.e2e.ringkit import generate_greedy, generate_greedy_with_stats
from tests.e2e.test_probation_ring import LyingNode
from tests.e2e.test_spec_ring import PROMPTS, NoisyOracleDrafter
from tests.e2e.test_stalling_stage import _generate, _serve_host, _stages, _tokenizer
from tests.e2e.test_verifier_ring import LyingNode as LyingVerifier
from tests.e2e.test_verifier_ring import layerless_store

CLEAN_ROUNDS = 6  # an 8-token request is 9 rounds: the honest newcomer leaves probation in its first
SEED_TRUSTED = bytes(range(32))  # the key the operator lists (--trusted-nodes)


def test_a_layerless_gateway_verifies_newcomers_by_verifier_nodes(tiny_llama_store, tmp_path):
    # Sound: the liar corrupts every frame it computes (noise of half the row's std), so any
    # of its rounds released unverified changes the greedy tokens; audits are off (rate 0)
    # and the gateway holds no layer (its shadow is off), so only a verifier node's check
    # can have excluded it and kept its tokens back.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10, probation_rounds=CLEAN_ROUNDS,
                                             trusted_nodes=(peer_id_of(keypair_from_seed(SEED_TRUSTED)),)),
                         audit=AuditConfig(rate=0.0))
    gateway = layerless_store(tiny_llama_store, tmp_path)

    async def main():
        with trio.fail_after(180):
            async with open_coordinator(config, gateway, _tokenizer(), keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, nursery = c.swarm, c.engine, c.nursery
                nodes, out = [], {}
                for cls, seed in ((Node, SEED_TRUSTED), (Node, os.urandom(32)), (LyingNode, os.urandom(32))):
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    if cls is LyingNode:
                        out["honest"] = await _stages(swarm, 2)
                        out["reference"] = await _generate(engine, 8)
                        out["clean_before"] = dict(engine.clean_rounds)
                        out["checks_before"] = engine.round_verifier.checks
                        out["info_before"] = engine.info()["probation"]
                    await nursery.start(node.serve)
                    nodes.append(node)
                out["liar"] = liar = nodes[2].host.peer_id
                assert liar in await _stages(swarm, 3)
                out["answers"] = [await _generate(engine, 8) for _ in range(4)]
                out["clean"] = dict(engine.clean_rounds)
                out["checks"], out["catches"] = engine.round_verifier.checks, engine.round_verifier.catches
                nursery.cancel_scope.cancel()
                out["report"] = trust_report(c.receipts, c.auditor)["audits"]
                out.update(swarm=swarm, evidence=c.receipts.evidence, coordinator=c.host.peer_id,
                           shadow=engine.shadow, info=engine.info()["probation"])
                return out

    out = trio.run(main)
    honest, liar, swarm = out["honest"], out["liar"], out["swarm"]
    assert out["shadow"] is None  # this gateway cannot recompute: every check was a verifier node's
    # The honest newcomer earned its clean rounds through the trusted node's recomputations.
    (newcomer,) = honest - {peer_id_of(keypair_from_seed(SEED_TRUSTED))}
    assert out["clean_before"][newcomer] >= CLEAN_ROUNDS and out["checks_before"] >= 1
    assert out["info_before"] == {"clean_rounds": CLEAN_ROUNDS, "rounds_verified": "before release",
                                  "verified_by": "verifier nodes", "why_not": None, "policy": "serve",
                                  "seated_unverified": None, "disputes": []}
    assert len(out["reference"]) == 8 and out["answers"] == [out["reference"]] * 4  # 0 wrong tokens delivered
    assert liar in swarm.faulty and "recomputation of verifier node" in swarm.faulty[liar]
    assert all(p not in swarm.faulty and swarm.unreachable.table.get(p) is None for p in honest)
    assert out["clean"].get(liar, 0) == 0
    assert out["checks"] > out["checks_before"] and out["catches"] == 1
    (record,) = out["evidence"]  # signed over the liar's own receipt, its check failed
    verify_evidence(record, coordinator_key=public_key_of_peer(out["coordinator"]))
    assert peer_id_from_public_key(record.receipt.signer) == liar and not record.check.passed
    assert record.recomputed_digest not in (record.claimed_output_digest, bytes(32))
    assert out["report"]["recent_evidence"][0]["found_by"] == "probation"


class LateLiar(Node):
    """Computes honestly for its first LIE_AFTER frames, then adds noise to every output:
    caught in the middle of a job, with rounds sent ahead on tokens not yet verified."""

    LIE_AFTER = 4

    async def _assume(self, a):
        await super()._assume(a)
        stage = self.state.worker.stage
        honest, seen = stage.forward_batch, [0]

        def lying(frames):
            outs = honest(frames)
            seen[0] += len(frames)
            if seen[0] <= self.LIE_AFTER:
                return outs
            return [out if isinstance(out, Exception) else (out[0] + 0.5 * out[0].std() * torch.randn(out[0].shape), out[1])
                    for out in outs]

        stage.forward_batch = lying


def test_rounds_sent_ahead_stay_lossless_under_verifier_checks(tiny_llama_store, tmp_path):
    # Bug guarded: a round sent ahead (pipelined) built on tokens whose round a verifier
    # has not yet checked, kept when that check fails, or an honest stage blamed for the
    # K/V slots those rounds leave. Sound: the drafter proposes the honest greedy
    # continuation (97% right), so rounds go ahead; every stage stays on probation
    # (clean_rounds far above the run), so every round is checked by a verifier node; the
    # late liar computes honestly at first, so it is caught mid-job, and the job's tokens
    # must still equal plain greedy.
    tokens = 48
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10, link_latency_ms=8, probation_rounds=10_000,
                                             trusted_nodes=(peer_id_of(keypair_from_seed(SEED_TRUSTED)),)),
                         audit=AuditConfig(rate=0.0))
    gateway = layerless_store(tiny_llama_store, tmp_path)

    async def main():
        with trio.fail_after(240):
            async with open_coordinator(config, gateway, _tokenizer(), keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, nursery = c.swarm, c.engine, c.nursery
                nodes, out = [], {}
                for cls, seed in ((Node, SEED_TRUSTED), (Node, os.urandom(32)), (LateLiar, os.urandom(32))):
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr, link_latency_ms=8), host, tiny_llama_store, signing_seed=seed)
                    if cls is LateLiar:
                        out["honest"] = await _stages(swarm, 2)
                        plain = {tuple(PROMPTS[0]): await generate_greedy(engine, PROMPTS[0], tokens)}
                        engine.config = dataclasses.replace(engine.config, max_pipeline_depth=4)
                        engine.make_drafters = lambda: [NoisyOracleDrafter(plain, tree=False, seed=7, accuracy=0.97)]
                        out["honest_run"] = await generate_greedy_with_stats(engine, PROMPTS[0], tokens)
                        out["plain"] = plain[tuple(PROMPTS[0])]
                    await nursery.start(node.serve)
                    nodes.append(node)
                out["liar"] = nodes[2].host.peer_id
                assert out["liar"] in await _stages(swarm, 3)
                out["liar_run"] = await generate_greedy_with_stats(engine, PROMPTS[0], tokens)
                out["swarm"], out["clean"] = swarm, dict(engine.clean_rounds)
                nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    (honest_tokens, honest_stats), (liar_tokens, liar_stats) = out["honest_run"], out["liar_run"]
    assert honest_tokens == out["plain"] and honest_stats["pipelined_rounds"] > 0, honest_stats
    (newcomer,) = out["honest"] - {peer_id_of(keypair_from_seed(SEED_TRUSTED))}  # the other is trusted (never on probation)
    assert out["clean"][newcomer] > 0  # checked round by round by the trusted node, no false alarm
    assert liar_tokens == out["plain"] and liar_stats["pipelined_rounds"] > 0, liar_stats
    swarm = out["swarm"]
    assert out["liar"] in swarm.faulty and "recomputation of verifier node" in swarm.faulty[out["liar"]]
    assert liar_stats["resumes"] >= 1 and out["clean"][out["liar"]] > 0  # caught after it had earned rounds
    assert all(p not in swarm.faulty for p in out["honest"])


def test_with_no_verifier_the_round_goes_out_and_v1_ring_says_why(tiny_llama_store, tmp_path):
    # Bug guarded: a layerless gateway with no node that could recompute a newcomer's slice
    # hanging or failing its requests, or releasing them while /v1/ring claims they were
    # verified. Sound: the only node is the newcomer itself, which never verifies itself.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=1, swarm=SwarmConfig(ready_timeout_s=30),
                         engine=EngineConfig(draft="none"), audit=AuditConfig(rate=0.0))

    async def main():
        with trio.fail_after(120):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                seed = os.urandom(32)
                host = await c.nursery.start(_serve_host, seed)
                await c.nursery.start(Node(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed).serve)
                await _stages(c.swarm, 1)
                answer = await _generate(c.engine, 8)
                c.nursery.cancel_scope.cancel()
                return answer, c.engine.info()["probation"], dict(c.engine.clean_rounds), c.engine.round_verifier.checks

    answer, info, clean, checks = trio.run(main)
    assert len(answer) == 8 and clean == {} and checks == 0
    assert info["rounds_verified"] == "no" and info["verified_by"] is None
    assert info["why_not"].startswith("no verifier node could recompute layers [0, ")
    assert info["why_not"].endswith("on probation: its rounds go out unverified (audits alone vouch for it)")


def test_a_verifier_that_lies_about_a_newcomer_is_outvoted_and_the_round_released(tiny_llama_store, tmp_path):
    # Bug guarded: one verifier's word excluding an honest newcomer (or holding its tokens
    # back for good). Sound: every stage computes honestly, and one node answers every
    # VerifyRequest 5% off (its stage is honest); the 3 stages stay on probation and each
    # slice has two other nodes to ask, so when the liar disagrees a second opinion sides
    # with the stage. Speed probes are off: they too are VerifyRequests.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes",
                                           speed_probe=ProbeConfig(enabled=False)),
                         engine=EngineConfig(draft="none", resume_wait_s=10, probation_rounds=10_000),
                         audit=AuditConfig(rate=0.0))

    async def main():
        with trio.fail_after(180):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine = c.swarm, c.engine
                nodes = []
                for cls in (Node, Node, LyingVerifier):
                    seed = os.urandom(32)
                    host = await c.nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    await c.nursery.start(node.serve)
                    nodes.append(node)
                liar = nodes[2].host.peer_id
                ring = await _stages(swarm, 3)
                answers = []
                while liar not in swarm.faulty and len(answers) < 6:
                    answers.append(await _generate(engine, 8))
                c.nursery.cancel_scope.cancel()
                return answers, liar, ring, swarm, engine.round_verifier.catches

    answers, liar, ring, swarm, catches = trio.run(main)
    assert liar in swarm.faulty and swarm.faulty[liar].startswith("verifier outvoted"), swarm.faulty
    assert set(swarm.faulty) == {liar} and catches == 0  # no stage was blamed
    assert len(answers[0]) == 8 and all(a == answers[0] for a in answers)
