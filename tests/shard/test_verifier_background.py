"""An audit's replay on a ring stage is background work: it runs when the stage is idle.

Bugs guarded (issue 21): at 16 streams on a 3-stage loopback ring, audits' replays silenced
the whole ring for 1-2.5 s at a time. Each replay step held the stage's compute limiter for
up to 256 rows (0.3-0.5 s here), two audits on one node queued two steps at once, and a
slice load (0.25-0.7 CPU-s) held it too; a node that verifies either of two other slices,
drawn at random per audit, reloaded whenever the draw alternated. Now a step or load starts
only on an idle stage (StageScheduler.idle: nothing waiting or running, or after
IDLE_WAIT_S), one at a time per node, frames longer than a step replay in pieces
(shard.replay.split_long) and the slices stay loaded while they fit `cache_bytes`.
Sound: the stage's state is stood in for by an event the test sets, the limiter logs each
hold in turn, and trio's MockClock jumps over sleeps so the bounds are exact.
"""

from __future__ import annotations

import pytest
import torch
import trio
import trio.testing

from coordinator.trust.compare import logged_frames
from shard.layers import LayerRange
from shard.quant import layer_bytes, scheme
from shard.replay import replay, split_long
from shard.stage import Stage
from shard.stage_scheduler import StageScheduler
from shard.slice_cache import SliceCache
from shard.verifier import IDLE_WAIT_S, Verifier
from shard.wire.limits import Limits
from tests.coordinator.trust.test_audit_replay import engine_like_frames
from tests.shard.test_stage_scheduler import frame
from tests.shard.test_verifier import LoggedLimiter, logged_job, request_for


@pytest.fixture(scope="module")
def middle(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(1, store.config.num_layers)
    return store, Stage(store.config, r, store.load_layers(r))


def test_the_stage_is_idle_once_nothing_waits_or_runs_or_after_the_bound():
    release = trio.Event()

    async def run_batch(st, batch):
        await release.wait()

    async def main():
        sched = StageScheduler(lambda: "s", run_batch)
        with trio.move_on_after(0.001) as quick:
            await sched.idle(5.0)
        assert not quick.cancelled_caught  # nothing queued: idle at once
        async with trio.open_nursery() as nursery:
            await nursery.start(sched.serve)
            await sched.submit(frame("s", "a", 1))
            await trio.testing.wait_all_tasks_blocked()
            assert sched.running and not sched.waiting
            started = trio.current_time()
            await sched.idle(5.0)  # a forward runs all along: the bound ends the wait
            assert trio.current_time() - started == 5.0
            done = []

            async def waiter():
                await sched.idle(60.0)
                done.append(trio.current_time())

            nursery.start_soon(waiter)
            await trio.sleep(1.0)
            assert not done
            release.set()
            await trio.testing.wait_all_tasks_blocked()
            assert done == [started + 6.0] and not sched.running  # the forward's end woke it
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0.01))


def test_a_replay_step_starts_only_on_an_idle_stage_and_one_at_a_time(middle):
    store, stage = middle
    plan, records = logged_job(stage)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    logged = logged_frames(plan, records, limits)
    log: list[str] = []
    replies = []

    async def main():
        limiter, idle_now = LoggedLimiter(log), trio.Event()

        async def idle(max_wait_s):
            assert max_wait_s == IDLE_WAIT_S
            await idle_now.wait()
            log.append("idle")

        verifier = Verifier(store, "cpu", limiter, step_rows=4, idle=idle)  # type: ignore[arg-type]

        async def ask():
            replies.append(await verifier.answer(request_for(plan, logged), limits, (stage, plan.quant)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            nursery.start_soon(ask)
            await trio.testing.wait_all_tasks_blocked()
            assert log == []  # the stage is busy: no step started
            idle_now.set()

    trio.run(main)
    assert len(replies) == 2 and all(r.error is None for r in replies)
    assert replies[0].frame_rows == replies[1].frame_rows
    assert log.count("replay") >= 8 and log[0] == "idle"
    # every step was begun on a fresh idle check: two audits never queue two steps at once
    assert all(log[i - 1] == "idle" for i, e in enumerate(log) if e == "replay")


def test_a_frame_longer_than_a_step_replays_in_pieces_with_the_same_rows(middle):
    store, stage = middle
    frames = engine_like_frames(False, stage.cfg.hidden_size)
    longest = max(f.positions.shape[0] for f in frames)
    assert longest > 4
    pieces, origin = split_long(frames, 4)
    assert all(p.positions.shape[0] <= 4 for p in pieces if p.tree_parents is None and not p.commit_src)
    for p, (i, a) in zip(pieces, origin):
        f = frames[i]
        assert p.ctx_len == f.ctx_len + a
        assert torch.equal(p.positions, f.positions[a:a + p.positions.shape[0]])
    assert sorted({i for i, _ in origin}) == list(range(len(frames)))
    whole = replay(stage, "f32", frames, max_rows=1024)
    split = replay(stage, "f32", frames, max_rows=4)
    for w, s in zip(whole, split):
        assert (w is None) == (s is None)
        if w is not None:
            assert torch.equal(w[0], s[0])
            assert torch.allclose(w[1], s[1], rtol=1e-5, atol=1e-5)


def test_slices_loaded_for_audits_stay_while_they_fit_the_cache(middle):
    store, _ = middle
    a, b = LayerRange(0, 1), LayerRange(1, store.config.num_layers)

    def alternate(cache_bytes, max_slices=None):
        cache = SliceCache(store, "cpu", cache_bytes, max_slices)
        for r in (a, b, a, b):
            if cache.get((r, "none")) is None:
                cache.load((r, "none"))
        return cache.loads, len(cache)

    assert alternate(1 << 30) == (2, 2)  # both fit: each loaded once
    assert alternate(0) == (4, 1)  # none fits: only the one in use is kept
    cfg = store.config
    layers = sum(layer_bytes(cfg, i, scheme("none")) for i in range(cfg.num_layers))
    # the head slice's embedding counts too: a budget of the layers alone holds one slice
    assert alternate(layers) == (4, 1)
    assert alternate(layers + 4 * cfg.vocab_size * cfg.hidden_size) == (2, 2)
    assert alternate(1 << 30, max_slices=1) == (4, 1)  # a count bound (the gateway's own replays) too
    assert alternate(1 << 30, max_slices=2) == (2, 2)


def test_split_long_leaves_trees_and_commits_whole(middle):
    _, stage = middle
    frames = engine_like_frames(False, stage.cfg.hidden_size)
    shaped = [f for f in frames if f.tree_parents is not None or f.commit_src]
    assert shaped
    pieces, _ = split_long(shaped, 1)
    assert [p.positions.shape[0] for p in pieces] == [f.positions.shape[0] for f in shaped]
    assert all(p is f for p, f in zip(pieces, shaped))


def test_a_negative_verify_cache_flag_is_refused():
    from shard.node_config import NodeConfig

    with pytest.raises(ValueError, match=r"verify_cache_mb must be >= 0 \(0: keep only the slice in use\), got -1"):
        NodeConfig(coordinator="/ip4/127.0.0.1/tcp/1", verify_cache_mb=-1)


def test_a_fetch_waiting_on_peers_does_not_hold_up_another_audits_replay(middle):
    # One replay step or load at a time per node, but a fetch of a slice's missing files waits
    # on peers, not on the CPU: another audit's replay must run meanwhile.
    store, stage = middle
    plan, records = logged_job(stage)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    logged = logged_frames(plan, records, limits)
    files_came, order = trio.Event(), []

    async def fetch(r):
        await files_came.wait()

    async def main():
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1), fetch, step_rows=4)

        async def ask(name, warm):
            reply = await verifier.answer(request_for(plan, logged), limits, warm)
            order.append((name, reply.error))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask, "loads", None)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(ask, "warm", (stage, plan.quant))
            with trio.fail_after(60):
                while not order:
                    await trio.sleep(0.01)
            files_came.set()

    trio.run(main)
    assert order == [("warm", None), ("loads", None)]


def test_replays_pause_between_their_forwards_and_a_one_forward_replay_never(middle):
    # Bug guarded: the pause after every step (PAUSE_RATIO) also followed a replay's only
    # forward, so a newcomer's speed probe (one timed VerifyRequest of one frame) read its
    # compute 1 + PAUSE_RATIO times slow and formation seated the ring on it. Sound: the
    # pauses are trio sleeps on a mock clock (the forwards run in real time in a thread).
    store, stage = middle
    plan, records = logged_job(stage)
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    logged = logged_frames(plan, records, limits)

    def paused(step_rows: int) -> float:
        async def main():
            verifier = Verifier(store, "cpu", trio.CapacityLimiter(1), step_rows=step_rows, pause_ratio=1000.0)
            start = trio.current_time()
            reply = await verifier.answer(request_for(plan, logged), limits, (stage, plan.quant))
            assert reply.error is None
            return trio.current_time() - start
        return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))

    assert paused(4096) == 0.0  # one forward: no pause
    assert paused(4) > 0.0  # many: paused between them
