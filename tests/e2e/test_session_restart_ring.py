"""A stage whose session fails on a bug mid-request costs time, not tokens, and rejoins (issue 20).

Bug guarded: a node process exiting on its own bug outside a frame (4c6d32a: a negative
trio timeout out of the scheduler killed a stage under load, and the ring lost it for
good); a restarted session that never registers again, or whose dropped K/V changes the
text. Sound: the bug is injected into the real stage's scheduler once, mid-generation, on a
real coordinator's ring (ringkit); the reference is the same ring's greedy text before it,
compared exactly, and the node's return is read off the coordinator's own members table
(a new control stream from the same peer id). Had the node's serve raised, the
coordinator's nursery (which runs the nodes) would have failed the test.
"""

from __future__ import annotations

import trio

from coordinator.errors import NotReadyError
from coordinator.jobs.ring_engine import EngineConfig
from tests.e2e.ringkit import memory_for_stages, open_local_ring
from tests.e2e.test_resume import KILL_AFTER, run_job


def test_a_stage_whose_session_fails_on_a_bug_costs_time_not_tokens_and_rejoins(tiny_llama_store):
    store = tiny_llama_store

    async def main():
        async with open_local_ring(store, 3, engine=EngineConfig(draft="none", resume_wait_s=10),
                                   node_config={"max_memory_bytes": memory_for_stages(store, 2)}) as ring:
            reference, _ = await run_job(ring.engine)
            victim = ring.swarm.ring.stages[-1][0]
            node, control = ring.nodes[ring.node_ids.index(victim)], ring.swarm.members[victim].control
            sched = node.scheduler
            honest = sched.take_nowait

            def buggy():
                sched.take_nowait = honest
                raise ValueError("timeout must be non-negative")

            armed: list[int] = []

            def arm(n: int) -> None:
                if n >= KILL_AFTER and not armed:
                    sched.take_nowait = buggy
                    armed.append(n)

            with trio.fail_after(60):
                resumed, stats = await run_job(ring.engine, arm)
            assert sched.take_nowait == honest, "the bug never ran"
            with trio.fail_after(30):  # registered again: the same peer on a new control stream
                while victim not in ring.swarm.members or ring.swarm.members[victim].control is control:
                    await trio.sleep(0.05)
            with trio.fail_after(60):  # its return re-plans the ring: a job opened meanwhile waits for it
                while True:
                    try:
                        again, _ = await run_job(ring.engine)
                        break
                    except NotReadyError:
                        await trio.sleep(0.1)
            return reference, resumed, again, stats

    reference, resumed, again, stats = trio.run(main)
    assert resumed == reference and again == reference
    assert stats["resumes"] >= 1, stats
