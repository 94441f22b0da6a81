"""A real node batches the frames of different jobs that wait for it (issue 21).

Bugs guarded: frames waiting at a stage run one forward each (no batching at the node), an
output sent for the wrong job, a bad frame in a batch failing its batch-mates, a frame kept
waiting for company, a job's frames reordered. Sound: the test holds the node's compute
limiter while frames arrive, so which frames wait together is known, not raced; the
scheduler's counters say how many forwards ran; each Result is compared with the same job
run alone on a local stage.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import trio

from shard.kvcache import KVCache
from shard.layers import LayerRange
from shard.node import RING_PROTOCOL
from shard.stage import Stage
from shard.wire.codec import encode
from shard.wire.messages import EndJob, Forward, JobError, Result
from test_node_edges import run_scenario


def fwd(job: str, round_: int, ids: list[int], ctx: int = 0) -> Forward:
    return Forward(job_id=job, epoch=1, round=round_, nonce=b"n" * 16, phase="prefill" if ctx == 0 else "decode",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


def alone(store, ids: list[int], then: list[int] | None = None) -> torch.Tensor:
    """The last row of `ids` (or of `then`, decoded after `ids`) through all layers, run alone."""
    cfg = store.config
    r = LayerRange(0, cfg.num_layers)
    stage = Stage(cfg, r, store.load_layers(r), embedding=store.load_embedding())
    job = KVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 26).open("j", 64)
    h, _ = stage.forward(job, torch.tensor(ids), ctx_len=0, positions=torch.arange(len(ids)))
    if then:
        h, _ = stage.forward(job, torch.tensor(then), ctx_len=len(ids), positions=torch.arange(len(ids), len(ids) + len(then)))
    return h[-1:]


async def until(cond) -> None:
    while not cond():
        await trio.sleep(0.005)


async def receive(ctx, n: int) -> dict:
    """The next n Results and JobErrors by (job, round); other control messages are skipped."""
    got = {}
    while len(got) < n:
        msg = await ctx["results"].receive()
        if isinstance(msg, (Result, JobError)):
            got[(msg.job_id, msg.round)] = msg
    return got


def test_waiting_frames_of_different_jobs_share_one_forward_and_a_bad_one_fails_alone(tiny_llama_store):
    store = tiny_llama_store
    vocab = store.config.vocab_size

    async def script(ctx):
        node = ctx["node"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        sched = node.scheduler
        async with node.compute_limiter:  # the first frame's forward waits for us
            await stream.send_frame(encode(fwd("a", 1, [5, 9, 77])))
            await until(lambda: sched.forwards == 1)  # taken alone: nothing else waited
            await stream.send_frame(encode(fwd("b", 1, [7, 7, 8, 9])))
            await stream.send_frame(encode(fwd("bad", 1, [3, vocab])))  # a token id past the vocab
            await stream.send_frame(encode(fwd("a", 2, [11], ctx=3)))  # a's next frame: after a's first
            await stream.send_frame(encode(fwd("c", 1, [42])))
            await until(lambda: len(sched.waiting) == 4)
        got = await receive(ctx, 5)
        assert (sched.forwards, sched.frames_run) == (2, 5)  # [a1], then [b, bad, a2, c] in one forward
        assert isinstance(got[("bad", 1)], JobError) and "token id" in got[("bad", 1)].message
        for key, want in {("a", 1): alone(store, [5, 9, 77]), ("b", 1): alone(store, [7, 7, 8, 9]),
                          ("a", 2): alone(store, [5, 9, 77], [11]), ("c", 1): alone(store, [42])}.items():
            out = got[key]
            assert isinstance(out, Result) and (out.hidden - want).abs().max().item() <= 1e-5, key
        # The failed job alone lost its cache; the others kept theirs.
        assert set(node.state.worker.cache.jobs) == {"a", "b", "c"}

    trio.run(run_scenario, store, os.urandom(32), script)


def test_a_lone_frame_runs_at_once_and_a_jobs_end_drops_its_waiting_frames(tiny_llama_store):
    # A job's end takes its frames still waiting out unrun and a later frame of it is refused
    # (issue 21: run after the end, they held or re-opened its K/V: a K/V refusal about one
    # e2e run in ten); the other job's frames run as before.
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(fwd("a", 1, [5, 9, 77])))
        [first] = (await receive(ctx, 1)).values()  # served with no other frame ever arriving
        assert isinstance(first, Result) and node.scheduler.forwards == 1
        async with node.compute_limiter:
            await stream.send_frame(encode(fwd("b", 1, [4, 4])))
            await until(lambda: node.scheduler.forwards == 2)
            await stream.send_frame(encode(fwd("a", 2, [11], ctx=3)))
            await stream.send_frame(encode(EndJob(job_id="a", epoch=1)))
            await stream.send_frame(encode(fwd("b", 2, [12], ctx=2)))
            await stream.send_frame(encode(fwd("a", 3, [13], ctx=4)))  # after a's end
            await until(lambda: node.scheduler.dropped_after_end == 2 and len(node.scheduler.waiting) == 2)
        got = await receive(ctx, 3)
        assert set(got) == {("b", 1), ("b", 2), ("a", 3)}  # a2 dropped unanswered (sent before the end)
        assert isinstance(got[("a", 3)], JobError) and got[("a", 3)].code == "job_ended"  # sent after it: answered
        assert (got[("b", 2)].hidden - alone(store, [4, 4], [12])).abs().max().item() <= 1e-5
        await until(lambda: node.scheduler.forwards == 3)  # [a's end, b2]: a2 and a3 never ran
        assert set(node.state.worker.cache.jobs) == {"b"}  # a's K/V freed and not re-opened
        await trio.sleep(0.1)
        while True:
            try:
                msg = ctx["results"].receive_nowait()
            except trio.WouldBlock:
                break
            assert not isinstance(msg, (Result, JobError)), msg

    trio.run(run_scenario, store, os.urandom(32), script)


def test_waiting_frames_are_bounded_and_a_full_queue_holds_the_stream(tiny_llama_store):
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        node.scheduler.config = dataclasses.replace(node.scheduler.config, max_waiting_frames=2)
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        async with node.compute_limiter:
            for i in range(6):
                await stream.send_frame(encode(fwd(f"j{i}", 1, [5, i + 3])))
            await until(lambda: len(node.scheduler.waiting) == 2)
            await trio.sleep(0.2)  # what more could arrive has: the bound holds
            assert len(node.scheduler.waiting) == 2
        got = await receive(ctx, 6)
        assert all(isinstance(m, Result) for m in got.values())

    trio.run(run_scenario, store, os.urandom(32), script)


def test_an_end_for_another_epoch_leaves_the_job_running_here(tiny_llama_store):
    # A job resumed on a new ring keeps its id: the old ring's end (its epoch) must not free the
    # K/V the resumed job holds on this node's current epoch, nor drop its frames.
    store = tiny_llama_store

    async def script(ctx):
        node = ctx["node"]
        stream = await ctx["coord"].open_stream(node.host.peer_id, RING_PROTOCOL)
        await stream.send_frame(encode(fwd("a", 1, [5, 9, 77])))
        await receive(ctx, 1)
        await stream.send_frame(encode(EndJob(job_id="a", epoch=0)))
        await stream.send_frame(encode(fwd("a", 2, [11], ctx=3)))
        got = await receive(ctx, 1)
        assert isinstance(got[("a", 2)], Result)
        assert (got[("a", 2)].hidden - alone(store, [5, 9, 77], [11])).abs().max().item() <= 1e-5
        assert set(node.state.worker.cache.jobs) == {"a"} and node.scheduler.dropped_after_end == 0

    trio.run(run_scenario, store, os.urandom(32), script)
