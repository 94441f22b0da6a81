"""A real node survives its own bugs: a frame's costs its job, a session's costs a session (issue 20).

Bugs guarded: an exception that is no ShardError while a frame is processed ending the
node's session, and so the `shard-node join` process (4c6d32a: a negative trio timeout in
the scheduler's burst wait killed a stage under load); a bug in one job's frame failing
its batch-mates; after a session failed, jobs' K/V kept (a later frame of one would run on
it) or the node never registering again; a bug every session meets restarting forever.
Sound: the bugs are injected into the real node (its stage's forward, its scheduler, a
session task) with the coordinator played by the test (test_node_edges.run_scenario);
outputs are compared bit for bit with the local stage forward of the same tokens alone;
re-registration is seen as a new control stream at the test's coordinator.
"""

from __future__ import annotations

import functools
import logging
import os

import pytest
import trio

import shard.node as shard_node
from shard.errors import sole_error
from shard.node import RING_PROTOCOL, Node
from shard.node_links import NodeLinks
from shard.reconnect import CrashLoopError, CrashPolicy, ReconnectPolicy
from shard.wire.codec import encode
from shard.wire.messages import JobError, LinkReport, ProbePeers, Result
from test_node_batching import fwd, receive, until
from test_node_edges import reference_hidden, run_scenario

FAST_RESTARTS = ReconnectPolicy(crashes=CrashPolicy(first_s=0.05, max_s=0.05))


def test_a_bug_in_a_frame_ends_its_job_alone_and_the_node_serves_on(tiny_llama_store):
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        stage = node.state.worker.stage
        honest = stage.forward_batch

        def buggy(frames):
            if any(f.job.job_id == "bad" for f in frames):
                raise RuntimeError("a bug only the bad job meets")
            return honest(frames)

        stage.forward_batch = buggy
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(fwd("bad", 1, [5, 9])))  # alone
        [alone] = (await receive(ctx, 1)).values()
        assert isinstance(alone, JobError) and alone.code == "internal_error" and "a bug only" in alone.message
        async with node.compute_limiter:  # the three after z wait together: one batch
            await stream.send_frame(encode(fwd("z", 1, [6])))
            await until(lambda: node.scheduler.forwards == 2)  # z taken alone, waiting for the limiter
            for job, ids in (("a", [5, 9, 77]), ("bad", [3, 4]), ("b", [7, 7, 8])):
                await stream.send_frame(encode(fwd(job, 2 if job == "bad" else 1, ids)))
            await until(lambda: len(node.scheduler.waiting) == 3)
        got = await receive(ctx, 4)
        assert node.scheduler.forwards == 3 and node.scheduler.frames_run == 5
        assert isinstance(got[("bad", 2)], JobError) and got[("bad", 2)].code == "internal_error"
        for job, ids in (("a", [5, 9, 77]), ("b", [7, 7, 8])):
            out = got[(job, 1)]
            assert isinstance(out, Result) and out.hidden.equal(reference_hidden(store, ids)[-1:]), job
        stage.forward_batch = honest
        await stream.send_frame(encode(fwd("c", 1, [42, 5])))
        [out] = (await receive(ctx, 1)).values()
        assert isinstance(out, Result) and out.hidden.equal(reference_hidden(store, [42, 5])[-1:])

    trio.run(run_scenario, store, os.urandom(32), script)


def test_a_bug_outside_a_frame_restarts_the_session_and_the_node_serves_again(tiny_llama_store, caplog):
    store = tiny_llama_store
    caplog.set_level(logging.INFO, logger="shard.node")

    async def script(ctx):
        node = ctx["node"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(fwd("a", 1, [5, 9, 77])))
        [first] = (await receive(ctx, 1)).values()
        assert isinstance(first, Result) and set(node.state.worker.cache.jobs) == {"a"}
        sched, control = node.scheduler, ctx["control"]
        honest = sched.take_nowait

        def buggy():
            sched.take_nowait = honest
            raise ValueError("timeout must be non-negative")  # 4c6d32a's, out of the scheduler's task

        sched.take_nowait = buggy
        await stream.send_frame(encode(fwd("b", 1, [3, 4])))  # its batch never runs: the session fails
        await until(lambda: ctx["control"] is not control)  # registered again on a new control stream
        assert node.state is not None and not node.state.worker.cache.jobs and not sched.waiting
        await stream.send_frame(encode(fwd("a", 2, [11], ctx=3)))  # a's K/V went with the session
        await stream.send_frame(encode(fwd("c", 1, [42, 5])))
        got = await receive(ctx, 2)
        assert isinstance(got[("a", 2)], JobError) and "dropped when the node's session failed" in got[("a", 2)].message
        assert isinstance(got[("c", 1)], Result) and got[("c", 1)].hidden.equal(reference_hidden(store, [42, 5])[-1:])

    trio.run(functools.partial(run_scenario, store, os.urandom(32), script, reconnect=FAST_RESTARTS))
    [crash] = [r for r in caplog.records if r.levelno == logging.ERROR and "session failed on a bug" in r.getMessage()]
    assert crash.exc_info is not None and "timeout must be non-negative" in str(crash.exc_info[1])


def test_a_bug_every_session_meets_ends_the_node_after_the_bound(tiny_llama_store, monkeypatch):
    sessions: list[float] = []

    async def broken_sweep(self) -> None:
        sessions.append(trio.current_time())
        raise RuntimeError("the sweep's bug")

    monkeypatch.setattr(Node, "_sweep_idle_jobs", broken_sweep)
    policy = ReconnectPolicy(crashes=CrashPolicy(max_restarts=2, window_s=60.0, first_s=0.05, max_s=0.05))

    async def never_reached(ctx):
        raise AssertionError("no session got as far as serving")

    with pytest.raises(BaseException) as caught:
        trio.run(functools.partial(run_scenario, tiny_llama_store, os.urandom(32), never_reached, reconnect=policy))
    err = sole_error(caught.value)
    assert isinstance(err, CrashLoopError) and len(sessions) == 3
    assert str(err) == ("the node's session failed 3 times within 60 s, last with RuntimeError: the sweep's bug; "
                        "giving up (the tracebacks are logged above)")


NO_JOB = b"\x00\x00\x00\x02\x81\xa1"  # a header that names no job


def test_a_decoding_bug_costs_its_frame_and_job_and_the_stream_serves_on(tiny_llama_store, monkeypatch, caplog):
    # Bug guarded: an exception other than WireError out of decoding a frame (a check the
    # codec missed) reset the predecessor's ring stream without a JobError: that job waited
    # for its deadline and the other jobs' frames behind it on the stream were lost.
    # Sound: the fault is injected into the real node's decode (shard.node.decode_frame)
    # for job "bad"'s frame and for a frame naming no job, both between other jobs' frames
    # on one stream; "bad" must get a JobError naming the fault, the no-job frame nothing
    # (the next answer is another job's), and every other frame, the one sent last on the
    # same stream included, its output bit for bit as the local forward's.
    store = tiny_llama_store
    caplog.set_level(logging.WARNING, logger="shard.node")
    honest = shard_node.decode_frame

    def buggy(body, limits):
        if bytes(body) == NO_JOB:
            raise KeyError("a bug before the header")
        msg, n = honest(body, limits)
        if msg.job_id == "bad":
            raise ValueError("a check the codec missed")
        return msg, n

    monkeypatch.setattr(shard_node, "decode_frame", buggy)

    async def script(ctx):
        node = ctx["node"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        for frame in (encode(fwd("a", 1, [5, 9, 77])), NO_JOB, encode(fwd("bad", 1, [3, 4])), encode(fwd("b", 1, [7, 7, 8]))):
            await stream.send_frame(frame)
        got = await receive(ctx, 3)
        assert isinstance(got[("bad", 1)], JobError) and got[("bad", 1)].code == "internal_error"
        assert got[("bad", 1)].message == "ValueError: a check the codec missed"
        await stream.send_frame(encode(fwd("c", 1, [42, 5])))
        got.update(await receive(ctx, 1))
        for job, ids in (("a", [5, 9, 77]), ("b", [7, 7, 8]), ("c", [42, 5])):
            out = got[(job, 1)]
            assert isinstance(out, Result) and out.hidden.equal(reference_hidden(store, ids)[-1:]), job
        assert set(got) == {("a", 1), ("bad", 1), ("b", 1), ("c", 1)}  # nothing answered the no-job frame
        coords.append(ctx["coord"].peer_id)

    coords: list[str] = []
    trio.run(run_scenario, store, os.urandom(32), script)
    dropped = [r.getMessage() for r in caplog.records if "did not decode" in r.getMessage()]
    [coord] = coords
    assert dropped == [f"dropped a frame from {coord} that did not decode: KeyError: 'a bug before the header'",
                       f"dropped a frame from {coord} that did not decode: ValueError: a check the codec missed"]


def test_a_probe_that_raises_costs_its_entry_not_the_session(tiny_llama_store, monkeypatch):
    # Bug guarded: a non-transport exception out of a link probe the coordinator asked for
    # (ProbePeers) escaped NodeLinks.report into the node's session, which restarted: its
    # jobs' K/V dropped, a re-registration, and no LinkReport. Sound: the real node gets a
    # ProbePeers on its control stream with one peer whose probe raises; the LinkReport
    # must come back without that peer on the same control stream, and a job's K/V from
    # before must still serve its next frame (a restarted session would have dropped it).
    store = tiny_llama_store

    async def raising(self, peer, addrs):
        raise RuntimeError("a bug in the probe")

    monkeypatch.setattr(NodeLinks, "rtt_to_peer", raising)

    async def script(ctx):
        node, control = ctx["node"], ctx["control"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(fwd("a", 1, [5, 9])))
        assert isinstance((await receive(ctx, 1))[("a", 1)], Result)
        await control.send_frame(encode(ProbePeers(peers={ctx["coord"].peer_id: (ctx["coord"].addrs[0],)})))
        report = await ctx["results"].receive()
        assert isinstance(report, LinkReport) and report.rtt_ms == {} and ctx["control"] is control
        await stream.send_frame(encode(fwd("a", 2, [77], ctx=2)))
        out = (await receive(ctx, 1))[("a", 2)]
        assert isinstance(out, Result) and out.hidden.equal(reference_hidden(store, [5, 9, 77])[-1:])

    trio.run(run_scenario, store, os.urandom(32), script)
