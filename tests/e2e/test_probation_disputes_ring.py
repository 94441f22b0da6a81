"""A lone newcomer's word never frames another newcomer, on a real in-process ring whose
gateway holds no layers and lists no trusted key (issue 20).

An honest newcomer H1 and a newcomer L whose stage is honest but whose every recomputation
as a verifier is 5% off form a two-stage ring; each can be checked only by the other. L's
word against H1 (one against one) must mark nobody faulty: both sit out as disputed, the
round is held back, and the job resumes on a ring without the pair. H1 then leaves and an
honest H2 joins; the job resumes on H2 alone, checked only by L: L's second dispute, with
a partner who disputed with nobody else, marks L faulty, and H2 serves the answer (under
the default `--unverified-newcomers serve`: nothing trusted checked H2; under `refuse` the
request would end 503, as for any round only newcomers checked).
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
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from tests.e2e.ringkit import generate_greedy_with_stats
from tests.e2e.test_stalling_stage import PROMPT, _generate, _serve_host, _stages, _tokenizer
from tests.e2e.test_verifier_ring import LyingNode as LyingVerifier
from tests.e2e.test_verifier_ring import layerless_store


async def _join(cls, addr, store, task_status=trio.TASK_STATUS_IGNORED):
    """Start a `cls` node on its own host; started with (peer id, the scope that stops it)."""
    with trio.CancelScope() as scope:
        seed = os.urandom(32)
        async with trio.open_nursery() as nursery:
            host = await nursery.start(_serve_host, seed)
            await nursery.start(cls(NodeConfig(coordinator=addr), host, store, signing_seed=seed).serve)
            task_status.started((host.peer_id, scope))


def test_a_lying_newcomer_verifier_frames_nobody_and_is_found_by_its_second_dispute(tiny_llama_store, tmp_path):
    # Bug guarded: one newcomer verifier's word against a newcomer stage marking the stage
    # faulty (it was: settle gives a lone verifier the win), and a verifier that disputes
    # with every node it meets never being excluded. Sound: no key is trusted and the
    # gateway holds no layer, so the only checks are the two nodes' of each other; both
    # stages compute honestly, so any faulty mark on H1 or H2 is a framing; L's lie is 5%
    # of every recomputed row, so it disagrees at every check; the reference is H1's
    # answer alone, and greedy decoding of the same weights on H2 must equal it.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=1,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes",
                                           speed_probe=ProbeConfig(enabled=False)),  # they are VerifyRequests too
                         engine=EngineConfig(draft="none", resume_wait_s=20, probation_rounds=10_000),
                         audit=AuditConfig(rate=0.0))

    async def main():
        with trio.fail_after(150):
            async with open_coordinator(config, layerless_store(tiny_llama_store, tmp_path), _tokenizer(),
                                        keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, out = c.swarm, c.engine, {}

                async def join(cls):
                    return await c.nursery.start(_join, cls, c.addr, tiny_llama_store)

                h1, h1_scope = await join(Node)
                await _stages(swarm, 1)
                out["reference"] = await _generate(engine, 8)
                liar, _ = await join(LyingVerifier)
                assert await _stages(swarm, 2) == {h1, liar}

                async def ask():
                    out["answer"], out["stats"] = await generate_greedy_with_stats(engine, PROMPT, 8)

                c.nursery.start_soon(ask)
                # Both checks of the round answered (H1's of L too: H1 must not leave mid-check).
                while h1 not in swarm.unreachable.sitting_out() or engine.round_verifier.checks < 2:
                    await trio.sleep(0.05)
                out["phase1"] = dict(faulty=dict(swarm.faulty), out=swarm.unreachable.sitting_out(),
                                     disputes=engine.info()["probation"]["disputes"])
                h1_scope.cancel()  # H1 leaves: the job's next ring is H2 alone, checked by L alone
                h2, _ = await join(Node)
                while "answer" not in out:
                    await trio.sleep(0.05)
                out.update(h1=h1, h2=h2, liar=liar, faulty=dict(swarm.faulty), clean=dict(engine.clean_rounds),
                           sitting_out=swarm.unreachable.sitting_out(), info=engine.info()["probation"])
                c.nursery.cancel_scope.cancel()
                return out

    out = trio.run(main)
    h1, h2, liar, phase1 = out["h1"], out["h2"], out["liar"], out["phase1"]
    # One against one: nobody faulty, both sit out as disputed, the dispute shown on /v1/ring.
    assert phase1["faulty"] == {}
    assert phase1["out"][h1].startswith(f"disputed: disputed with {liar[-6:]} over layers [")
    assert phase1["out"][liar].startswith(f"disputed: disputed with {h1[-6:]} over layers [")
    assert [set(d["nodes"]) for d in phase1["disputes"]] == [{h1, liar}]
    # Its second partner disputed with nobody else: the liar is found, the honest never.
    assert set(out["faulty"]) == {liar} and out["faulty"][liar].startswith("in dispute with "), out["faulty"]
    assert h2 not in out["sitting_out"] and out["info"]["disputes"] == []  # settled, H2 readmitted
    assert all(n == 0 for n in out["clean"].values())  # nothing trusted checked anyone: no credit
    assert out["info"]["rounds_unverified"] >= 1  # served (policy serve) as checked by no trusted party
    assert len(out["reference"]) == 8 and out["answer"] == out["reference"]
    # H2's round passed once its only dissenter was found lying, rather than held back with
    # H2 readmitted on the same ring: the job would then wait resume_wait_s (20 s) for a
    # ring change that never comes before its first token.
    assert out["stats"]["ttft_s"] < 10, out["stats"]
