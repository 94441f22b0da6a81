"""A node's probe server holds bounded resources for strangers (shard.node_links).

Bug guarded: any peer could open probe streams without bound and keep each forever (the
issue's red team buffered 600 MB on the probe protocol). Sound: a peer's third concurrent
probe stream is reset unread while its two others still echo, and a probe stream the
peer leaves open is closed by the node after twice probe_timeout_s (0.5 s here).
"""

from __future__ import annotations

import os

import pytest
import trio

from shard.identity import keypair_from_seed
from shard.linkprobe import PROBE_PROTOCOL, measure_rtt
from shard.node_links import MAX_PROBE_STREAMS_PER_PEER, NodeLinks
from shard.transport import TransportError, open_host


async def _no_control(msg) -> None:
    raise AssertionError("probes answer on their own stream, not the control stream")


def test_a_peer_holds_few_probe_streams_and_none_forever():
    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as node, \
                open_host(keypair_from_seed(os.urandom(32))) as peer:
            links = NodeLinks(node, _no_control, probe_timeout_s=0.5)
            node.set_handler(PROBE_PROTOCOL, links.on_probe_stream)
            with trio.fail_after(20):
                await peer.connect(node.addrs[0])
                kept = [await peer.open_stream(node.peer_id, PROBE_PROTOCOL) for _ in range(MAX_PROBE_STREAMS_PER_PEER)]
                for stream in kept:
                    assert (await measure_rtt(stream, 1)).min_s > 0
                with pytest.raises(TransportError):
                    extra = await peer.open_stream(node.peer_id, PROBE_PROTOCOL)
                    await measure_rtt(extra, 1)
                for stream in kept:  # left open by the peer: closed by the node within 1 s
                    with pytest.raises(TransportError):
                        await stream.recv_frame(1 << 10)

    trio.run(main)
