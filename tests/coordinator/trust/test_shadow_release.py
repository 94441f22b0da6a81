"""Shadow.release while frames wait for the shadow's limiter (issue 21).

Bug guarded: when the last stage of a ring left probation, the next round's release
dropped the shadow's slices, and every frame fed before that and still queued behind the
limiter loaded all of them again (a whole SmolLM2 shadow, ~1 s of CPU each) for a round
nobody checks, which the next round's release dropped again: a third of the gateway's CPU
at 16 streams for seconds after probation ended. Sound: a frame queued before a release
runs nothing and loads nothing; a frame fed after it loads and computes as before.
"""

from __future__ import annotations

import torch
import trio
import trio.testing

from coordinator.swarm.formation import RingState
from coordinator.trust.shadow import Shadow
from ring import PeerId
from shard.layers import LayerRange
from shard.wire.messages import Assignment, Forward, Result


def _ring(store) -> RingState:
    r = LayerRange(0, store.num_layers)
    a = Assignment(epoch=1, peer_id="p1", role="stage", layer_start=r.start, layer_end=r.end, predecessor=None,
                   successor=None, model="tiny", manifest_digest=store.digest, wire_dtype="f32")
    return RingState(epoch=1, stages=((PeerId("p1"), r),), assignments=(a,))


def _prefill(job: str, ids: list[int]) -> Forward:
    return Forward(job_id=job, epoch=1, round=1, nonce=bytes(16), phase="prefill", ctx_len=0,
                   positions=torch.arange(len(ids)), tokens=torch.tensor(ids))


def _result(job: str) -> Result:
    return Result(job_id=job, epoch=1, round=1, hidden=torch.zeros(1, 1))


def test_a_frame_queued_before_a_release_loads_nothing(tiny_llama_store):
    shadow, ring = Shadow(tiny_llama_store), _ring(tiny_llama_store)

    async def main():
        await shadow.feed(ring, _prefill("a", [5, 9, 7]), {})
        assert shadow.loaded
        async with trio.open_nursery() as nursery:
            async with shadow._limiter:  # a frame of the shadow's is mid-compute
                nursery.start_soon(shadow.feed, ring, _prefill("b", [4, 2]), {})
                await trio.testing.wait_all_tasks_blocked()
                shadow.release()  # meanwhile the ring's probation ended
        assert not shadow.loaded  # "b" ran nothing and loaded nothing
        assert shadow.check(ring, _result("b"), {}) is None
        await shadow.feed(ring, _prefill("c", [3, 1]), {})  # fed after the release: loads and computes
        assert shadow.loaded
        spot = shadow.check(ring, _result("c"), {})
        assert spot is not None and not spot.passed  # compared: zeros are not the states

    trio.run(main)
