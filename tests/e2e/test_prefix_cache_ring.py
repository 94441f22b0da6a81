"""The prefix cache on a real ring: repeated and continued prompts start from kept K/V.

On an in-process ring (coordinator swarm + engine, three Nodes over libp2p on loopback,
the tiny llama, receipts on) a finished job's K/V stays on every stage as a source, and a
later job whose prompt starts with its tokens forks from it. Bugs guarded: a fork whose
greedy output differs from the same prompt computed from scratch (wrong slots copied, the
prefix fed twice or not at all, positions off); a conversation's next turn (the earlier
prompt, the reply, more tokens) not reusing the reply's K/V; a source a stage lost making
its fork fail the request or wait for the ring to re-form instead of re-prefilling at once;
a source let go whose K/V stays on the stages (no EndJob); a source still counted as
decoding by the stages' schedulers (a lone prompt after it would be cut into pieces); a job that forked kept as a
source itself; an EAGLE drafter that does not start from the source's state (it would
draft from nothing: no forks, or drafts out of step with the ring).
"""

from __future__ import annotations

import trio

from coordinator.jobs.engine_config import EngineConfig
from coordinator.spec.sampling import SamplingParams
from tests.e2e.test_frame_release_ring import _run as run_ring
from tests.e2e.test_spec_ring import random_eagle_head

PROMPT = [1] + [3 + (i * 7) % 50 for i in range(45)]  # 46 tokens: past the 32 a fork needs
TOKENS = 8


async def _run(store, body, rate: float = 0.0, engine: EngineConfig = EngineConfig(draft="none")):
    """A 3-stage in-process ring auditing at `rate` (test_frame_release_ring's) running `body`."""
    return await run_ring(store, rate, body, engine)


async def generate(engine, prompt: list[int], n: int = TOKENS) -> tuple[list[int], object]:
    job = await engine.open_job(prompt, SamplingParams(temperature=0.0))
    got: list[int] = []
    async for block in job.next_tokens():
        got += block
        if len(got) >= n:
            break
    await job.aclose()
    return got[:n], job


def held(nodes, job_id: str) -> list[bool]:
    return [job_id in n.state.worker.cache.jobs for n in nodes]


async def until_gone(nodes, job_id: str) -> None:
    """Until no stage holds `job_id`'s K/V (its EndJob is on its way); fails after 10 s."""
    with trio.fail_after(10):
        while any(held(nodes, job_id)):
            await trio.sleep(0.05)


def test_repeated_and_continued_prompts_fork_and_equal_a_fresh_prefill(tiny_llama_store):
    async def body(coordinator, nodes):
        engine = coordinator.engine
        index = engine.prefixes.index
        first, source = await generate(engine, PROMPT)
        with trio.fail_after(10):  # its EndJob (keep) ends it in each stage's scheduler, not its K/V
            while not all((source.ring_epoch, source.job_id) in n.scheduler.ended for n in nodes):
                await trio.sleep(0.05)
        assert source.prefix is None and held(nodes, source.job_id) == [True] * 3
        assert not any(source.job_id in n.scheduler.decoding for n in nodes)  # a lone prompt next runs whole
        again, job = await generate(engine, PROMPT)
        assert job.prefix == (source.job_id, len(PROMPT) - 1) and again == first
        assert job.job_id not in index.sources  # a fork is no source: it gets its EndJob
        await until_gone(nodes, job.job_id)
        turn = PROMPT + first[:5] + [9, 4]  # the next turn: the prompt, the reply so far, more
        forked, job = await generate(engine, turn)
        assert job.prefix is not None and job.prefix[0] == source.job_id and job.prefix[1] >= len(PROMPT) + 5
        index.max_tokens = 0  # the cache off: the same turn from scratch
        fresh, job = await generate(engine, turn)
        assert job.prefix is None and forked == fresh
        return index.stats

    stats = trio.run(_run, tiny_llama_store, body)
    assert stats.hits == 2 and stats.tokens_reused >= 2 * len(PROMPT) + 4


def test_a_source_a_stage_lost_costs_a_prefill_not_the_request(tiny_llama_store):
    async def body(coordinator, nodes):
        engine = coordinator.engine
        first, source = await generate(engine, PROMPT)
        nodes[1].state.worker.end_job(source.job_id)  # as an idle eviction would
        started = trio.current_time()
        again, job = await generate(engine, PROMPT)
        took = trio.current_time() - started
        assert job.prefix is not None and again == first
        assert took < engine.config.resume_wait_s  # re-prefilled at once, no wait for a re-form
        return engine.prefixes.index

    index = trio.run(_run, tiny_llama_store, body)
    assert index.stats.evicted >= 1 and all(s.hits == 0 for s in index.sources.values())


def test_sources_let_go_leave_every_stage(tiny_llama_store):
    async def body(coordinator, nodes):
        engine = coordinator.engine
        engine.prefixes.index.max_sources = 1
        _, a = await generate(engine, PROMPT)
        _, b = await generate(engine, [2] + PROMPT[1:])  # another prompt: `a` goes
        await until_gone(nodes, a.job_id)
        return held(nodes, b.job_id), list(engine.prefixes.index.sources)

    b_held, kept = trio.run(_run, tiny_llama_store, body)
    assert b_held == [True] * 3 and len(kept) == 1


def test_eagle_jobs_fork_with_their_drafter_state(tiny_llama_store, tmp_path):
    random_eagle_head(tiny_llama_store, tmp_path / "head")

    async def body(coordinator, nodes):
        engine = coordinator.engine
        first, source = await generate(engine, PROMPT, 16)
        again, job = await generate(engine, PROMPT, 16)
        [drafter] = job.drafters
        assert job.prefix == (source.job_id, len(PROMPT) - 1) and again == first
        # It started from the source's state at the fork and observed the job's own rounds after it.
        assert drafter is not source.drafters[0] and drafter.observed_tokens > len(PROMPT)
        assert drafter._tokens == job.committed[:drafter.observed_tokens]
        engine.prefixes.index.max_tokens = 0
        fresh, job = await generate(engine, PROMPT, 16)
        assert job.prefix is None and fresh == first

    trio.run(_run, tiny_llama_store, body, 0.0, EngineConfig(draft="eagle", eagle_head=str(tmp_path / "head")))


def test_forked_jobs_pass_their_audits_on_honest_stages(tiny_llama_store):
    # At audit rate 1 every stage of every job is replayed; a fork's audit replays its source's
    # frames first (coordinator.trust.prefix_audit). Replaying the fork alone would accuse all three.
    async def body(coordinator, nodes):
        engine = coordinator.engine
        outs = [await generate(engine, PROMPT) for _ in range(3)]
        await coordinator.auditor.wait_idle()
        return [o for o, _ in outs], [j.prefix for _, j in outs], coordinator.auditor

    outs, prefixes, auditor = trio.run(_run, tiny_llama_store, body, 1.0)
    assert outs[0] == outs[1] == outs[2] and prefixes[0] is None and prefixes[1] and prefixes[2]
    stats = auditor.stats
    assert stats.audits == 3 * 3 and stats.skipped_no_prefix == 0
    assert auditor.evidence == [] and auditor.swarm.faulty == {}
