"""An in-process frame pipe with the same bounds and errors as a libp2p FramedStream.

For tests and single-process simulations of a ring without sockets. Knows nothing of
peers' identities (a pair's ends are told whose they are) or of what frames hold.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import trio

from shard.errors import StreamClosedError
from shard.wire.limits import FRAME_PREFIX
from shard.transport import MAX_FRAME_BYTES_LIMIT, check_frame_length


class MemoryFramedStream:
    """One end of an in-process frame pipe with the same bounds and errors as FramedStream.

    For tests and single-process simulations of a ring without sockets; `remote_peer_id`
    is whatever the pair was told, not authenticated.
    """

    def __init__(self, remote_peer_id: str, send: trio.MemorySendChannel[bytes], recv: trio.MemoryReceiveChannel[bytes]) -> None:
        self._remote_peer_id, self._send, self._recv = remote_peer_id, send, recv

    @property
    def remote_peer_id(self) -> str:
        return self._remote_peer_id

    async def send_frame(self, body: bytes) -> None:
        check_frame_length(len(body), MAX_FRAME_BYTES_LIMIT)
        try:
            await self._send.send(bytes(body))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamClosedError(self._remote_peer_id, "closed", 0, 0) from exc

    async def send_frames(self, bodies: Sequence[bytes]) -> None:
        for body in bodies:
            await self.send_frame(body)

    async def recv_frame(self, max_frame_bytes: int) -> bytes:
        try:
            body = await self._recv.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError) as exc:
            raise StreamClosedError(self._remote_peer_id, "closed", 0, FRAME_PREFIX.size) from exc
        check_frame_length(len(body), max_frame_bytes)
        return body

    async def aclose(self) -> None:
        await self._send.aclose()


def memory_stream_pair(
    peer_id_a: str, peer_id_b: str, buffer_frames: float = math.inf
) -> tuple[MemoryFramedStream, MemoryFramedStream]:
    """Two connected ends: what end a (peer a) sends, end b receives, and back."""
    a_to_b_send, a_to_b_recv = trio.open_memory_channel[bytes](buffer_frames)
    b_to_a_send, b_to_a_recv = trio.open_memory_channel[bytes](buffer_frames)
    end_a = MemoryFramedStream(peer_id_b, a_to_b_send, b_to_a_recv)
    end_b = MemoryFramedStream(peer_id_a, b_to_a_send, a_to_b_recv)
    return end_a, end_b
