"""What the Swarm reports on the channels it is given (coordinator/swarm/swarm.py)."""

from __future__ import annotations

import logging

import trio

from coordinator.swarm.formation import RingState
from coordinator.swarm.swarm import Swarm, SwarmConfig
from ring import PeerId
from shard.layers import LayerRange


def test_ring_changes_are_reported_and_a_full_or_closed_channel_drops_them(tiny_llama_store, caplog):
    # Bug guarded: formation blocking on (or crashing over) a listener that stopped reading,
    # which would stop every later ring. Sound: each report is checked where it went, and
    # the drops by their log lines.
    ring = RingState(3, ((PeerId("a"), LayerRange(0, 5)),), ())

    async def main():
        send, recv = trio.open_memory_channel(1)
        swarm = Swarm(tiny_llama_store, bytes(32), SwarmConfig(), ring_changes=send)
        swarm._set_ring(ring)
        swarm._set_ring(None)  # the channel is full: dropped, and formation goes on
        assert swarm.ring is None and recv.receive_nowait() == ring
        recv.close()
        swarm._set_ring(ring)  # nobody listens: dropped
        assert swarm.ring == ring and await swarm.wait_ring() == ring

    with caplog.at_level(logging.INFO, logger="shard.coordinator"):
        trio.run(main)
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("dropped")] == [
        "dropped a ring change: its channel is full", "dropped a ring change: nobody listens any more"]


def test_a_swarm_without_listeners_reports_to_nobody(tiny_llama_store):
    async def main():
        swarm = Swarm(tiny_llama_store, bytes(32), SwarmConfig())
        swarm._set_ring(RingState(1, ((PeerId("a"), LayerRange(0, 5)),), ()))
        return swarm.ring.epoch

    assert trio.run(main) == 1
