"""Serving weight files to peers: the `/shard/weights/1.0.0` stream handler.

A fetcher asks for a byte range of one weight file of the manifest (WeightsRequest); the
server answers with the range in WeightsChunks of at most `chunk_bytes`, in order, or one
WeightsRefused. It serves only files of its own manifest that it holds and has verified
against the manifest's sha256 (hashed once per process, shard.store.verify_file), and
only as fast as its token bucket allows: a bounded share of its upload, shared by every
stream it serves. Requests are checked before any file is touched (shard.weight_plan).
Knows nothing of the ring, of who asked for what before, or of fetching.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
from collections.abc import AsyncIterator, Callable
from typing import AsyncContextManager

import trio

from shard.errors import StoreError, StreamClosedError, WireError
from shard.manifest import Manifest
from shard.store import verify_file
from shard.transport import FramedStream
from shard.weight_plan import TokenBucket, WeightsConfig, check_request
from shard.wire.codec import decode, encode
from shard.wire.weight_messages import WEIGHTS_LIMITS, WeightsChunk, WeightsRefused, WeightsRequest

log = logging.getLogger("shard.weights")

WEIGHTS_PROTOCOL = "/shard/weights/1.0.0"


@contextlib.asynccontextmanager
async def _plain_link(stream: FramedStream) -> AsyncIterator[FramedStream]:
    try:
        yield stream
    finally:
        await stream.aclose()


class WeightServer:
    """Serves `root`'s weight files of `manifest`. `open_link(stream)` puts what this end
    sends behind the node's (emulated) uplink for the block and closes the stream after
    (shard.node_links.NodeLinks.open_link); default: the stream as it is."""

    def __init__(self, root: pathlib.Path, manifest: Manifest, config: WeightsConfig, *,
                 upload_bytes_per_s: float = float("inf"),
                 open_link: Callable[[FramedStream], AsyncContextManager] = _plain_link) -> None:
        self.root, self.manifest, self.config, self.open_link = pathlib.Path(root), manifest, config, open_link
        self.bucket = TokenBucket(float("inf"), config.chunk_bytes)
        self.set_upload(upload_bytes_per_s)
        self._streams = trio.CapacityLimiter(config.max_serve_streams)
        self.served_bytes = 0

    def set_upload(self, upload_bytes_per_s: float) -> None:
        """The uplink (bytes/s) the share is taken of: the node's measured upload."""
        rate = upload_bytes_per_s * self.config.seed_upload_share
        self.bucket = TokenBucket(rate if rate > 0 else 0.0, max(self.config.chunk_bytes, rate * 0.25))

    async def serve(self, stream: FramedStream) -> None:
        """Answer one fetcher's requests on `stream` until it closes it. Error handling: a
        malformed or unservable request is answered with WeightsRefused and ends the stream;
        the peer leaving ends it quietly. Resource handling: the stream is closed on return."""
        try:
            self._streams.acquire_nowait()
        except trio.WouldBlock:
            async with self.open_link(stream) as out:
                await out.send_frame(encode(WeightsRefused(code="busy", reason=(
                    f"serving {self.config.max_serve_streams} fetchers already; try another source"))))
            return
        try:
            async with self.open_link(stream) as out:
                while await self._serve_request(stream, out):
                    pass
        finally:
            self._streams.release()

    async def _serve_request(self, stream: FramedStream, out) -> bool:
        """Serve one request; False when the stream is done (closed, refused)."""
        try:
            msg = decode(await stream.recv_frame(WEIGHTS_LIMITS.max_frame_bytes), WEIGHTS_LIMITS)
        except StreamClosedError:
            return False
        except WireError as exc:
            return await self._refuse(out, "bad_request", f"malformed request: {exc}")
        if not isinstance(msg, WeightsRequest):
            return await self._refuse(out, "bad_request", f"expected a weights_request, got {msg.KIND}")
        problem = check_request(self.manifest, msg)
        if problem is not None:
            return await self._refuse(out, "bad_request", problem)
        if self.bucket.rate_bytes_per_s <= 0:
            return await self._refuse(out, "not_held", "this node serves no weights (seed_upload_share 0)")
        path = self.root / msg.file
        try:
            await trio.to_thread.run_sync(verify_file, path, self.manifest.files[msg.file], msg.file)
        except StoreError as exc:  # missing, partial or corrupt here: never served
            return await self._refuse(out, "not_held", f"{msg.file} is not held verified here ({exc})")
        with open(path, "rb") as f:
            offset, end = msg.offset, msg.offset + msg.length
            while offset < end:
                n = min(self.config.chunk_bytes, end - offset)
                await trio.sleep(self._delay_s(n))
                data = self._read(f, offset, n)
                if len(data) != n:  # the file shrank under us: stop, the fetcher goes elsewhere
                    return await self._refuse(out, "not_held", f"{msg.file} changed while being served")
                await out.send_frame(encode(WeightsChunk(offset=offset, data=data), WEIGHTS_LIMITS))
                offset += n
                self.served_bytes += n
        return True

    def _delay_s(self, nbytes: int) -> float:
        """How long to wait before sending `nbytes` (the token bucket, shared by all streams)."""
        return self.bucket.reserve(nbytes, trio.current_time())

    def _read(self, f, offset: int, n: int) -> bytes:
        f.seek(offset)
        return f.read(n)

    async def _refuse(self, out, code: str, reason: str) -> bool:
        log.info("refused a weights request (%s): %s", code, reason)
        await out.send_frame(encode(WeightsRefused(code=code, reason=reason[:512])))
        return False
