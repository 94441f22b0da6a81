"""StageScheduler's prefill order: a short prompt's chunk is not queued behind a long one's.

Bugs guarded: the scheduler not handing plan_batch its pass counts (a long prompt then
starves under short ones: shortest-first without aging), counts kept for jobs gone, the
"arrival" knob not reaching the plan. Sound: run_batch records each batch and waits on an
event the test sets, so the queue is read only while every task is blocked; the same
queue under the two orders gives the two different batches.
"""

from __future__ import annotations

import trio
import trio.testing

from shard.stage_scheduler import SchedulerConfig, StageScheduler, Waiting


def frame(job: str, rows: int, split: int = 0) -> Waiting:
    return Waiting("e1", f"{job}:{rows}", memoryview(b""), job, rows, 100, split)


def batches_for(config: SchedulerConfig, rounds: list[list[Waiting]]) -> tuple[list, list[dict]]:
    """The batches run when a decoding job's frame runs alone first and then each round's
    frames are queued while the previous batch runs; and the pass counts after each."""
    batches, passed, go = [], [], [trio.Event()]

    async def run_batch(state, batch):
        batches.append([(w.msg, w.piece) for w in batch])
        await go[0].wait()
        go[0] = trio.Event()

    async def main():
        sched = StageScheduler(lambda: "e1", run_batch, config, clock=lambda: 0.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.serve)
            await sched.submit(frame("a", 1))  # runs at once, alone: a is decoding
            await trio.testing.wait_all_tasks_blocked()
            for frames in rounds:
                for w in frames:
                    await sched.submit(w)
                go[0].set()
                await trio.testing.wait_all_tasks_blocked()
                passed.append(dict(sched.passed))
            nursery.cancel_scope.cancel()
    trio.run(main)
    return batches[1:], passed


LONG = [frame("L", 256, split=8), frame("L", 256, split=8)]


def test_a_short_prompt_gets_the_prefill_rows_before_a_long_prompts_pieces():
    rounds = [[*LONG, frame("s", 43, split=8), frame("a", 1)], [frame("t", 64, split=8), frame("a", 1)]]
    batches, passed = batches_for(SchedulerConfig(token_budget=320, piece_rows=64), rounds)
    assert batches[0] == [("L:256", (0, 21)), ("s:43", None), ("a:1", None)]  # s whole, L the rest
    assert batches[1] == [("t:64", None), ("a:1", None)]  # L (235 + 256 left) passed over once
    assert passed == [{}, {"L": 1}]


def test_arrival_order_serves_the_oldest_chunk_first():
    rounds = [[*LONG, frame("s", 43, split=8), frame("a", 1)]]
    batches, _ = batches_for(SchedulerConfig(token_budget=320, piece_rows=64, prefill_order="arrival"), rounds)
    assert batches[0] == [("L:256", (0, 64)), ("a:1", None)]


def test_a_long_prompt_passed_over_max_passes_times_goes_first():
    rounds = [[*LONG, frame("a", 1)]] + [[frame(f"s{k}", 64, split=8), frame("a", 1)] for k in range(3)]
    batches, passed = batches_for(SchedulerConfig(token_budget=320, piece_rows=64, max_passes=2), rounds)
    assert [b[0] for b in batches] == [("L:256", (0, 64)), ("s0:64", None), ("s1:64", None), ("L:256", (64, 128))]
    assert passed == [{}, {"L": 1}, {"L": 2}, {"s2": 1}]


def test_the_node_flags_reach_its_scheduler():
    # Bug guarded: shard-node join --prefill-order (or the budget, pieces, burst wait)
    # parsed but not handed to the StageScheduler the node builds from its config.
    from shard.node_config import NodeConfig

    cfg = NodeConfig(coordinator="/ip4/127.0.0.1/tcp/1/p2p/x", batch_token_budget=100, prefill_piece_tokens=16,
                     prefill_order="arrival", burst_wait_ms=5.0)
    assert cfg.scheduler_config() == SchedulerConfig(token_budget=100, piece_rows=16, prefill_order="arrival",
                                                     burst_wait_s=0.005)
    assert NodeConfig(coordinator="x").scheduler_config() == SchedulerConfig()
