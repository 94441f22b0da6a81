"""StageWorker.evict_idle: jobs idle past the timeout lose their KV, on the worker's clock.

Bug guarded: a predecessor that opened jobs and never ended them held the KV budget for
good, and a frame continuing a job whose KV was gone ran on an empty cache (wrong states,
no error). Sound: only the idle job is evicted, the budget it held is returned, a late
frame of it raises CacheError naming the idle time, and a fresh prefill of it is served.
"""

from __future__ import annotations

import pytest
import torch

from shard.errors import CacheError
from shard.layers import LayerRange
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.wire.codec import encode_body
from shard.wire.messages import Forward


def prefill(job_id: str, ids: list[int], ctx: int = 0) -> Forward:
    return Forward(job_id=job_id, epoch=1, round=1, nonce=bytes(16), phase="prefill", ctx_len=ctx,
                   positions=torch.arange(ctx, ctx + len(ids)), tokens=torch.tensor(ids))


def test_idle_jobs_are_evicted_and_a_late_frame_of_one_fails(tiny_llama_store):
    store = tiny_llama_store
    r = LayerRange(0, store.num_layers)
    stage = Stage(store.config, r, store.load_layers(r), embedding=store.load_embedding())
    now = [100.0]
    worker = StageWorker(stage, WorkerConfig(is_tail=True, job_idle_timeout_s=60.0), clock=lambda: now[0])

    def run(fwd: Forward):
        return worker.process_frame(fwd, encode_body(fwd))

    run(prefill("old", [5, 9, 7]))
    now[0] += 50
    run(prefill("busy", [5, 9]))
    held = worker.cache.reserved_bytes
    now[0] += 20  # "old" idle 70 s, "busy" 20 s
    assert worker.evict_idle(60.0) == ["old"]
    assert sorted(worker.cache.jobs) == ["busy"] and worker.cache.reserved_bytes == held // 2
    with pytest.raises(CacheError) as info:
        run(prefill("old", [3], ctx=3))
    assert str(info.value) == ("KV cache of job 'old' was freed after 70 s idle; a frame at ctx_len 3 needs it "
                               "(re-prefill from 0)")
    run(prefill("old", [5, 9, 7]))  # a fresh prefill of it is served
    assert sorted(worker.cache.jobs) == ["busy", "old"]
