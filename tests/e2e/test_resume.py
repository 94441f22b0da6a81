"""A node that dies mid-request costs time, not tokens (DESIGN.md invariant).

Guards the resume path: when a stage disappears in the middle of generation, the swarm
re-forms the ring from the survivors, the job re-prefills its committed tokens there, and
its output is identical to the uninterrupted run. The reference is the same ring before
anything died, so the comparison is exact.
"""

from __future__ import annotations

from contextlib import aclosing

import trio

from coordinator.jobs.ring_engine import EngineConfig
from coordinator.spec.sampling import SamplingParams
from tests.e2e.ringkit import memory_for_stages, open_local_ring

PROMPT = [1, 50, 60, 70, 80, 90, 100, 110]
TOKENS = 20
KILL_AFTER = 7


async def run_job(engine, on_block=None) -> tuple[list[int], dict]:
    job = await engine.open_job(PROMPT, SamplingParams(temperature=0.0))
    got: list[int] = []
    async with aclosing(job.next_tokens()) as blocks:
        async for block in blocks:
            got += block
            if on_block is not None:
                on_block(len(got))
            if len(got) >= TOKENS:
                break
    stats = job.stats()
    await job.aclose()
    return got[:TOKENS], stats


def test_a_stage_dying_mid_request_costs_time_not_tokens(tiny_llama_store):
    async def main():
        # Three nodes, each able to hold half the model: the selector forms a 2-stage ring
        # plus a spare, or (when its measurements favour it) uses all three; either way
        # the two left after a death still hold the whole model.
        async with open_local_ring(tiny_llama_store, 3, engine=EngineConfig(draft="none", resume_wait_s=5),
                                   node_config={"max_memory_bytes": memory_for_stages(tiny_llama_store, 2)}) as ring:
            reference, _ = await run_job(ring.engine)
            assert len(ring.swarm.ring.stages) in (2, 3)
            victim = ring.swarm.ring.stages[-1][0]  # the tail: the stream results come back on
            killed = []

            def maybe_kill(n: int) -> None:
                if n >= KILL_AFTER and not killed:
                    ring.kill(victim)
                    killed.append(n)

            with trio.fail_after(60):
                resumed, stats = await run_job(ring.engine, maybe_kill)
            survivors = {p for p, _ in ring.swarm.ring.stages}
            return reference, resumed, stats, victim, survivors

    reference, resumed, stats, victim, survivors = trio.run(main)
    assert resumed == reference
    assert stats["resumes"] >= 1 and victim not in survivors, stats
