"""One ring (--max-rings 1): a node joining does not restart a running job (issue 21).

Two nodes that each hold about half the tiny model form the ring; a third that can hold
all of it joins while a job is paused mid-generation. The selector now prefers the
one-node ring, but the re-form waits for the running job (coordinator.swarm.forming.drain):
the job finishes with no resume and the output it has alone, and only then the ring
re-forms (a new epoch) with the newcomer.
"""

from __future__ import annotations

import os
from contextlib import aclosing

import trio
from transformers import AutoTokenizer

from coordinator.assembly import open_coordinator
from coordinator.config import LOOPBACK_ANY_PORT, CoordConfig
from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.sampling import SamplingParams
from coordinator.swarm.formation import SwarmConfig
from coordinator.swarm.speed_probe import ProbeConfig
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed
from tests.e2e.ringkit import _run_node, generate_greedy, memory_for_stages

PROMPT = [1, 3 + ord("j"), 5, 9, 17, 3 + ord("!")]
TOKENS = 24


def test_a_join_waits_for_the_running_job_before_the_ring_re_forms(tiny_llama_store):
    store = tiny_llama_store

    async def run():
        tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
        # Seated on the speeds each node measured itself: the coordinator's speed probe times
        # nodes from this test's one shared event loop, and in a loaded suite it read the
        # newcomer 86x its claim (25.8 ms per tiny layer, the ring's nodes ~50x), so the
        # selector rightly kept the ring and no drain began (tests/coordinator/swarm/
        # test_speed_probe*.py test the probe).
        swarm_config = SwarmConfig(probe_wait_s=20, drain_s=60, speed_probe=ProbeConfig(enabled=False))
        config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2, swarm=swarm_config,
                             engine=EngineConfig(draft="none", probation_rounds=0),
                             receipts=ReceiptConfig(enabled=False))
        async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as coordinator:
            swarm, engine = coordinator.swarm, coordinator.engine
            half = {"max_memory_bytes": memory_for_stages(store, 2)}
            for _ in range(2):
                await coordinator.nursery.start(_run_node, store, coordinator.addr, half)
            with trio.fail_after(90):
                first = await swarm.wait_ring()
            assert len(first.stages) == 2
            alone = await generate_greedy(engine, PROMPT, TOKENS)

            job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
            out: list[int] = []
            joined = False
            try:
                async with aclosing(job.next_tokens()) as blocks:
                    async for block in blocks:
                        out += block
                        if not joined:
                            joined = True
                            whole = {"max_memory_bytes": memory_for_stages(store, 1)}
                            _, newcomer, _ = await coordinator.nursery.start(_run_node, store, coordinator.addr, whole)
                            with trio.fail_after(60):  # formation chose the new ring and is draining for this job
                                while swarm.drain_until is None:
                                    await trio.sleep(0.05)
                            await trio.sleep(1.0)
                            assert swarm.ring == first  # not re-formed under the running job
                        if len(out) >= TOKENS:
                            break
                stats = job.stats()
            finally:
                await job.aclose()
            assert out[:TOKENS] == alone
            assert stats["resumes"] == 0 and stats["ring_epoch"] == first.epoch
            with trio.fail_after(60):  # the job is done: the ring re-forms with the newcomer
                while swarm.ring is None or swarm.ring.epoch == first.epoch:
                    await trio.sleep(0.05)
            assert newcomer in {p for p, _ in swarm.ring.stages}
            assert await generate_greedy(engine, PROMPT, TOKENS) == alone
            coordinator.nursery.cancel_scope.cancel()

    trio.run(run)
