"""The queue in front of the running generations: who runs, who waits, who gets 429 (issue 21).

Bugs guarded: a request past the limit refused at once although a slot frees in a moment;
a newcomer overtaking requests that already wait; a queue that grows without bound or
holds a request forever; slots leaked by a request that timed out or whose client left
while it waited; a 429 without Retry-After or with a meaningless one. Sound: the pure
decisions are checked as properties; the trio half runs on trio's mock clock with
`wait_all_tasks_blocked`, so every "is waiting" and "timed out" is determined; the HTTP
test holds a scripted job mid-generation so the queue is known to be full.
"""

from __future__ import annotations

import httpx
import trio
import trio.testing
from hypothesis import given, strategies as st

from coordinator.gateway.api import ApiConfig, create_app
from coordinator.gateway.job_queue import (MAX_RETRY_AFTER_S, REFUSE, RUN, WAIT, JobQueue, QueueRefused, admit,
                                           retry_after_s)
from test_api_http import CHAT, HELLO, served


@given(st.integers(0, 20), st.integers(1, 20), st.integers(0, 30), st.integers(0, 30), st.integers(1, 25))
def test_admit_properties(in_use, limit, waiting, max_waiting, wanted):
    d = admit(in_use, limit, waiting, max_waiting, wanted)
    if d == RUN:
        assert waiting == 0 and in_use + wanted <= limit  # never past the limit, never ahead of a waiter
    elif d == WAIT:
        assert waiting < max_waiting and wanted <= limit
    else:
        assert d == REFUSE and (wanted > limit or waiting >= max_waiting)
    if wanted <= limit and waiting == 0 and in_use + wanted <= limit:
        assert d == RUN  # a free slot is used at once


def test_retry_after_grows_with_the_queue_and_is_bounded():
    assert retry_after_s(0, 8, 4.0) == 1  # 1/8 of a 4 s job, rounded up to whole seconds
    assert retry_after_s(15, 8, 4.0) == 8  # two rounds of 8 jobs ahead
    assert retry_after_s(10**6, 1, 100.0) == MAX_RETRY_AFTER_S
    assert retry_after_s(0, 1, 0.0) == 1


def test_waiters_run_in_arrival_order_and_timeouts_and_cancels_leave_no_slot_behind():
    async def main():
        q = JobQueue(limit=2, max_waiting=3, wait_s=10.0, clock=trio.current_time)
        first = await q.acquire(2)
        order = []

        async def want(name, n, task_status=trio.TASK_STATUS_IGNORED):
            with trio.CancelScope() as scope:
                task_status.started(scope)
                try:
                    ticket = await q.acquire(n)
                except QueueRefused as exc:
                    order.append((name, "refused", exc.retry_after_s))
                    return
                order.append((name, "runs"))
                await trio.sleep(100)  # holds its slots until cancelled
                q.release(ticket)

        async with trio.open_nursery() as nursery:
            a = await nursery.start(want, "a", 1)
            await nursery.start(want, "b", 2)
            cancelled = await nursery.start(want, "c", 1)
            await nursery.start(want, "d", 1)  # the queue is full (3 wait)
            await trio.testing.wait_all_tasks_blocked()
            # (3 ahead + itself) / 2 slots x 10 s (FIRST_JOB_S: no job has finished yet)
            assert q.waiting == 3 and order == [("d", "refused", 20)]
            cancelled.cancel()  # c's client leaves while it waits
            await trio.testing.wait_all_tasks_blocked()
            assert q.waiting == 2
            await trio.sleep(4)
            q.release(first)  # held 4 s: a runs, then b (2 slots) must wait for a, and no one overtakes b
            await trio.testing.wait_all_tasks_blocked()
            assert order[1:] == [("a", "runs")] and q.in_use == 1 and q.waiting == 1
            await trio.sleep(10)  # b's wait runs out
            await trio.testing.wait_all_tasks_blocked()
            assert order[2][:2] == ("b", "refused") and q.waiting == 0 and q.in_use == 1
            a.cancel()
        assert q.in_use == 1  # a was cancelled while running, before its release: the caller's job (the API releases in finally)

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def test_overload_waits_in_the_queue_then_429_with_retry_after(scripted):
    # Sound: the gate is held, so job 1 stays stuck after its first block (its whole
    # response cannot be sent); job 2 must wait in the queue (not 429) and time out there;
    # job 3 finds the queue full and is refused at once; both 429s say when to retry.
    engine = scripted(["ab", "cd"])
    engine.gate = trio.Event()
    app = create_app(engine, ApiConfig(max_concurrent_jobs=1, max_queued_jobs=1, queue_timeout_s=1.0))
    body = {"model": "scripted", "messages": HELLO}

    async def fn(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
            results = {}

            async def post(name):
                results[name] = await client.post(CHAT, json=body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "first")
                while len(engine.jobs) < 1:
                    await trio.sleep(0.01)
                async with trio.open_nursery() as refused:
                    refused.start_soon(post, "queued")
                    while (await client.get("/health")).json()["jobs_queued"] != 1:
                        await trio.sleep(0.01)
                    refused.start_soon(post, "full")
                engine.gate.set()
            return results

    results = served(app, fn)
    for name in ("queued", "full"):
        r = results[name]
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_concurrent_jobs", name
        assert int(r.headers["retry-after"]) >= 1, name
    assert "waited 1 s in the queue" in results["queued"].json()["error"]["message"]
    assert "1 requests already wait" in results["full"].json()["error"]["message"]
    assert results["first"].status_code == 200 and len(engine.jobs) == 1


def test_a_queued_request_runs_when_a_slot_frees(scripted):
    engine = scripted(["ab", "cd"])
    engine.gate = trio.Event()
    app = create_app(engine, ApiConfig(max_concurrent_jobs=1, max_queued_jobs=4, queue_timeout_s=20.0))
    body = {"model": "scripted", "messages": HELLO}

    async def fn(base_url):
        async with httpx.AsyncClient(base_url=base_url, timeout=20) as client:
            out = {}

            async def post(name):
                out[name] = await client.post(CHAT, json=body)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(post, "first")
                while len(engine.jobs) < 1:
                    await trio.sleep(0.01)
                nursery.start_soon(post, "second")
                while (await client.get("/health")).json()["jobs_queued"] != 1:
                    await trio.sleep(0.01)
                assert len(engine.jobs) == 1  # the second waits; it has no job yet
                engine.gate.set()
            # The slot is freed once the response's last bytes are sent, which the client
            # can see before the server's task gets there: wait (bounded) for it rather
            # than read /health in the same instant. A slot never freed still fails.
            with trio.move_on_after(5):
                while (await client.get("/health")).json()["jobs_running"] != 0:
                    await trio.sleep(0.01)
            return out, (await client.get("/health")).json()

    out, health = served(app, fn)
    assert [out[k].status_code for k in ("first", "second")] == [200, 200]
    assert [out[k].json()["choices"][0]["message"]["content"] for k in ("first", "second")] == ["abcd", "abcd"]
    assert health["jobs_running"] == 0 and health["jobs_queued"] == 0
