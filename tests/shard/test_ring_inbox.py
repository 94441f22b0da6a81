"""A stage's inbound ring edge (shard.ring_inbox) over real libp2p streams.

Bug guarded: an exception out of `serve_frame` (a bug in the node's handling of one
frame, or its control stream lost while answering it) reset the predecessor's whole ring
stream, so the other jobs' frames read ahead or still in flight on it were lost with it.
Sound: the predecessor is a real host on its own stream; the frame that raises is the
second of five and the fourth fails as a lost control stream would, and every other frame
must still be served, in order, from the same stream (a reset one delivers nothing after).
"""

from __future__ import annotations

import logging
import os

import trio

from shard.errors import DialError
from shard.identity import keypair_from_seed
from shard.ring_inbox import RingInbox
from shard.transport import open_host

PROTOCOL = "/shard/test-ring/1.0.0"


def test_a_frame_whose_serving_raises_costs_that_frame_alone(caplog):
    caplog.set_level(logging.WARNING, logger="shard.node")
    served: list[bytes] = []
    ended = trio.Event()

    async def serve_frame(peer: str, body: bytes) -> bool:
        if body == b"2":
            raise RuntimeError("a bug only frame 2 meets")
        if body == b"4":
            raise DialError("coordinator", "control stream lost")
        served.append(body)
        return True

    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as node, \
                open_host(keypair_from_seed(os.urandom(32))) as pred:
            inbox = RingInbox(lambda peer: peer == pred.peer_id, serve_frame, lambda: 1 << 10)

            async def serve(stream) -> None:
                try:
                    await inbox.serve(stream)
                finally:
                    ended.set()

            node.set_handler(PROTOCOL, serve)
            with trio.fail_after(20):
                await pred.connect(node.addrs[0])
                stream = await pred.open_stream(node.peer_id, PROTOCOL)
                for body in (b"1", b"2", b"3", b"4", b"5"):
                    await stream.send_frame(body)
                await stream.aclose()
                await ended.wait()
        return pred.peer_id

    pred_id = trio.run(main)
    assert served == [b"1", b"3", b"5"]
    messages = [r.getMessage() for r in caplog.records if r.name == "shard.node"]
    assert messages == [f"dropped a frame from {pred_id}: serving it raised RuntimeError: a bug only frame 2 meets",
                        f"dropped a frame from {pred_id}: serving it failed: cannot reach coordinator: control stream lost"]
