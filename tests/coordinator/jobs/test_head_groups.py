"""At most N groups of jobs in flight (coordinator.jobs.head_batch `groups`, serve's --max-groups).

Bug guarded: on the 2-core loopback ring at 16 streams the three stages and the gateway each
held one group of ~4 jobs, forever (a balanced pipeline merges nothing), so every stage
forward carried ~4 rows at ~5.7 ms of CPU a row. Sound: jobs as trio tasks that ask the
head, then spend a fixed "ring time" before asking again, started staggered; trio's
MockClock; a head whose products are counted, run on the event loop (a worker thread's
real time would let the mock clock jump under a product and merge asks by accident).
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from coordinator.jobs.head_batch import HeadBatcher, note_arrived
from coordinator.server import local_groups

RING_S = 0.2  # a round's time on the ring between a job's asks
WAIT_S = 0.12


class Head:
    def __init__(self) -> None:
        self.products: list[int] = []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.products.append(hidden.shape[0])
        return torch.zeros(hidden.shape[0], 8)


@pytest.fixture(autouse=True)
def products_on_the_loop(monkeypatch):
    async def run_sync(fn, *args, **_):
        await trio.lowlevel.checkpoint()
        return fn(*args)

    monkeypatch.setattr(trio.to_thread, "run_sync", run_sync)


def run_jobs(jobs: int, groups: int, rounds: int = 6, stagger_s: float = 0.02) -> tuple[Head, HeadBatcher, float]:
    """Each job starts `i * stagger_s` in and asks `rounds` times, RING_S apart after each
    answer. Returns the head, the batcher and when the last job finished."""
    head = Head()
    batcher = HeadBatcher(head, burst_wait_s=0.002, groups=groups, group_wait_s=WAIT_S)

    async def job(i: int) -> None:
        await trio.sleep(i * stagger_s)
        for _ in range(rounds):
            note_arrived((), f"j{i}")
            await batcher.logits(torch.zeros(1, 4))
            await trio.sleep(RING_S)

    async def main():
        async with trio.open_nursery() as n:
            for i in range(jobs):
                n.start_soon(job, i)
        return trio.current_time()

    ended = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    return head, batcher, ended


def test_groups_merge_until_there_are_as_many_as_asked_for():
    head, batcher, _ = run_jobs(8, groups=0)
    assert max(head.products) == 1  # staggered 20 ms apart, nothing ever merges
    assert not batcher._last_ask  # no bound: no per-job record kept (it grew by every job ever served)
    head, _, _ = run_jobs(8, groups=2, rounds=12)
    steady = head.products[len(head.products) // 2:-2]
    assert len(steady) >= 4 and min(steady) >= 4  # at most two groups once merged (4 + 4, or 8)
    assert sum(head.products) == 8 * 12  # every row asked once


def test_a_lone_job_and_jobs_up_to_the_bound_never_wait():
    for jobs in (1, 2):
        _, batcher, ended = run_jobs(jobs, groups=2)
        assert batcher.waits == 0 and ended == pytest.approx((jobs - 1) * 0.02 + 6 * RING_S)


def test_a_group_waits_at_most_its_bound():
    # Three jobs, groups of two: the third job's ask waits for company that is 200 ms away.
    _, batcher, _ = run_jobs(3, groups=2, stagger_s=0.3, rounds=2)
    assert batcher.waits >= 1 and batcher.waited_s <= batcher.waits * WAIT_S + 1e-9


def test_auto_bounds_groups_only_where_local_nodes_and_the_gateway_outnumber_the_cores():
    assert local_groups(-1, 3, cores=2) == 2  # three local stages and the gateway on two cores
    assert local_groups(-1, 3, cores=16) == 0  # a core each: no bound
    assert local_groups(-1, 3, emulated=True, cores=2) == 0  # emulated WAN links: separate machines
    assert local_groups(-1, 0, cores=2) == 0  # remote nodes: their own machines
    assert local_groups(4, 0, cores=2) == 4 and local_groups(0, 3, cores=2) == 0  # as asked


def test_jobs_that_end_are_not_waited_for():
    # Bug guarded: a job that ended still counted among the jobs asking for ACTIVE_WINDOW_S, so
    # the products of the jobs left each waited the whole group_wait_s for asks never to come.
    for forget in (False, True):
        head = Head()
        batcher = HeadBatcher(head, burst_wait_s=0.002, groups=2, group_wait_s=WAIT_S)
        finished: list[float] = []

        async def job(i: int, rounds: int) -> None:
            for r in range(rounds):
                note_arrived((), f"j{i}")
                await batcher.logits(torch.zeros(1, 4))
                if r == rounds - 1:
                    break
                await trio.sleep(RING_S)
            if forget:  # as the engine does when a job closes (RingEngine.close_job)
                batcher.forget(f"j{i}")
            finished.append(trio.current_time())

        async def main():
            async with trio.open_nursery() as n:
                for i in range(8):  # one group of 8; six of them end after their second answer
                    n.start_soon(job, i, 2 if i < 6 else 4)
            return max(finished)

        ended = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
        unhindered = 3 * RING_S  # the two left ask every RING_S, answered at once
        if forget:
            assert ended == pytest.approx(unhindered, abs=0.01), ended
        else:
            assert ended >= unhindered + WAIT_S - 0.01, ended
