"""A job's first frame starting from another job's K/V on the stage (the prefix cache).

Bugs guarded: a forked job's outputs differing from the same prompt run from scratch (slots
copied short, from the wrong job, or positions off by the prefix); a fork of a source the
stage does not hold running on an empty cache (wrong states) instead of failing; a refused
fork leaving a half-opened job behind; the fork's frame not passing its prefix on to the
next stage (which would then run on an empty cache); the source's idle clock not refreshed
by its use. Sound: every output is compared with a twin worker that computed the whole prompt itself.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shard.errors import CacheError, CacheFullError
from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.codec import encode_body
from shard.wire.limits import Limits
from shard.wire.messages import Forward, Result

PROMPT = [5, 9, 7, 4, 11, 3, 8, 2, 6, 10]


def frame(job_id: str, ids: list[int], ctx: int = 0, round_: int = 1, prefix: str | None = None) -> Forward:
    return Forward(job_id=job_id, epoch=1, round=round_, nonce=bytes(16), phase="prefill" if len(ids) > 1 else "decode",
                   ctx_len=ctx, positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids),
                   prefix_job=prefix, prefix_len=ctx if prefix else 0)


def stage_of(store, layers: LayerRange) -> Stage:
    head = layers.start == 0
    return Stage(store.config, layers, store.load_layers(layers), embedding=store.load_embedding() if head else None)


def test_forked_job_equals_the_prompt_run_from_scratch(tiny_llama_store):
    store = tiny_llama_store
    stage = stage_of(store, LayerRange(0, store.num_layers))
    forked, scratch = StageWorker(stage, WorkerConfig(is_tail=True)), StageWorker(stage, WorkerConfig(is_tail=True))
    forked.process(frame("src", PROMPT[:7]))  # the source's prompt: its first 7 tokens shared
    forked.process(frame("src", [1], ctx=7, round_=2))  # and a token of its own after them
    got = [forked.process(frame("j", PROMPT[7:], ctx=7, prefix="src"))]
    want = [scratch.process(frame("j", PROMPT))]
    got.append(forked.process(frame("j", [12], ctx=len(PROMPT), round_=2)))
    want.append(scratch.process(frame("j", [12], ctx=len(PROMPT), round_=2)))
    for g, w in zip(got, want):
        assert isinstance(g, Result)
        assert (g.hidden.float() - w.hidden.float()[-1:]).abs().max().item() <= 1e-4
    # The source is untouched by its fork: its next decode still matches its own history.
    alone = StageWorker(stage, WorkerConfig(is_tail=True))
    alone.process(frame("src", PROMPT[:7]))
    alone.process(frame("src", [1], ctx=7, round_=2))
    a = alone.process(frame("src", [4], ctx=8, round_=3))
    b = forked.process(frame("src", [4], ctx=8, round_=3))
    assert (a.hidden.float() - b.hidden.float()).abs().max().item() <= 1e-4


def test_a_middle_stage_forks_and_passes_the_prefix_on(tiny_llama_store):
    store = tiny_llama_store
    n = store.num_layers
    head, tail = stage_of(store, LayerRange(0, n // 2)), stage_of(store, LayerRange(n // 2, n))
    w_head, w_tail = StageWorker(head, WorkerConfig()), StageWorker(tail, WorkerConfig(is_tail=True))
    s_head, s_tail = StageWorker(head, WorkerConfig()), StageWorker(tail, WorkerConfig(is_tail=True))
    w_tail.process(w_head.process(frame("src", PROMPT[:6])))
    mid = w_head.process(frame("j", PROMPT[6:], ctx=6, prefix="src"))
    assert isinstance(mid, Forward) and (mid.prefix_job, mid.prefix_len) == ("src", 6)
    got = w_tail.process(mid)
    want = s_tail.process(s_head.process(frame("j", PROMPT)))
    assert (got.hidden.float() - want.hidden.float()[-1:]).abs().max().item() <= 1e-4


def test_a_fork_of_a_source_not_held_fails_and_opens_nothing(tiny_llama_store):
    store = tiny_llama_store
    stage = stage_of(store, LayerRange(0, store.num_layers))
    worker = StageWorker(stage, WorkerConfig(is_tail=True))
    with pytest.raises(CacheError, match="prefix source job 'gone'"):
        worker.process(frame("j", PROMPT[4:], ctx=4, prefix="gone"))
    assert "j" not in worker.cache.jobs
    worker.process(frame("small", PROMPT[:3]))
    worker.cache.close("small")
    tight = StageWorker(stage, WorkerConfig(is_tail=True, max_kv_bytes=300 * worker.cache.bytes_per_slot))
    tight.process(frame("src", PROMPT))
    with pytest.raises(CacheFullError):  # the fork's own 256 slots do not fit beside the source's
        tight.process(frame("j", PROMPT[4:], ctx=4, prefix="src"))
    assert "j" not in tight.cache.jobs and tight.cache.reserved_bytes == 256 * tight.cache.bytes_per_slot


def test_a_fork_refreshes_its_source_and_later_pieces_do_not_copy_again(tiny_llama_store):
    store = tiny_llama_store
    stage = stage_of(store, LayerRange(0, store.num_layers))
    now = [0.0]
    worker = StageWorker(stage, WorkerConfig(is_tail=True), clock=lambda: now[0])
    scratch = StageWorker(stage, WorkerConfig(is_tail=True))
    worker.process(frame("src", PROMPT[:4]))
    now[0] = 100.0
    fwd = frame("j", PROMPT[4:], ctx=4, prefix="src")
    outs = [worker.process_frames([(fwd, encode_body(fwd))], [piece])[0] for piece in ((0, 3), (3, 6))]
    assert outs[0] is None and worker.last_used_s["src"] == 100.0
    assert worker.evict_idle(50.0) == []  # both used at 100 s
    want = scratch.process(frame("j", PROMPT))
    got = outs[1][0]
    assert (got.hidden.float() - want.hidden.float()[-1:]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("change, what", [
    (dict(prefix_len=3), "prefix_len"), (dict(prefix_job=None, prefix_len=4), "without 'prefix_job'"),
    (dict(prefix_job="j"), "another job"), (dict(commit_src=(1,), commit_dst=0), "commit_src"),
])
def test_malformed_prefixes_are_refused_on_the_wire(change, what):
    fwd = dataclasses.replace(frame("j", PROMPT[4:], ctx=4, prefix="src"), **change)
    with pytest.raises(Exception, match=what):
        fwd.check(Limits())
