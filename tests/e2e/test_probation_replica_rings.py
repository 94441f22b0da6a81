"""Replica rings keep off a newcomer nothing trusted can check when both rings form
without it (issue 20), on real in-process nodes and a gateway holding no layers.

Four half-model nodes the operator trusts (--trusted-nodes) and one whole-model newcomer,
`--max-rings 2`, `--ring-spares 0`, receipts off (so no verifier node can check a round
and the newcomer is unverifiable: coordinator.trust.opinions.unverifiable). Without the
preference the newcomer is a one-stage ring of its own (the fewest hops), beside one ring
of two trusted nodes; with it, the trusted nodes make both rings and the newcomer is left
off (coordinator.swarm.ring_set.prefer_verifiable), and formation does not decide again
and again.
"""

from __future__ import annotations

import os

import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed, peer_id_of
from shard.node import Node, NodeConfig
from tests.e2e.ringkit import memory_for_stages
from tests.e2e.test_stalling_stage import _generate, _serve_host, _tokenizer
from tests.e2e.test_verifier_ring import layerless_store


def test_two_rings_form_from_trusted_nodes_and_the_unverifiable_newcomer_stays_off(tiny_llama_store, tmp_path):
    # Bug guarded: the multi-ring path seating a newcomer nothing trusted can check (its
    # rounds out unverified) though the pool forms both rings without it. Sound: the
    # newcomer alone holds the whole model, so the selector would make it a ring of its own.
    store = tiny_llama_store
    seeds = [os.urandom(32) for _ in range(5)]
    trusted = tuple(peer_id_of(keypair_from_seed(s)) for s in seeds[:4])
    newcomer = peer_id_of(keypair_from_seed(seeds[4]))
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=5,
                         swarm=SwarmConfig(max_rings=2, ring_spares=0, probe_wait_s=20, ready_timeout_s=30,
                                           speed_probe=ProbeConfig(enabled=False)),
                         engine=EngineConfig(draft="none", trusted_nodes=trusted), receipts=ReceiptConfig(enabled=False),
                         audit=AuditConfig(rate=0.0))

    async def main():
        with trio.fail_after(150):
            async with open_coordinator(config, layerless_store(store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, out = c.swarm, c.engine, {}
                for i, seed in enumerate(seeds):
                    memory = memory_for_stages(store, 2 if i < 4 else 1)
                    host = await c.nursery.start(_serve_host, seed)
                    await c.nursery.start(Node(NodeConfig(coordinator=c.addr, max_memory_bytes=memory), host, store,
                                               signing_seed=seed).serve)
                while len(swarm.rings) != 2 or swarm._formed_for != frozenset([*trusted, newcomer]):
                    await trio.sleep(0.1)
                out["rings"] = {rid: {p for p, _ in r.stages} for rid, r in swarm.rings.items()}
                epochs = {rid: r.epoch for rid, r in swarm.rings.items()}
                await trio.sleep(3)  # a formation deciding again and again would move an epoch meanwhile
                out["stable"] = epochs == {rid: r.epoch for rid, r in swarm.rings.items()}
                out["answers"] = [await _generate(engine, 8) for _ in range(2)]
                out["info"] = engine.info()
                c.nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    seated = set().union(*out["rings"].values())
    assert newcomer not in seated and seated == set(trusted), out["rings"]
    assert all(len(peers) == 2 for peers in out["rings"].values()) and out["stable"]
    assert all(len(a) == 8 for a in out["answers"])
    info = out["info"]
    assert info["probation"]["seated_unverified"] is None
    assert [r["seated_unverified"] for r in info["rings"]] == [[], []]
