"""Audit replays as background work at the OS's lowest CPU priority (shard.low_priority).

Bug guarded (issue 21): at 16 streams on a 3-stage loopback ring, audits' replays held each
node's compute limiter a step at a time, at the priority of the ring's own forwards, so a
cluster of jobs ending started replays that lifted the ITL p95 from ~0.16 s (audits off) to
0.23-0.26 s. Now a replay longer than one step, on a CPU node, runs on a thread of its own
at nice 19, alongside the stage's forwards and without the limiter; a one-step request (a
newcomer's timed speed probe) and a replay on the node's own warm slice keep the limiter.
Sound: the thread's priority is read from the OS inside the work itself; the limiter logs
each hold; the rows are compared with the foreground path's, exactly.
"""

from __future__ import annotations

import os
import sys
import threading

import pytest
import torch
import trio

import shard.verifier as verifier_mod
from coordinator.trust.compare import logged_frames
from shard.layers import LayerRange
from shard.low_priority import LOWEST_NICE, LowPriorityThread, lower_this_thread
from shard.stage import Stage
from shard.verifier import Verifier
from shard.wire.limits import Limits
from tests.shard.test_verifier import LoggedLimiter, logged_job, request_for

linux = pytest.mark.skipif(sys.platform != "linux", reason="one thread's priority is the OS's (Linux) to lower")


def my_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@linux
def test_the_thread_runs_at_the_lowest_priority_and_the_callers_stay_where_they_were():
    before = my_nice()
    low = LowPriorityThread()

    async def main():
        assert await low.run(my_nice) == LOWEST_NICE
        assert (await low.run(lambda: threading.current_thread().name)).startswith("shard-background")
        with pytest.raises(ZeroDivisionError):  # the work's error reaches the caller
            await low.run(lambda: 1 / 0)
        return await trio.to_thread.run_sync(my_nice)

    assert trio.run(main) == before  # trio's worker threads, and this one, untouched
    assert my_nice() == before and low.lowered is True
    low.close()
    assert low.lowered is None


@linux
def test_lowering_never_raises_a_priority_and_reports_what_it_got():
    done = []

    def work():
        done.append((lower_this_thread(10), my_nice(), lower_this_thread(5), my_nice()))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert done == [(True, 10, True, 10)]  # 5 would raise it back: left at 10, still at least 5


@pytest.fixture(scope="module")
def middle(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(1, store.config.num_layers)
    return store, Stage(store.config, r, store.load_layers(r))


@pytest.fixture(scope="module")
def job(middle):
    """A stage's logged job and what a verify request of it needs."""
    store, stage = middle
    plan, records = logged_job(stage)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    return store, stage, plan, logged_frames(plan, records, limits), limits


def answered(job, monkeypatch, *, step_rows, warm, low_priority=True):
    """The reply, the limiter's log and the nice value each replay forward ran at."""
    store, stage, plan, logged, limits = job
    log: list[str] = []
    nices: list[int] = []
    step = verifier_mod._step

    def spy(steps):
        nices.append(my_nice())
        return step(steps)

    monkeypatch.setattr(verifier_mod, "_step", spy)

    async def main():
        verifier = Verifier(store, "cpu", LoggedLimiter(log), step_rows=step_rows,  # type: ignore[arg-type]
                            pause_ratio=0.0, low_priority=low_priority)
        return await verifier.answer(request_for(plan, logged), limits, (stage, plan.quant) if warm else None)

    return trio.run(main), log, nices


@linux
def test_a_long_replay_runs_at_the_lowest_priority_without_the_limiter_and_equals_the_foreground(job, monkeypatch):
    assert sum(f.positions.shape[0] for f in job[3].inputs) > 4
    back, back_log, back_nices = answered(job, monkeypatch, step_rows=4, warm=False)
    assert back.error is None and len(back_nices) >= 2
    assert set(back_nices) == {LOWEST_NICE} and back_log == []  # never held the node's compute limiter
    fore, fore_log, fore_nices = answered(job, monkeypatch, step_rows=4, warm=False, low_priority=False)
    assert LOWEST_NICE not in fore_nices and len(fore_log) == len(fore_nices)  # each forward held it
    assert back.frame_rows == fore.frame_rows
    assert torch.equal(back.keep, fore.keep) and torch.equal(back.hidden, fore.hidden)


@linux
def test_a_one_step_request_and_a_replay_on_the_warm_slice_stay_in_the_foreground(job, monkeypatch):
    # A newcomer's speed probe is one timed request of one step's rows: at nice 19 on a busy
    # machine it would read the machine's load, not the node's speed. The warm slice is the
    # node's own Stage, which its forwards use from one thread at a time.
    one, log, nices = answered(job, monkeypatch, step_rows=4096, warm=False)
    assert one.error is None and LOWEST_NICE not in nices and len(log) == len(nices) >= 1
    warm, log, nices = answered(job, monkeypatch, step_rows=4, warm=True)
    assert warm.error is None and LOWEST_NICE not in nices and len(log) == len(nices) >= 2


def test_a_gpu_verifier_keeps_the_limiter(middle):
    store, _ = middle
    assert Verifier(store, "cuda", trio.CapacityLimiter(1))._low is None  # a GPU's time is not the OS's to share
    assert Verifier(store, "cpu", trio.CapacityLimiter(1), low_priority=False)._low is None
