"""The gateway returns freed heap while it serves (coordinator.jobs.heap_sweep).

Bug guarded (issue 21): the gateway's RSS climbed under load and stayed up (glibc keeps
what rounds free); an in-process run measured 1397 MB, 989 MB after one malloc_trim.
The sweep trims once per period in which a job ended, and leaves an idle gateway alone.
The trim itself is glibc's (shard.heap); here its times are recorded on trio's mock clock.
"""

from __future__ import annotations

import trio
import trio.testing

from coordinator.jobs import heap_sweep


def test_trims_once_per_period_in_which_a_job_ended():
    trims: list[float] = []
    ended = [0]

    async def trim():
        trims.append(trio.current_time())

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(heap_sweep.sweep_heap, lambda: ended[0], 10.0, trim)
            await trio.sleep(25)  # idle: nothing ended, no trim
            ended[0] += 3
            await trio.sleep(10)  # one trim at t=30 for the three jobs
            await trio.sleep(20)  # idle again
            ended[0] += 1
            await trio.sleep(10)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert trims == [30.0, 60.0]


def test_the_real_trim_runs():
    trio.run(heap_sweep.trim_in_thread)  # glibc's malloc_trim in a worker thread (nothing where libc has none)


def test_the_mmap_threshold_is_fixed_on_glibc():
    import platform

    if platform.libc_ver()[0] != "glibc":
        return  # musl, macOS: nothing to fix, nothing fixed
    assert heap_sweep.fix_mmap_threshold()
