"""StageScheduler and bursts (shard.wire.trailer): a forward about to start waits for the
rest of a burst its predecessor sent together, up to burst_wait_s after its latest frame (at
most burst_span_s after its first), and never for a lone frame.

Bugs guarded: a group's frames split across forwards because the first ran before the rest
landed (the 16-stream ring's 2 frames per forward, issue 21); a lone frame (or one beside a
complete burst) held for company; a burst whose rest never comes (its job ended upstream)
holding the stage past the bound. Sound: trio's MockClock (autojump off) makes every wait
exact: the test moves time itself and looks once every task is blocked.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio
import trio.testing

from shard.stage_scheduler import SchedulerConfig, StageScheduler, Waiting

BOUND_S = 0.002


@dataclass(frozen=True)
class Msg:
    name: str
    burst: tuple[int, ...] = ()


def frame(state, job: str, burst: tuple[int, ...] = ()) -> Waiting:
    return Waiting(state, Msg(job, burst), memoryview(b""), job, 1, 100)


def run(scenario, bound_s: float = BOUND_S) -> None:
    clock = trio.testing.MockClock()
    batches: list[tuple[float, list[str]]] = []

    async def run_batch(state, batch):
        batches.append((trio.current_time(), [w.msg.name for w in batch]))

    async def main():
        sched = StageScheduler(lambda: "s", run_batch, SchedulerConfig(burst_wait_s=bound_s))
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.serve)
            await scenario(sched, batches, clock)
            nursery.cancel_scope.cancel()

    trio.run(main, clock=clock)


def test_a_lone_frame_runs_at_once():
    async def scenario(sched, batches, clock):
        t0 = trio.current_time()
        await sched.submit(frame("s", "a"))
        await trio.testing.wait_all_tasks_blocked()
        await sched.submit(frame("s", "b", (7, 1)))  # a burst of one is lone too
        await trio.testing.wait_all_tasks_blocked()
        assert [b for _, b in batches] == [["a"], ["b"]] and all(t == t0 for t, _ in batches)
        assert sched.tally.waits == 0
    run(scenario)


def test_an_incomplete_burst_waits_for_its_rest_and_runs_it_in_one_forward():
    async def scenario(sched, batches, clock):
        t0 = trio.current_time()
        await sched.submit(frame("s", "a", (1, 3)))
        await trio.testing.wait_all_tasks_blocked()
        assert batches == []  # 1 of 3 came: waiting
        clock.jump(BOUND_S / 4)
        await sched.submit(frame("s", "b", (1, 3)))
        await trio.testing.wait_all_tasks_blocked()
        assert batches == []
        clock.jump(BOUND_S / 4)
        await sched.submit(frame("s", "c", (1, 3)))  # complete: runs now, before the bound
        await trio.testing.wait_all_tasks_blocked()
        assert batches == [(t0 + BOUND_S / 2, ["a", "b", "c"])]
        assert sched.tally.waits == 1 and abs(sched.tally.waited_s - BOUND_S / 2) < 1e-9
    run(scenario)


def test_a_burst_whose_rest_never_comes_runs_at_the_bound():
    async def scenario(sched, batches, clock):
        t0 = trio.current_time()
        await sched.submit(frame("s", "a", (2, 4)))
        await sched.submit(frame("s", "b", (2, 4)))
        await trio.testing.wait_all_tasks_blocked()
        clock.jump(BOUND_S * 0.99)
        await trio.testing.wait_all_tasks_blocked()
        assert batches == []
        clock.jump(BOUND_S * 0.02)
        await trio.testing.wait_all_tasks_blocked()
        assert [b for _, b in batches] == [["a", "b"]] and batches[0][0] <= t0 + BOUND_S * 1.01
        await sched.submit(frame("s", "c", (2, 4)))  # a straggler past the bound runs at once
        await trio.testing.wait_all_tasks_blocked()
        assert [b for _, b in batches][1:] == [["c"]]
    run(scenario)


def test_a_burst_still_arriving_keeps_the_wait_open_up_to_its_span():
    # Bug guarded: at 16 streams a whole burst of 16 frames written at once took ~4.5 ms to be
    # read and queued, and a bound counted from its first frame cut it into two forwards.
    async def scenario(sched, batches, clock):
        t0 = trio.current_time()
        for i in range(6):  # a frame every 0.75 bound: 3.75 bounds from the first to the last
            await sched.submit(frame("s", f"f{i}", (3, 6)))
            await trio.testing.wait_all_tasks_blocked()
            if i < 5:
                assert batches == []
                clock.jump(BOUND_S * 0.75)
        assert [b for _, b in batches] == [[f"f{i}" for i in range(6)]] and batches[0][0] == t0 + BOUND_S * 3.75
    run(scenario)

    async def capped(sched, batches, clock):  # a trickle never holds the stage past the span
        t0 = trio.current_time()
        span = sched.config.burst_span_s
        sent = 0
        while not batches:
            await sched.submit(frame("s", f"f{sent}", (4, 1000)))
            sent += 1
            await trio.testing.wait_all_tasks_blocked()
            clock.jump(BOUND_S / 2)
            await trio.testing.wait_all_tasks_blocked()
        assert batches[0][0] <= t0 + span + 1e-9 and len(batches[0][1]) == sent >= span / (BOUND_S / 2)
    run(capped)


def test_a_lone_frame_beside_a_complete_burst_does_not_wait_and_zero_turns_waiting_off():
    async def scenario(sched, batches, clock):
        await sched.submit(frame("s", "a", (5, 2)))
        await sched.submit(frame("s", "x"))
        await trio.testing.wait_all_tasks_blocked()
        # a waits (b of its burst is missing); x, arriving meanwhile, rides with it
        await sched.submit(frame("s", "b", (5, 2)))
        await trio.testing.wait_all_tasks_blocked()
        assert [b for _, b in batches] == [["a", "x", "b"]]
    run(scenario)

    async def off(sched, batches, clock):
        await sched.submit(frame("s", "a", (5, 2)))
        await trio.testing.wait_all_tasks_blocked()
        assert [b for _, b in batches] == [["a"]] and sched.tally.waits == 0
    run(off, bound_s=0.0)


def test_a_clock_read_past_the_deadline_never_waits_a_negative_time():
    # Bug guarded: gather_bursts read the clock once to test the deadline and again to wait
    # for it; at 32 streams time passed in between, trio.move_on_after got a negative wait,
    # raised ValueError and the node process exited (bench_load's 300 s run at b75545f).
    # Here every clock reading moves on by `step`, so some second reading falls past it.
    for step in (0.0003, 0.0007, 0.0011, 0.0013, 0.0017, 0.0019, 0.0021):
        clock = trio.testing.MockClock()
        batches: list[list[str]] = []
        reads = [0]

        def ticking() -> float:
            reads[0] += 1
            return trio.current_time() + reads[0] * step

        async def run_batch(state, batch):
            batches.append([w.msg.name for w in batch])

        async def main():
            sched = StageScheduler(lambda: "s", run_batch, SchedulerConfig(burst_wait_s=BOUND_S), clock=ticking)
            async with trio.open_nursery() as nursery:
                await nursery.start(sched.serve)
                await sched.submit(frame("s", "a", (1, 2)))  # its rest never comes
                await trio.testing.wait_all_tasks_blocked()
                clock.jump(BOUND_S)
                await trio.testing.wait_all_tasks_blocked()
                assert batches == [["a"]], step
                nursery.cancel_scope.cancel()

        trio.run(main, clock=clock)
