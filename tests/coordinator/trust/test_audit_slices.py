"""The auditor hands back the slices it loaded for replays once audits stop (issue 20).

Bug guarded: a gateway that recomputed one audit itself kept the slice loaded for good
(140 MB for a 10-layer SmolLM2 slice in f32; bench_hostile_ring read it as growth under
attack). Sound: on trio's mock clock, the slice is still held just before
AuditConfig.slice_idle_s with no audit and gone just after; the auditor still audits
(wait_idle returns) afterwards.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import trio
import trio.testing

from coordinator.trust.audit import AuditConfig, Auditor
from shard.layers import LayerRange


def test_replay_slices_are_released_after_the_idle_time(tiny_llama_store):
    async def main():
        _, finished = trio.open_memory_channel(1)
        _, replies = trio.open_memory_channel(0)
        sent = []

        async def send_control(peer, msg):  # no job finishes here, so nothing is released
            sent.append((peer, msg))

        auditor = Auditor(SimpleNamespace(send_control=send_control), tiny_llama_store, bytes(32), AuditConfig(slice_idle_s=60.0),
                          rng=random.Random(0), finished=finished, audit_replies=replies)
        await auditor.slices.get(LayerRange(0, 1))  # what a replay here loads
        held = []
        async with trio.open_nursery() as nursery:
            await nursery.start(auditor.serve)
            await trio.sleep(59.0)
            held.append(len(auditor.slices))
            await trio.sleep(2.0)
            held.append(len(auditor.slices))
            await auditor.wait_idle()
            nursery.cancel_scope.cancel()
        return held, sent

    assert trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0)) == ([1, 0], [])
