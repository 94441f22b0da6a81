"""A pool whose spare nodes hold nothing forms and serves: a weight seeder or no role.

Two nodes with memory for the tiny model's layers make the ring; two more have memory for
no layer (so the selector cannot seat them or have them keep a slice warm), which makes
each a weight seeder or nothing by its measured uplink (>= 100 Mbit/s seeds; loopback
under load measures 40-80 Mbit/s, so whether the unshaped one seeds is not fixed here: the
decision itself is pinned in tests/coordinator/swarm/test_formation.py). The 10 Mbit/s
one is given no role: the relay role it used to get is carried out by nobody (issue 24:
no role is assigned that nothing does). Guards the crash issue 24 reported: the
coordinator built the role assignment of a node that holds nothing as LayerRange(0, 0),
which raises, so such a pool could not form; and a node given a role must take it (Ready,
holding nothing) while the ring serves.
"""

from __future__ import annotations

import os

import trio
from transformers import AutoTokenizer

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.swarm.formation import SwarmConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed
from shard.wire.roles import ROLE_WEIGHT_SEEDER
from tests.e2e.ringkit import _run_node, generate_greedy, memory_for_stages

PROMPT = [1, 3 + ord("h"), 3 + ord("i"), 3 + ord("!"), 5, 9, 17]


def test_a_pool_with_nodes_that_hold_nothing_forms_and_serves(tiny_llama_store):
    store = tiny_llama_store
    per_node = memory_for_stages(store, 2)
    no_layer = memory_for_stages(store, store.num_layers) // 4  # below one layer and its K/V

    async def run():
        tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
        config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=4, swarm=SwarmConfig(probe_wait_s=20),
                             engine=EngineConfig(draft="none", probation_rounds=0), receipts=ReceiptConfig(enabled=False))
        async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as coordinator:
            configs = [{"max_memory_bytes": per_node}] * 2 + [{"max_memory_bytes": no_layer},
                                                               {"max_memory_bytes": no_layer, "link_upload_mbps": 10.0}]
            ids = [(await coordinator.nursery.start(_run_node, store, coordinator.addr, c))[1] for c in configs]
            swarm = coordinator.swarm
            with trio.fail_after(60):
                ring = await swarm.wait_ring()
                while not (swarm.plan is not None and all(
                        p in swarm.members and swarm.members[p].assignment is not None
                        and swarm.members[p].ready_epoch >= ring.epoch for p in swarm.plan.roles)):
                    await trio.sleep(0.05)
                tokens = await generate_greedy(coordinator.engine, PROMPT, 8)
            return ring, {p: swarm.members[p].assignment for p in ids}, ids, dict(swarm.held), tokens, dict(swarm.plan.roles)

    ring, assignments, ids, held, tokens, roles = trio.run(run)
    assert {p for p, _ in ring.stages} == set(ids[:2])
    seeder = assignments[ids[2]]
    assert (seeder is None and ids[2] not in roles) or (
        seeder.role == ROLE_WEIGHT_SEEDER and (seeder.layer_start, seeder.layer_end) == (0, 0)), (seeder, roles)
    assert assignments[ids[3]] is None and ids[3] not in roles  # 10 Mbit/s is no seeder's uplink; no relay role
    assert ids[2] not in held and ids[3] not in held  # holding nothing, as their roles say
    assert len(tokens) == 8
