"""Long prompts verified in parts, on real in-process rings whose gateway holds no layers (issue 20).

A stage's frames of one job past one control frame used to go out unverified (probation)
and unaudited (audits): the verify request was refused as too large. Here every verify
request and reply is cut into VerifyParts (AuditConfig.verify_part_bytes = 8 KiB stands in
for the 6.8 MB control frame of SmolLM2, which a 2k-token prompt passes; the tiny model's
160-token prompt is 41 KB of f32 rows a stage), so nothing is checked unless the parts go
through: an honest newcomer must earn its rounds, a liar must be caught on the long
prompt, and every answer must equal the honest ring's greedy one.
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
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from tests.e2e.test_audit_members_ring import TurningLiar
from tests.e2e.test_stalling_stage import _serve_host, _stages, _tokenizer
from tests.e2e.ringkit import generate_greedy
from tests.e2e.test_verifier_ring import layerless_store

LONG_PROMPT = [1] + [3 + (7 * i) % 256 for i in range(159)]  # 160 tokens: 41 KB of f32 rows per stage
PART_BYTES = 8192
CLEAN_ROUNDS = 6


class LongPromptLiar(Node):
    """Honest on every row before position LIE_FROM, noise (half the row's std) on the rest:
    it lies only where a check needs the frames of a long prompt."""

    LIE_FROM = 100

    async def _assume(self, a):
        await super()._assume(a)
        stage = self.state.worker.stage
        honest = stage.forward_batch

        def lying(frames):
            outs = honest(frames)
            for i, (frame, out) in enumerate(zip(frames, outs)):
                if not isinstance(out, Exception):
                    late = (frame.positions >= self.LIE_FROM).unsqueeze(-1)  # (T, 1)
                    outs[i] = (torch.where(late, out[0] + 0.5 * out[0].std() * torch.randn(out[0].shape), out[0]), out[1])
            return outs

        stage.forward_batch = lying


async def generate(engine, tokens: int) -> list[int]:
    return await generate_greedy(engine, LONG_PROMPT, tokens)


def test_a_long_prompt_on_probation_is_verified_in_parts_and_a_liar_caught(tiny_llama_store, tmp_path):
    # Sound: audits are off (rate 0) and the gateway holds no layer, so only a verifier
    # node's check can have passed the honest stages or excluded the liar; every check
    # carries the whole prompt's frames (past PART_BYTES), so none happened whole (the
    # nodes' and the gateway's put-together counts); the liar corrupts every row from
    # position 100 on, which only a check of the long prompt's later frames can see.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10, probation_rounds=CLEAN_ROUNDS),
                         audit=AuditConfig(rate=0.0, verify_part_bytes=PART_BYTES))

    async def main():
        with trio.fail_after(240):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, nursery = c.swarm, c.engine, c.nursery
                nodes, out = [], {}
                for cls in (Node, Node, LongPromptLiar):
                    seed = os.urandom(32)
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    if cls is LongPromptLiar:
                        out["honest"] = await _stages(swarm, 2)
                        out["reference"] = await generate(engine, 8)
                        out["checks_before"] = engine.round_verifier.checks
                    await nursery.start(node.serve)
                    nodes.append(node)
                out["liar"] = liar = nodes[2].host.peer_id
                assert liar in await _stages(swarm, 3)
                out["answers"] = [await generate(engine, 8) for _ in range(2)]
                out["uploads"] = [n.verifier.uploads.completed if n.verifier and n.verifier.uploads else 0
                                  for n in nodes[:2]]
                out["reply_parts"] = c.auditor.replies.parts.completed
                out["catches"] = engine.round_verifier.catches
                nursery.cancel_scope.cancel()
                out["swarm"] = swarm
                return out

    out = trio.run(main)
    honest, liar, swarm = out["honest"], out["liar"], out["swarm"]
    assert liar not in honest
    assert out["checks_before"] >= 2  # the honest newcomers' long rounds were checked (by each other), in parts
    assert len(out["reference"]) == 8 and out["answers"] == [out["reference"]] * 2  # 0 wrong tokens delivered
    assert liar in swarm.faulty and "recomputation of verifier node" in swarm.faulty[liar]
    assert set(swarm.faulty) == {liar} and out["catches"] == 1
    assert sum(out["uploads"]) >= 2 and out["reply_parts"] >= 2  # requests and replies both went in parts


def test_a_long_prompt_is_audited_in_parts_and_a_liar_past_probation_caught(tiny_llama_store, tmp_path):
    # Sound: the gateway holds no layer and every node is a stage, so only another stage
    # can have recomputed the liar's slice, from a request in parts; no probation (audits
    # alone check); audit rate 1: every job's every stage is audited, so the first long
    # job after the liar turns is a catch, and the two before it pass (6 audits).
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10, probation_rounds=0),
                         audit=AuditConfig(rate=1.0, verify_part_bytes=PART_BYTES))

    async def main():
        with trio.fail_after(240):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, auditor, nursery = c.swarm, c.engine, c.auditor, c.nursery
                nodes = []
                for cls in (Node, Node, TurningLiar):
                    seed = os.urandom(32)
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    await nursery.start(node.serve)
                    nodes.append(node)
                liar = nodes[2].host.peer_id
                out = {"liar": liar, "ring": await _stages(swarm, 3)}
                for _ in range(2):
                    out["reference"] = await generate(engine, 8)
                    await auditor.wait_idle()
                out["clean_audits"], out["faulty_before"] = auditor.stats.audits, dict(swarm.faulty)
                nodes[2].turned = True
                out["answer"] = await generate(engine, 8)
                await auditor.wait_idle()
                out["reply_parts"] = auditor.replies.parts.completed
                nursery.cancel_scope.cancel()
                out.update(swarm=swarm, stats=auditor.stats)
                return out

    out = trio.run(main)
    liar, swarm, stats = out["liar"], out["swarm"], out["stats"]
    assert out["clean_audits"] == 6 and out["faulty_before"] == {}  # honest long jobs audited and passed
    assert liar in swarm.faulty and swarm.faulty[liar].startswith("audit "), swarm.faulty
    assert set(swarm.faulty) == {liar} and stats.by_members >= stats.audits > 0 and stats.by_coordinator == 0
    # The first long job's three audits came back in parts (every row of its 160-token prompt);
    # the later jobs fork from it (the prefix cache) and their requests carry its frames first,
    # but a verifier answers none of a source's rows (never compared: docs/protocol.md), so
    # their replies carry their own few rows, in one frame.
    assert stats.skipped_no_verifier == 0 and out["reply_parts"] >= 3
