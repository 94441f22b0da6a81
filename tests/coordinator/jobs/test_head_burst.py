"""The shared output head and bursts (coordinator.jobs.head_batch, shard.wire.trailer).

Bugs guarded: the tail's results of one forward reaching the head one product at a time
(the first ran alone before the rest asked: ~1.7 rounds per product at 16 streams, issue 21)
so the group split again on its way back to the head stage; a lone ask held for company;
an ask whose burst's rest never asks (its job ended) holding the head past the bound; the
jobs of one product sending their next frames without the product's burst; a product
leaving at the 2 ms bound while the burst's rest was already in the gateway, its jobs
still checking receipts (~10 ms at 16 streams: groups split there). Sound: a real
head (tiny llama), trio's MockClock moved by the test, each job as its own task.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from coordinator.jobs.head_batch import IN_HAND_WAIT_S, HeadBatcher, note_arrived, take_next_burst
from shard.stage import OutputHead

BOUND_S = 0.002


class CountingHead:
    def __init__(self, store) -> None:
        norm, lm_head = store.load_head()
        self.head = OutputHead(store.config, norm, lm_head if lm_head is not None else store.load_embedding())
        self.products: list[int] = []

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        self.products.append(hidden.shape[0])
        return self.head.logits(hidden)


def run_jobs(store, arrivals: list[tuple[float, tuple[int, ...]]], bound_s: float = BOUND_S,
             received: list[tuple[float, tuple[int, ...], int]] = (), skipped: list[tuple[float, tuple[int, ...], int]] = ()):
    """Each job notes its Result's burst at its arrival time (seconds after start) and asks
    the head; `received` (time, burst, job): when the ring stream hands job `job` a Result
    of a burst (of burst (): a tick of the clock, nothing received); `skipped`: when a job
    passes over a stale Result of a burst.
    Returns the products' rows, each job's next-frame burst, and how long products waited
    for bursts' rests in all (timed on the event loop, on the mock clock)."""
    head = CountingHead(store)
    batcher = HeadBatcher(head, burst_wait_s=bound_s)
    clock = trio.testing.MockClock()
    out: dict[int, tuple] = {}

    async def job(i: int, burst: tuple[int, ...]) -> None:
        note_arrived(burst, f"j{i}")
        await batcher.logits(torch.randn(1, store.config.hidden_size))
        out[i] = take_next_burst()

    async def main():
        t0 = trio.current_time()
        events = sorted([(at, "ask", i, burst) for i, (at, burst) in enumerate(arrivals)] +
                        [(at, "received", i, burst) for at, burst, i in received] +
                        [(at, "skipped", i, burst) for at, burst, i in skipped], key=lambda e: e[0])
        async with trio.open_nursery() as nursery:
            for at, what, i, burst in events:
                clock.jump(t0 + at - trio.current_time())
                await trio.testing.wait_all_tasks_blocked()  # whoever's bound just passed goes first
                if what == "ask":
                    nursery.start_soon(job, i, burst)
                else:
                    getattr(batcher, what)(burst, f"j{i}")
                await trio.testing.wait_all_tasks_blocked()
            clock.jump(1.0)  # past every bound

    trio.run(main, clock=clock)
    return head.products, [out[i] for i in range(len(arrivals))], batcher.waited_s


def test_a_results_burst_asks_as_one_product_and_its_jobs_send_one_burst(tiny_llama_store):
    products, sent, _ = run_jobs(tiny_llama_store, [(0.0, (5, 3)), (0.0005, (5, 3)), (0.001, (5, 3))])
    assert products == [3]
    assert sent == [(1, 3)] * 3  # the first product's burst, three frames


def test_a_lone_ask_runs_alone_at_once_and_sends_a_lone_frame(tiny_llama_store):
    products, sent, _ = run_jobs(tiny_llama_store, [(0.0, ()), (0.0005, (8, 1))])
    assert products == [1, 1] and sent == [(), ()]


def test_a_burst_whose_rest_never_asks_runs_at_the_bound(tiny_llama_store):
    products, sent, _ = run_jobs(tiny_llama_store, [(0.0, (5, 4)), (0.0005, (5, 4)), (0.01, (5, 4))])
    assert products == [2, 1]  # two waited the bound for the others; the straggler ran alone
    assert sent == [(1, 2), (1, 2), ()]


def test_zero_bound_never_waits(tiny_llama_store):
    products, _, _ = run_jobs(tiny_llama_store, [(0.0, (5, 2)), (0.0005, (5, 2))], bound_s=0.0)
    assert products == [1, 1]


def test_a_burst_whose_rest_is_in_hand_waits_past_the_bound_for_it(tiny_llama_store):
    burst = (5, 3)
    got = [(0.0, burst, 0), (0.0001, burst, 1), (0.0002, burst, 2)]  # all three Results in their jobs' inboxes at once
    products, sent, waited = run_jobs(tiny_llama_store, [(0.0005, burst), (0.006, burst), (0.012, burst)], received=got)
    assert products == [3]  # 12 ms after the first ask, 6x the 2 ms bound: its jobs were still checking receipts
    assert sent == [(1, 3)] * 3 and waited == pytest.approx(0.012 - 0.0005)


def test_a_received_result_that_never_asks_holds_the_head_at_most_in_hand_wait(tiny_llama_store):
    burst = (5, 3)
    got = [(0.0, burst, 0), (0.0001, burst, 1), (0.0002, burst, 2)]
    ticks = [(0.0004 + IN_HAND_WAIT_S, (), 0), (0.0006 + IN_HAND_WAIT_S, (), 0)]
    products, sent, waited = run_jobs(tiny_llama_store, [(0.0005, burst), (0.001, burst)], received=got + ticks)
    assert products == [2] and sent == [(1, 2)] * 2  # the third job ended before it asked
    assert waited == pytest.approx(0.0001 + IN_HAND_WAIT_S)  # past the 2 ms bound; gone at the clock's step past its own


def test_the_bound_still_applies_while_the_rest_has_not_arrived(tiny_llama_store):
    burst = (5, 3)
    products, _, waited = run_jobs(tiny_llama_store, [(0.0005, burst), (0.001, burst), (0.01, burst)],
                                 received=[(0.0, burst, 0), (0.0009, burst, 1), (0.0024, (), 0), (0.0026, (), 0),
                                           (0.009, burst, 2)])
    assert products == [2, 1] and waited == pytest.approx(0.0026 - 0.0005)  # in hand only while one received has not asked


def test_a_stale_result_passed_over_ends_the_wait_for_it(tiny_llama_store):
    burst = (5, 3)
    got = [(0.0, burst, 0), (0.0001, burst, 1), (0.0002, burst, 2)]
    products, sent, waited = run_jobs(tiny_llama_store, [(0.0005, burst), (0.001, burst)], received=got,
                                      skipped=[(0.004, burst, 2)])  # job 2's Result was a discarded round's
    assert products == [2] and sent == [(1, 2)] * 2
    assert waited == pytest.approx(0.004 - 0.0005)  # its 2 ms bound long past: the product leaves at the skip


def test_a_job_whose_ask_waits_already_is_not_work_in_hand(tiny_llama_store):
    """Pipelined rounds: job 1's Result of burst B is in its inbox, but job 1 asks for an
    earlier round's (burst A) in this very product; its ask for B comes only after it."""
    b, a = (5, 2), (7, 2)
    ticks = [(0.0024, (), 0), (0.0026, (), 0)]
    products, _, waited = run_jobs(tiny_llama_store, [(0.0005, b), (0.001, a)],
                                   received=[(0.0, b, 0), (0.0001, b, 1), *ticks])
    assert products == [2] and waited == pytest.approx(0.0026 - 0.0005)  # the 2 ms bound, not IN_HAND_WAIT_S
