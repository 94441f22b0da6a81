"""A forked job's audit replays its source's frames once per verifier (shard.replay.LeadState).

Bug guarded (issue 21): every audit of a fork replayed the source's prompt before the job's
own rows (coordinator.trust.prefix_audit), ~40% of the rows a 16-stream ring's verifiers
replayed, the same rows for every fork of one source. Now a verifier keeps what those rows
left (the replay cache's K/V after every row of the source's frames) under a digest of those
frames, the slice and formats, and under the lead's segments, and replays only the job's own
frames on the next fork, at any prefix length. Wrong would be: a state used for other frames
(wrong K/V: an honest stage accused), or outputs that differ from replaying everything.
Sound: the replies are compared bitwise with a replay of every frame, and with the stage's
own outputs; the replayed rows are counted.
"""

from __future__ import annotations

import logging

import torch
import trio

from shard.layers import LayerRange
from shard.replay import LeadCache, LeadState, ReplayStats, replay_steps
from shard.stage_worker import StageWorker, WorkerConfig
from shard.verifier import Verifier
from shard.wire.codec import encode_body
from shard.wire.limits import Limits
from shard.wire.verify import VerifyRequest
from tests.shard.test_stage_prefix_fork import frame, stage_of

PROMPT = [5, 9, 7, 4, 11, 3, 8, 2, 6, 10, 13, 1]


def fork_frames(stage, prefix_len: int, job: str = "j"):
    """The source's frames through the one that writes the prefix (the lead), then a fork of
    it at `prefix_len` and two decodes, each as the stage ran it, and the stage's outputs."""
    worker = StageWorker(stage, WorkerConfig())
    lead = [frame("src", PROMPT[:9]), frame("src", [1], ctx=9, round_=2)]
    lead = lead[:1] if prefix_len <= 9 else lead
    ours = [frame(job, PROMPT[prefix_len:] + [2], ctx=prefix_len, prefix="src"),
            frame(job, [12], ctx=len(PROMPT) + 1, round_=2), frame(job, [4], ctx=len(PROMPT) + 2, round_=3)]
    for f in lead:
        worker.process(f)
    outs = [worker.process(f) for f in ours]
    return lead, ours, outs


def verify_request(store, frames, request_id: int = 1) -> VerifyRequest:
    """A request to replay `frames` on all of `store`'s layers, as the gateway sends it."""
    data = [encode_body(f) for f in frames]
    return VerifyRequest(request_id=request_id, layer_start=0, layer_end=store.num_layers, wire_dtype="f32",
                         frame_bytes=tuple(map(len, data)),
                         frames=torch.frombuffer(bytearray(b"".join(data)), dtype=torch.uint8))


def run(stage, frames, lead=0, key=b"k", cache=None, max_rows=4):
    stats = ReplayStats()
    steps = replay_steps(stage, "f32", frames, max_rows, stats, lead=lead, lead_key=key, lead_cache=cache)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value, stats


def same(a, b) -> bool:
    return all((x is None) == (y is None) and (x is None or all(
        (p is None and q is None) or torch.equal(p, q) for p, q in zip(x, y))) for x, y in zip(a, b))


def test_a_second_fork_of_a_source_replays_only_its_own_rows_and_the_same_outputs(tiny_llama_store):
    stage = stage_of(tiny_llama_store, LayerRange(0, tiny_llama_store.num_layers))
    lead, ours, outs = fork_frames(stage, 7)
    frames = lead + ours
    whole, whole_stats = run(stage, frames, lead=len(lead))  # no cache: everything replayed
    cache = LeadCache(1 << 30)
    first, first_stats = run(stage, frames, lead=len(lead), cache=cache)
    second, second_stats = run(stage, frames, lead=len(lead), cache=cache)
    assert (cache.misses, cache.hits, len(cache)) == (1, 1, 1)
    assert same(first, whole) and same(second, whole)  # bitwise: the kept K/V is what the lead left
    assert first_stats.rows == whole_stats.rows
    assert (whole_stats.lead_kept, first_stats.lead_kept, second_stats.lead_kept) == (False, False, True)
    assert second_stats.rows < whole_stats.rows and second_stats.forwards < whole_stats.forwards
    for (keep, hidden, _), out in zip(second[len(lead):], outs):  # and it is what the stage computed
        assert (hidden[-1:] - out.hidden.float()[-1:]).abs().max().item() <= 1e-4


def test_one_state_serves_every_prefix_length_of_its_source(tiny_llama_store):
    # Bug guarded (issue 21): a lead's segments kept only the lead rows the job read, so forks
    # of one source at two prefix lengths (bench_load's two 1.9k-token prompts differ only in
    # their last tokens) keyed two states, and each verifier replayed the whole lead once for
    # each (~3.5 CPU-s on a 10-layer slice). Now every lead row is replayed and kept: forked at
    # 7 and then at 5, whole (rows <= 16) or in pieces of 4, the second finds the first's state,
    # and its rows are the replay's without it and within 1e-4 of what the stage computed.
    stage = stage_of(tiny_llama_store, LayerRange(0, tiny_llama_store.num_layers))
    at7, at5 = fork_frames(stage, 7), fork_frames(stage, 5)
    for max_rows in (16, 4):
        cache = LeadCache(1 << 30)
        run(stage, at7[0] + at7[1], lead=len(at7[0]), cache=cache, max_rows=max_rows)
        got, stats = run(stage, at5[0] + at5[1], lead=len(at5[0]), cache=cache, max_rows=max_rows)
        want, _ = run(stage, at5[0] + at5[1], lead=len(at5[0]), max_rows=max_rows)
        assert (cache.hits, cache.misses, stats.lead_kept) == (1, 1, True) and same(got, want)
        assert got[0] is None  # the source's rows are not returned: an audit never compares them
        for (keep, hidden, _), out in zip(got[1:], at5[2]):
            assert (hidden[-1:] - out.hidden.float()[-1:]).abs().max().item() <= 1e-4


def test_the_kept_states_stay_within_their_bytes_oldest_out_first():
    def state(n):
        return LeadState(torch.zeros(1, 1, n, 4), torch.zeros(1, 1, n, 4))

    size = state(8).nbytes
    cache = LeadCache(2 * size)
    for i in range(3):
        cache.put((b"%d" % i, ()), state(8))
    assert len(cache) == 2 and cache.held == 2 * size and cache.get((b"0", ())) is None
    cache.put((b"big", ()), state(100))  # larger than the whole bound: not kept
    assert len(cache) == 2 and cache.get((b"1", ())) is not None
    assert LeadCache(0).max_bytes == 0 and (LeadCache(0).put((b"x", ()), state(1)) or True)


def test_a_verifier_keeps_a_sources_lead_across_requests_and_prefix_lengths(tiny_llama_store, caplog):
    caplog.set_level(logging.INFO, logger="shard.node")
    store = tiny_llama_store
    stage = stage_of(store, LayerRange(0, store.num_layers))
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)

    lead, ours, _ = fork_frames(stage, 7)
    _, other, _ = fork_frames(stage, 7, job="k")  # another fork of the same source
    _, at5, _ = fork_frames(stage, 5)

    async def main():
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1), step_rows=4, pause_ratio=0.0)
        a = await verifier.answer(verify_request(store, lead + ours), limits)
        b = await verifier.answer(verify_request(store, lead + other), limits)
        c = await verifier.answer(verify_request(store, lead[:1] + at5), limits)  # forked at 5: its lead is the same frame
        fresh = await Verifier(store, "cpu", trio.CapacityLimiter(1), step_rows=4, lead_cache_bytes=0).answer(
            verify_request(store, lead + other), limits)
        return verifier.leads, a, b, c, fresh

    leads, a, b, c, fresh = trio.run(main)
    assert all(r.error is None for r in (a, b, c, fresh))
    assert (leads.hits, leads.misses) == (2, 1)  # b and c reused a's lead (c, forked shorter, too)
    assert b.frame_rows == fresh.frame_rows and torch.equal(b.hidden, fresh.hidden) and torch.equal(b.keep, fresh.keep)
    assert a.frame_rows == b.frame_rows
    # Each request's log line says whether its own lead was kept (read off its own replay, not
    # the cache's shared counters: the steps of concurrent requests interleave).
    kept = [r.getMessage().endswith("kept from an earlier replay") for r in caplog.records if "replayed on layers" in r.getMessage()]
    assert kept == [False, True, True, False], kept


def test_each_replay_reports_its_own_lead_hit_while_another_runs_beside_it(tiny_llama_store, caplog):
    # Bug guarded: the log line read "kept from an earlier replay" off the cache's shared hit
    # counter, so a replay that missed read as a hit when another request's steps, interleaved
    # with its own, hit meanwhile (the logs overcounted hits under load).
    caplog.set_level(logging.INFO, logger="shard.node")
    store = tiny_llama_store
    stage = stage_of(store, LayerRange(0, store.num_layers))
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    lead, ours, _ = fork_frames(stage, 7)
    _, other, _ = fork_frames(stage, 7, job="k")  # the same lead: a hit once `ours` was replayed
    long_lead, at10, _ = fork_frames(stage, 10)  # a longer lead: a miss

    async def main():
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1), step_rows=2, pause_ratio=0.0)
        await verifier.answer(verify_request(store, lead + ours, 1), limits)
        async with trio.open_nursery() as n:
            n.start_soon(verifier.answer, verify_request(store, long_lead + at10, 2), limits)
            n.start_soon(verifier.answer, verify_request(store, lead + other, 3), limits)
        return verifier.leads

    leads = trio.run(main)
    assert (leads.hits, leads.misses) == (1, 2)
    lines = {int(r.getMessage().split()[2].rstrip(":")): r.getMessage() for r in caplog.records
             if "replayed on layers" in r.getMessage()}
    kept = {i: line.endswith("kept from an earlier replay") for i, line in lines.items()}
    assert kept == {1: False, 2: False, 3: True}, lines


def test_audits_of_one_source_drawn_together_replay_its_lead_once(tiny_llama_store):
    # Bug guarded (issue 21): two audits of forks of one source that reach a verifier together
    # (a closed loop's clients end in clusters) both looked the lead up before either had kept
    # it, so each replayed the whole source (at 16 streams of bench_load's mix, a third of the
    # 1.9k-token leads' replays on a verifier that had just replayed that lead). Now the second
    # waits for the first's lead and then finds it kept; both replies are the ones a verifier
    # keeping nothing gives.
    store = tiny_llama_store
    stage = stage_of(store, LayerRange(0, store.num_layers))
    limits = Limits.for_model(store.config, max_tokens_per_frame=2048)
    lead, ours, _ = fork_frames(stage, 7)
    _, other, _ = fork_frames(stage, 7, job="k")

    async def main():
        verifier = Verifier(store, "cpu", trio.CapacityLimiter(1), step_rows=2, pause_ratio=0.0)
        got = {}

        async def ask(frames, request_id):
            got[request_id] = await verifier.answer(verify_request(store, frames, request_id), limits)

        async with trio.open_nursery() as n:
            n.start_soon(ask, lead + ours, 1)
            n.start_soon(ask, lead + other, 2)
        fresh = Verifier(store, "cpu", trio.CapacityLimiter(1), step_rows=2, lead_cache_bytes=0)
        alone = [await fresh.answer(verify_request(store, lead + f, i), limits) for i, f in ((1, ours), (2, other))]
        return verifier.leads, got, alone

    leads, got, alone = trio.run(main)
    assert (leads.misses, leads.hits) == (1, 1)
    for i, want in zip((1, 2), alone):
        assert got[i].error is None and got[i].frame_rows == want.frame_rows and torch.equal(got[i].hidden, want.hidden)
