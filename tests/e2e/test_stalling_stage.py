"""A stage that accepts frames and never answers, on a real in-process ring (issue 20).

The red team's staller registered, was seated, and then every request took 520 s and
ended in 503 while it stayed in the ring for 17 minutes. Here two honest Nodes serve a
request; then a third joins whose stage computes every frame and never sends it on (its
send to the successor sleeps: no production flag). The next request must miss one round's
deadline, blame the newcomer, resume on a ring without it, and answer exactly what the
honest ring answered; the newcomer must be out of the ring within 10 s of the missed
deadline.
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
from shard.identity import keypair_from_seed
from shard.node import Node, NodeConfig
from shard.transport import open_host

PROMPT = [1, 3 + ord("h"), 3 + ord("i"), 3 + ord("!"), 5, 9, 17]


class StallingNode(Node):
    """Reads and computes every frame, and never forwards one."""

    async def _send_ring(self, state, body: bytes) -> None:
        await trio.sleep_forever()


def _tokenizer():
    from tests.conftest import make_tiny_tokenizer

    return make_tiny_tokenizer()


async def _serve_host(seed, task_status=trio.TASK_STATUS_IGNORED):
    async with open_host(keypair_from_seed(seed), "/ip4/127.0.0.1/tcp/0") as host:
        task_status.started(host)
        await trio.sleep_forever()


async def _generate(engine, tokens: int) -> list[int]:
    job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
    got: list[int] = []
    try:
        async for block in job.next_tokens():
            got += block
            if len(got) >= tokens:
                break
    finally:
        await job.aclose()
    return got[:tokens]


async def _stages(swarm, count: int) -> set:
    while swarm.ring is None or len(swarm.ring.stages) != count:
        if swarm.ring is None:
            await swarm.wait_ring()
        else:
            await swarm.wait_change(swarm.ring.epoch, 5)
    return {p for p, _ in swarm.ring.stages}


def test_a_stalling_newcomer_costs_one_deadline_and_is_out_of_the_ring_within_10_s(tiny_llama_store):
    # Sound: the staller holds every frame it is sent, so the request can only finish on a
    # ring without it; its tokens are compared with the honest ring's for the same greedy
    # request (lossless resume), and the exclusion time is read off the same trio clock.
    config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2,
                         swarm=SwarmConfig(ready_timeout_s=30, planner="all_nodes"),
                         engine=EngineConfig(draft="none", resume_wait_s=10))

    async def main():
        with trio.fail_after(120):
            async with open_coordinator(config, tiny_llama_store, _tokenizer(), keypair_from_seed(os.urandom(32))) as c:
                swarm, engine, nursery = c.swarm, c.engine, c.nursery
                nodes = []
                for cls in (Node, Node, StallingNode):
                    seed = os.urandom(32)
                    host = await nursery.start(_serve_host, seed)
                    node = cls(NodeConfig(coordinator=c.addr), host, tiny_llama_store, signing_seed=seed)
                    if cls is StallingNode:
                        honest = await _stages(swarm, 2)
                        reference = await _generate(engine, 8)
                    await nursery.start(node.serve)
                    nodes.append(node)
                staller = nodes[2].host.peer_id
                assert staller in await _stages(swarm, 3)
                missed_at: list[float] = []
                blame = engine.round_missed

                def round_missed(ring, round):
                    missed_at.append(trio.current_time())
                    blame(ring, round)

                engine.round_missed = round_missed
                t0 = trio.current_time()
                got = await _generate(engine, 8)
                ring_after = {p for p, _ in swarm.ring.stages}
                out_at = trio.current_time()  # the request finished on a ring without the staller
                nursery.cancel_scope.cancel()
                return honest, reference, got, missed_at, t0, out_at, ring_after, staller, swarm

    honest, reference, got, missed_at, t0, out_at, ring_after, staller, swarm = trio.run(main)
    assert len(reference) == 8 and got == reference
    assert missed_at, "no round missed its deadline"
    assert staller not in ring_after and ring_after == honest
    assert out_at - missed_at[0] < 10.0, (missed_at, out_at)
    assert swarm.unreachable.table[staller].kind == "stalled"
    assert all(swarm.unreachable.table.get(p) is None for p in honest)
