"""Colluding fresh keys on a real in-process ring whose gateway holds no layers (issue 20).

Two newcomers that lie the same way (every output of their stage, and every recomputation
they send as verifiers, goes through the same elementwise corruption) agree with each
other's lies. Checked only by each other they must earn no credit (they never leave
probation), the round goes out only as the operator's `--unverified-newcomers` allows
(`serve`: released and counted, /v1/ring says why; `refuse`: a 503 naming them), and once
a trusted node can recompute their slices their lies are never released: the trusted
recomputation outvotes them both.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.errors import UnverifiedNewcomers
from coordinator.gateway.api import request_error_for
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed, peer_id_of
from shard.node import Node, NodeConfig
from shard.wire.messages import VerifyReply
from tests.e2e.test_stalling_stage import _generate, _serve_host, _stages, _tokenizer
from tests.e2e.test_verifier_ring import layerless_store


def collude(x):
    """The pair's shared lie: elementwise, so a stage's per-frame outputs and a verifier's
    replay of the same rows come out identical (and not a pure scale: RMSNorm undoes those)."""
    return x * 1.3 + 0.2


class Colluder(Node):
    """A stage whose outputs, and a verifier whose recomputations, all go through `collude`."""

    async def _assume(self, a):
        await super()._assume(a)
        stage = self.state.worker.stage
        honest = stage.forward_batch

        def lying(frames):
            return [out if isinstance(out, Exception) else (collude(out[0]), out[1]) for out in honest(frames)]

        stage.forward_batch = lying

    async def _send_control(self, msg) -> None:
        if isinstance(msg, VerifyReply) and msg.hidden is not None:
            msg.hidden.copy_(collude(msg.hidden))
        await super()._send_control(msg)


def _config(nodes: int, trusted: tuple[str, ...] = ()) -> CoordConfig:
    # Speed probes off: they are VerifyRequests too, which the colluders corrupt.
    return CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=nodes,
                       swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes", speed_probe=ProbeConfig(enabled=False)),
                       engine=EngineConfig(draft="none", resume_wait_s=10, probation_rounds=4, trusted_nodes=trusted),
                       audit=AuditConfig(rate=0.0))


def test_two_colluders_alone_never_leave_probation_and_refuse_answers_503(tiny_llama_store, tmp_path):
    # Bug guarded: a sybil pair leaving probation on each other's word (each check of one by
    # the other passed, and was credited), and the refuse policy still releasing tokens no
    # trusted party checked. Sound: probation_rounds is 4 and each request is 9 rounds, so
    # one credited check would take them off probation; the only verifiers are the pair.
    async def main():
        with trio.fail_after(180):
            async with open_coordinator(_config(2), layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, out = c.swarm, c.engine, {}
                for _ in range(2):
                    seed = os.urandom(32)
                    host = await c.nursery.start(_serve_host, seed)
                    await c.nursery.start(Colluder(NodeConfig(coordinator=c.addr), host, tiny_llama_store,
                                                   signing_seed=seed).serve)
                out["pair"] = await _stages(swarm, 2)
                out["served"] = [await _generate(engine, 8) for _ in range(2)]
                out["info"], out["clean"] = engine.info()["probation"], dict(engine.clean_rounds)
                out["checks"] = engine.round_verifier.checks
                engine.config = dataclasses.replace(engine.config, unverified_newcomers="refuse")
                with pytest.raises(UnverifiedNewcomers) as refused:
                    await _generate(engine, 8)
                out["refused"], out["refused_info"] = refused.value, engine.info()["probation"]
                out["faulty"] = dict(swarm.faulty)
                c.nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    pair = out["pair"]
    assert out["checks"] >= 2 and out["faulty"] == {}  # they checked each other, and agreed
    assert all(out["clean"].get(p, 0) == 0 for p in pair), out["clean"]  # ... and earned nothing
    info = out["info"]
    assert info["rounds_verified"] == "no" and info["policy"] == "serve" and info["rounds_unverified"] >= 2
    assert "checked only by nodes on probation" in info["why_not"]
    # Seated only because no ring forms without them, and /v1/ring says so.
    assert "seated though neither the gateway nor a trusted node" in info["seated_unverified"]
    refused = out["refused"]
    assert set(refused.newcomers) <= set(pair) and refused.newcomers
    err = request_error_for(refused)
    assert err.status == 503 and "\n" not in str(refused) and "--trusted-nodes" in str(refused)
    assert out["refused_info"]["rounds_refused"] == 1


def test_a_trusted_node_outvotes_two_colluding_newcomers(tiny_llama_store, tmp_path):
    # Bug guarded: a trusted verifier that disagrees with a lying newcomer outvoted by the
    # liar's fresh friend (two parties against one), the lie released, the trusted node
    # excluded. Sound: the reference comes from the trusted node alone; the colluders
    # corrupt every output of 2 of the 3 stages (x * 1.3 + 0.2 on the residual stream),
    # and audits are off, so only probation can keep their rounds back.
    seed_trusted = os.urandom(32)
    trusted = peer_id_of(keypair_from_seed(seed_trusted))

    async def main():
        with trio.fail_after(180):
            async with open_coordinator(_config(1, (trusted,)), layerless_store(tiny_llama_store, tmp_path),
                                        _tokenizer(), keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, out, nodes = c.swarm, c.engine, {}, []
                for cls, seed in ((Node, seed_trusted), (Colluder, os.urandom(32)), (Colluder, os.urandom(32))):
                    host = await c.nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    await c.nursery.start(node.serve)
                    nodes.append(node)
                    if cls is Node:
                        assert await _stages(swarm, 1) == {trusted}
                        out["reference"] = await _generate(engine, 8)
                out["pair"] = pair = [n.host.peer_id for n in nodes[1:]]
                ring = await _stages(swarm, 3)
                assert set(pair) <= set(ring)
                out["answers"] = [await _generate(engine, 8) for _ in range(3)]
                out["clean"], out["faulty"] = dict(engine.clean_rounds), dict(swarm.faulty)
                out["seated_unverified"] = engine.info()["probation"]["seated_unverified"]
                c.nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    assert len(out["reference"]) == 8 and out["answers"] == [out["reference"]] * 3  # no lie released
    assert all(p in out["faulty"] for p in out["pair"]), out["faulty"]
    assert trusted not in out["faulty"] and all(out["clean"].get(p, 0) == 0 for p in out["pair"])
    assert out["seated_unverified"] is None  # the trusted node keeps every slice: they were checkable


def test_a_newcomer_nothing_trusted_can_check_is_kept_off_a_ring_that_forms_without_it(tiny_llama_store, tmp_path):
    # Bug guarded: a newcomer seated though the ring formed as well without it and nothing
    # trusted could check it (its rounds would go out unverified); or formation, having
    # left it out, deciding again and again (its eligible members never matching the
    # ring's). Sound: receipts are off (no verifier node can check a round) and the gateway
    # holds no layer, so only the trusted node's ring is checkable; every node is a stage
    # under planner all_nodes, so the newcomer would be seated if nothing preferred otherwise.
    seed_trusted = os.urandom(32)
    trusted = peer_id_of(keypair_from_seed(seed_trusted))
    config = dataclasses.replace(_config(1, (trusted,)), receipts=ReceiptConfig(enabled=False))

    async def main():
        with trio.fail_after(120):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, out = c.swarm, c.engine, {}
                for seed in (seed_trusted, os.urandom(32)):
                    host = await c.nursery.start(_serve_host, seed)
                    await c.nursery.start(Node(NodeConfig(coordinator=c.addr), host, tiny_llama_store,
                                               signing_seed=seed).serve)
                    if seed == seed_trusted:
                        assert await _stages(swarm, 1) == {trusted}
                        out["epoch"] = swarm.ring.epoch
                out["newcomer"] = newcomer = host.peer_id
                while swarm._formed_for != frozenset({trusted, newcomer}):  # decided with the newcomer registered
                    await trio.sleep(0.2)
                await trio.sleep(3)  # a formation deciding again and again would move the epoch meanwhile
                out["stages"], out["epoch_after"] = {p for p, _ in swarm.ring.stages}, swarm.ring.epoch
                out["answer"], out["info"] = await _generate(engine, 8), engine.info()["probation"]
                c.nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    assert out["stages"] == {trusted} and out["epoch_after"] == out["epoch"]
    assert len(out["answer"]) == 8 and out["info"]["seated_unverified"] is None
