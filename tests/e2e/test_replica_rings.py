"""Replica rings on real nodes (issue 21): six nodes that each hold half the tiny model form
two rings; a node joining never restarts a running job; requests spread over both rings
with outputs equal to the prompt run alone; a ring losing a node loses no token.

Order, in one coordinator (--max-rings 2, --ring-spares 0, so which nodes make which ring
does not hang on measured speeds: the default spares are pinned in test_ring_set.py): two
nodes form the first ring. A job is opened and paused after its first tokens; two more
nodes join and the second ring forms beside the first, and the paused job then finishes
with no resume (it never re-prefilled) and the output it has alone. Two more nodes join
(roles: the rings are at their bound). Concurrent requests are routed over both rings, and
a node of the second ring is killed while they run: every output still equals its own alone.
Probation is on (the default): newcomers' rounds are recomputed by the coordinator's one
shadow chain, one ring at a time (coordinator.jobs.ring_router.routable), and no honest
node is blamed.
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
from coordinator.trust.receipt_check import ReceiptConfig
from shard.identity import keypair_from_seed
from tests.e2e.ringkit import _run_node, generate_greedy, generate_greedy_with_stats, memory_for_stages

PROMPTS = [[1, 3 + ord(c), 5, 9 + i, 17, 3 + ord("!")] for i, c in enumerate("abcdef")]
TOKENS = 24


async def _wait(condition, seconds: float, what: str, swarm) -> None:
    with trio.move_on_after(seconds) as scope:
        while not condition():
            await trio.sleep(0.05)
    assert not scope.cancelled_caught, f"{what} within {seconds} s (rings {swarm.rings})"


def test_six_half_model_nodes_serve_as_two_rings_and_a_join_restarts_nothing(tiny_llama_store):
    store = tiny_llama_store
    half = {"max_memory_bytes": memory_for_stages(store, 2)}

    async def run():
        tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
        config = CoordConfig(listen=LOOPBACK_ANY_PORT, min_nodes=2,
                             swarm=SwarmConfig(max_rings=2, ring_spares=0, probe_wait_s=20),
                             engine=EngineConfig(draft="none"),
                             receipts=ReceiptConfig(enabled=False))
        async with open_coordinator(config, store, tokenizer, keypair_from_seed(os.urandom(32))) as coordinator:
            swarm, engine = coordinator.swarm, coordinator.engine
            started = [await coordinator.nursery.start(_run_node, store, coordinator.addr, half) for _ in range(2)]
            await _wait(lambda: len(swarm.rings) == 1, 90, "one ring from two nodes", swarm)
            first = swarm.rings[0]
            assert len(first.stages) == 2
            alone = [await generate_greedy(engine, p, TOKENS) for p in PROMPTS]

            # A job running while two nodes join: a second ring forms beside it; the job
            # never resumes (no re-prefill) and its output is the one it has alone.
            job = await engine.open_job(PROMPTS[0], SamplingParams(temperature=0.0))
            out: list[int] = []
            try:
                async with aclosing(job.next_tokens()) as blocks:
                    async for block in blocks:
                        out += block
                        if len(started) == 2:
                            started += [await coordinator.nursery.start(_run_node, store, coordinator.addr, half)
                                        for _ in range(2)]
                            await _wait(lambda: len(swarm.rings) == 2, 90, "a second ring beside the first", swarm)
                        if len(out) >= TOKENS:
                            break
                stats = job.stats()
            finally:
                await job.aclose()
            assert out[:TOKENS] == alone[0]
            assert stats["resumes"] == 0 and stats["ring_epoch"] == first.epoch
            assert swarm.rings[0] == first  # the running ring was never re-formed
            assert not {p for p, _ in swarm.rings[1].stages} & {p for p, _ in first.stages}
            info = engine.info()
            assert [r["ring_id"] for r in info["rings"]] == [0, 1] and info["epoch"] == first.epoch
            started += [await coordinator.nursery.start(_run_node, store, coordinator.addr, half) for _ in range(2)]
            await _wait(lambda: len(swarm._formed_for or ()) == 6 and len(swarm.plan.roles) == 2, 90,
                        "two more nodes given roles", swarm)
            assert swarm.rings[0] == first and len(swarm.rings) == 2

            # Concurrent requests spread over both rings, each output equal to its own alone.
            rings_used: set[int] = set()
            results: dict[int, list[int]] = {}

            resumes: list[int] = []

            async def one(i: int) -> None:
                results[i], stats = await generate_greedy_with_stats(engine, PROMPTS[i], TOKENS)
                resumes.append(stats["resumes"])

            async def watch() -> None:
                while len(results) < len(PROMPTS):
                    rings_used.update(p.ring_id for p in engine.router.pinned.values() if not p.closed)
                    await trio.sleep(0.01)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch)
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
            assert [results[i] for i in range(len(PROMPTS))] == alone
            assert rings_used == {0, 1}

            # A node of the second ring dies under load: no token is lost.
            victim = swarm.rings[1].stages[-1][0]
            ids = [p for _, p, _ in started]
            results.clear()

            resumes.clear()

            async def kill_soon() -> None:  # once a job on the second ring has made tokens
                on_second = lambda: [p for p in engine.router.pinned.values()  # noqa: E731
                                     if p.ring_id == 1 and not p.closed and engine.router.produced(p) >= 2]
                await _wait(lambda: on_second() or len(results) == len(PROMPTS), 60, "a job making tokens on ring 1", swarm)
                assert on_second(), "no job ran on the second ring"
                started[ids.index(victim)][0].cancel()

            async with trio.open_nursery() as nursery:
                for i in range(len(PROMPTS)):
                    nursery.start_soon(one, i)
                nursery.start_soon(kill_soon)
            assert [results[i] for i in range(len(PROMPTS))] == alone
            assert victim not in {p for r in swarm.rings.values() for p, _ in r.stages}
            assert sum(resumes) >= 1  # its jobs resumed (on the other ring, or on it re-formed), none failed
            # The broken ring re-forms alone, from its survivor and a spare; the first is untouched.
            await _wait(lambda: len(swarm.rings) == 2, 90, "the second ring re-formed", swarm)
            assert swarm.rings[0] == first and swarm.rings[1].epoch > first.epoch
            assert swarm.faulty == {}  # probation (on, 64 rounds) recomputed both rings' newcomers: nobody blamed
            coordinator.nursery.cancel_scope.cancel()

    trio.run(run)
