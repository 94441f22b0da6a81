"""A stage dying while many jobs share its forwards costs time, not tokens (issue 21).

Bugs guarded: frames of several jobs waiting in a dead epoch's queue run on the new
ring's caches, a batch that loses its ring loses some of its jobs for good, a job resumed
beside others re-prefilled wrongly. Sound: six jobs (greedy and seeded sampling, ragged
prompts) run together on a 3-node ring whose stages batch them (counted), the tail is
killed once every job has tokens, and each job's output must equal the same request run
alone on the intact ring before.
"""

from __future__ import annotations

from contextlib import aclosing

import pytest
import trio

from coordinator.jobs.ring_engine import EngineConfig
from coordinator.spec.sampling import SamplingParams
from tests.e2e.ringkit import memory_for_stages, open_local_ring

pytestmark = pytest.mark.slow
TOKENS = 16
JOBS = [([1] + [20 + 7 * i + j for j in range(3 + 5 * i)], SamplingParams(temperature=0.0) if i % 2 == 0
         else SamplingParams(temperature=0.9, seed=i)) for i in range(6)]


async def run_job(engine, prompt, params, progress=None, index=0) -> tuple[list[int], dict]:
    job = await engine.open_job(prompt, params)
    got: list[int] = []
    try:
        async with aclosing(job.next_tokens()) as blocks:
            async for block in blocks:
                got += block
                if progress is not None:
                    progress[index] = len(got)
                if len(got) >= TOKENS:
                    break
        return got[:TOKENS], job.stats()
    finally:
        await job.aclose()


def test_a_stage_dying_under_concurrent_jobs_loses_no_tokens(tiny_llama_store):
    async def main():
        async with open_local_ring(tiny_llama_store, 3, engine=EngineConfig(draft="none", resume_wait_s=5),
                                   node_config={"max_memory_bytes": memory_for_stages(tiny_llama_store, 2)}) as ring:
            alone = [(await run_job(ring.engine, p, s))[0] for p, s in JOBS]
            before = sum(n.scheduler.frames_run - n.scheduler.forwards for n in ring.nodes)
            victim = ring.swarm.ring.stages[-1][0]
            progress = [0] * len(JOBS)
            together: list = [None] * len(JOBS)

            async def one(i):
                together[i] = await run_job(ring.engine, *JOBS[i], progress, i)

            with trio.fail_after(120):
                async with trio.open_nursery() as nursery:
                    for i in range(len(JOBS)):
                        nursery.start_soon(one, i)
                    while min(progress) < 2:  # every job is decoding, batched with the others
                        await trio.sleep(0.005)
                    shared = sum(n.scheduler.frames_run - n.scheduler.forwards for n in ring.nodes) - before
                    ring.kill(victim)
            survivors = {p for p, _ in ring.swarm.ring.stages}
        return alone, together, shared, victim, survivors

    alone, together, shared, victim, survivors = trio.run(main)
    assert shared > 0  # forwards carried several jobs' frames before the death
    assert victim not in survivors
    assert [tokens for tokens, _ in together] == alone
    assert sum(stats["resumes"] for _, stats in together) >= 1
