"""A replica ring seating a newcomer "for capacity" drains once joins make it unneeded (issue 20),
on real in-process nodes and a gateway holding no layers.

Two half-model nodes the operator trusts (--trusted-nodes) and one whole-model newcomer,
`--max-rings 2`, `--ring-spares 0`, receipts off: without the newcomer one ring forms, so
it is seated as a ring of its own (nothing trusted can check it). A job runs on that ring
and pauses; two more trusted half-model nodes join. Two rings now form without the
newcomer, so its ring drains (coordinator.swarm.ring_drain): new jobs go to the other
ring, the paused job finishes where it runs with the reference's tokens and no resume,
then the ring re-forms from the two newcomers the operator trusts, the newcomer left out.
The other ring is never touched.
"""

from __future__ import annotations

import os

import torch
import trio

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.trust.audit import AuditConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed, peer_id_of
from shard.node import Node, NodeConfig
from tests.e2e.ringkit import generate_greedy, memory_for_stages
from tests.e2e.test_stalling_stage import _serve_host, _tokenizer
from tests.e2e.test_verifier_ring import layerless_store

PROMPT = [1, 3 + ord("d"), 5, 9, 17, 3 + ord("?")]
TOKENS = 24


def test_a_ring_seating_an_unneeded_newcomer_drains_its_job_then_re_forms_without_it(tiny_llama, tiny_llama_store,
                                                                                      tmp_path):
    # Bug guarded: a running replica ring keeps seating a newcomer nothing trusted can check
    # after joins made it unneeded (answers keep crossing an unchecked stage), or drops it by
    # restarting the ring under a running job. Sound: the reference is transformers' own
    # greedy output; the job was pinned to the newcomer's ring before the join, and the
    # newcomer alone holds the whole model, so only the drain takes it off.
    store = tiny_llama_store
    with torch.no_grad():
        ref = tiny_llama.model.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                                        do_sample=False)[0, len(PROMPT):].tolist()
    seeds = [os.urandom(32) for _ in range(5)]
    trusted = tuple(peer_id_of(keypair_from_seed(s)) for s in seeds[:4])
    newcomer = peer_id_of(keypair_from_seed(seeds[4]))
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=3,
                         swarm=SwarmConfig(max_rings=2, ring_spares=0, probe_wait_s=20, ready_timeout_s=30, drain_s=60,
                                           speed_probe=ProbeConfig(enabled=False)),
                         engine=EngineConfig(draft="none", trusted_nodes=trusted), receipts=ReceiptConfig(enabled=False),
                         audit=AuditConfig(rate=0.0))

    async def main():
        with trio.fail_after(150):
            async with open_coordinator(config, layerless_store(store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, router, out = c.swarm, c.engine, c.engine.router, {}

                async def join(i):
                    host = await c.nursery.start(_serve_host, seeds[i])
                    memory = memory_for_stages(store, 1 if i == 4 else 2)
                    await c.nursery.start(Node(NodeConfig(coordinator=c.addr, max_memory_bytes=memory), host, store,
                                               signing_seed=seeds[i]).serve)

                for i in (0, 1, 4):
                    await join(i)
                while len(swarm.rings) != 2 or swarm._formed_for != frozenset([*trusted[:2], newcomer]):
                    await trio.sleep(0.1)
                x_rid = next(rid for rid, r in swarm.rings.items() if newcomer in {p for p, _ in r.stages})
                epochs = {rid: r.epoch for rid, r in swarm.rings.items()}
                out["seated"] = [r["seated_unverified"] for r in engine.info()["rings"]]

                opened = []  # jobs paused after their first block, until one runs on the newcomer's ring
                while not opened or router.pinned[opened[-1][0].job_id].ring_id != x_rid:
                    assert len(opened) < 3, "no job went to the newcomer's ring"
                    job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
                    blocks = job.next_tokens()
                    opened.append((job, blocks, list(await blocks.__anext__())))
                job, blocks, got = opened[-1]

                for i in (2, 3):
                    await join(i)
                with trio.fail_after(60):  # formation found the newcomer unneeded: its ring drains for the job
                    while x_rid not in swarm.draining:
                        await trio.sleep(0.05)
                out["draining"] = {r["ring_id"]: r["draining"] for r in engine.info()["rings"]}
                out["new_job"] = await generate_greedy(engine, PROMPT, TOKENS)
                out["new_job_ring"] = router.pinned[list(router.pinned)[-1]].ring_id
                out["during"] = {rid: r.epoch for rid, r in swarm.rings.items()}  # nothing re-formed under the job

                async for block in blocks:  # the paused job finishes where it runs
                    got += block
                    if len(got) >= TOKENS:
                        break
                out["job"], out["stats"] = got[:TOKENS], job.stats()
                for j, b, _ in opened:
                    await b.aclose()
                    await j.aclose()

                with trio.fail_after(60):  # drained: the ring re-forms, the newcomer left out
                    while x_rid not in swarm.rings or swarm.rings[x_rid].epoch == epochs[x_rid]:
                        await trio.sleep(0.05)
                out["after"] = {rid: {p for p, _ in r.stages} for rid, r in swarm.rings.items()}
                out["after_epochs"] = {rid: r.epoch for rid, r in swarm.rings.items()}
                out["last"] = await generate_greedy(engine, PROMPT, TOKENS)
                info = engine.info()["rings"]
                out["last_info"] = [(r["seated_unverified"], r["draining"]) for r in info]
                c.nursery.cancel_scope.cancel()
                out["x_rid"], out["epochs"] = x_rid, epochs
                return out

    out = trio.run(main)
    x_rid, epochs = out["x_rid"], out["epochs"]
    (other,) = set(epochs) - {x_rid}
    assert out["seated"][x_rid] == [newcomer] and out["seated"][other] == []  # seated for capacity at first
    assert "newcomer(s)" in out["draining"][x_rid] and out["draining"][other] is None
    assert out["new_job"] == ref and out["new_job_ring"] == other  # new jobs went elsewhere
    assert out["during"] == epochs
    assert out["job"] == ref and out["stats"]["resumes"] == 0 and out["stats"]["ring_epoch"] == epochs[x_rid]
    assert out["after"][x_rid] == set(trusted[2:]) and newcomer not in set().union(*out["after"].values())
    assert out["after_epochs"][other] == epochs[other]  # the ring seating no newcomer was never disturbed
    assert out["last"] == ref and out["last_info"] == [([], None), ([], None)]
