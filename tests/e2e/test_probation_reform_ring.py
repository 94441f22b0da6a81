"""Formation runs again when trust changes, not only membership (issue 20), on a real
in-process ring whose gateway holds no layers.

A newcomer that nothing trusted can check is kept off a ring that forms without it
(coordinator.swarm.forming.prefer_verifiable). Once a member able to check it leaves
probation, with no node joining or leaving, the swarm's loop sees its trusted members
change (Swarm.trusted, looked at every TRUST_POLL_S while a newcomer was kept off) and forms again: the newcomer is
seated, and /v1/ring no longer names anyone seated unverified.
"""

from __future__ import annotations

import dataclasses
import os

import trio

from coordinator.assembly import open_coordinator
from coordinator.trust import probation
from shard.identity import keypair_from_seed, peer_id_of
from shard.node import Node, NodeConfig
from shard.wire.messages import Register
from tests.e2e.test_probation_sybil_ring import _config
from tests.e2e.test_stalling_stage import _generate, _serve_host, _tokenizer
from tests.e2e.test_verifier_ring import layerless_store


class KeepsNothing(Node):
    """An honest node whose registration claims no layer files: as a trusted member it can
    check no newcomer's slice (coordinator.trust.opinions.unverifiable), so only another
    member keeping the files can."""

    async def _send_control(self, msg) -> None:
        if isinstance(msg, Register):
            msg = dataclasses.replace(msg, stored_files=())
        await super()._send_control(msg)


def test_a_newcomer_kept_off_is_seated_once_a_member_keeping_its_slice_leaves_probation(tiny_llama_store, tmp_path):
    # Bug guarded: a newcomer kept off staying off until some node joins or leaves, though a
    # member keeping its slice left probation meanwhile (formation ran only on membership
    # changes). Sound: after `keeper` and `newcomer` registered, membership never changes;
    # planner all_nodes seats every node it may, so both stay off only by the preference
    # (the trusted node keeps nothing, the keeper is on probation), and only `keeper`'s
    # credit (what probation_rounds verified rounds would earn it) changes afterwards.
    seed_trusted = os.urandom(32)
    trusted = peer_id_of(keypair_from_seed(seed_trusted))

    async def main():
        with trio.fail_after(150):
            async with open_coordinator(_config(1, (trusted,)), layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, out, peers = c.swarm, c.engine, {}, []
                for cls, seed in ((KeepsNothing, seed_trusted), (Node, os.urandom(32)), (Node, os.urandom(32))):
                    host = await c.nursery.start(_serve_host, seed)
                    await c.nursery.start(cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store,
                                              signing_seed=seed).serve)
                    peers.append(host.peer_id)
                    if cls is KeepsNothing:
                        await swarm.wait_ring()
                out["keeper"], out["newcomer"] = keeper, _ = peers[1], peers[2]
                while swarm._formed_for != frozenset(peers):  # decided with all three registered
                    await trio.sleep(0.1)
                out["before"], out["matters"] = {p for p, _ in swarm.ring.stages}, swarm.trust_matters
                out["answer_before"] = await _generate(engine, 8)
                engine.clean_rounds = probation.credit(engine.clean_rounds, [keeper], engine.probation.clean_rounds)
                t0 = trio.current_time()
                while len(swarm.ring.stages) != 3:
                    await swarm.wait_change(swarm.ring.epoch, 5)
                    await swarm.wait_ring()
                out["reformed_s"], out["after"] = trio.current_time() - t0, {p for p, _ in swarm.ring.stages}
                out["answer_after"], out["info"] = await _generate(engine, 8), engine.info()
                c.nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    assert out["before"] == {trusted} and out["matters"]  # both newcomers kept off: trust is watched
    assert out["after"] == out["before"] | {out["keeper"], out["newcomer"]}
    assert out["reformed_s"] < 30, out["reformed_s"]
    assert len(out["answer_before"]) == 8 and out["answer_after"] == out["answer_before"]
    info = out["info"]
    assert info["probation"]["seated_unverified"] is None
    assert all(r["seated_unverified"] == [] for r in info["rings"]), info["rings"]
