"""Wire messages for weights from peers: the signed manifest and sources (node <->
coordinator, `/shard/sources/1.0.0`) and byte ranges of weight files (node <-> node,
`/shard/weights/1.0.0`). Each stream carries its own Limits (below): a chunk frame is
never bigger than one chunk plus its header, so a hostile seeder cannot make a fetcher
buffer more. Pure data, like shard.wire.messages (which registers these kinds); knows
nothing of files, digests or who holds what.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import ClassVar

from shard.wire.fields import Bytes, Float, Int, ListOf, MapOf, Str, spec
from shard.wire.limits import Limits

_MiB = 1 << 20
# The most file bytes one WeightsChunk carries. 1 MiB: large enough that per-frame costs
# (msgpack, Noise, yamux) stay under 1% of a chunk, small enough that a fetcher buffers
# little and a token bucket paces a stream smoothly.
MAX_CHUNK_BYTES = 1 * _MiB
# The most bytes one WeightsRequest asks for; a fetcher asks again for the rest of a file.
MAX_REQUEST_BYTES = 64 * _MiB
# A manifest lists every tensor of every file: a 128-expert MoE with 48 layers is ~2 MB.
MAX_MANIFEST_BYTES = 16 * _MiB
MAX_SOURCES_PER_FILE = 32
FILE_NAME = Str(128)  # a manifest relpath ("layers/00012.safetensors")
PEER = Str(128)  # a libp2p peer id, as shard.wire.messages.PEER_ID
ADDR = Str(256)  # a multiaddr, as shard.wire.messages.NAME
DIGEST = Str(64)  # a sha256 hex digest

# Bounds of each stream's frames: the weights stream's are a chunk and a little header;
# the sources stream's hold a manifest (16 MiB) or a sources map.
WEIGHTS_LIMITS = Limits(max_frame_bytes=MAX_CHUNK_BYTES + 64 * 1024, max_header_bytes=MAX_CHUNK_BYTES + 60 * 1024,
                        max_tensors=1, max_tensor_elements=1, max_list_len=16)
SOURCES_LIMITS = Limits(max_frame_bytes=MAX_MANIFEST_BYTES + _MiB, max_header_bytes=MAX_MANIFEST_BYTES + _MiB // 2,
                        max_tensors=1, max_tensor_elements=1, max_list_len=4096)
MANIFEST_SIGNING_DOMAIN = b"shard manifest v1\0"  # a manifest signature is never another message's


@dataclass(frozen=True, kw_only=True)
class ManifestRequest:
    """Node -> coordinator: the manifest of the model you serve, signed."""

    KIND: ClassVar[str] = "manifest_request"
    peer_id: str = spec(PEER)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class SignedManifest:
    """Coordinator -> node: the manifest's JSON bytes (shard.manifest.Manifest.to_json) and
    the coordinator's Ed25519 signature over MANIFEST_SIGNING_DOMAIN + sha256(manifest)."""

    KIND: ClassVar[str] = "signed_manifest"
    manifest: bytes = spec(Bytes(MAX_MANIFEST_BYTES, min_bytes=2))
    signature: bytes = spec(Bytes(64, min_bytes=64))

    def check(self, limits: Limits) -> None:
        pass

    def signing_bytes(self) -> bytes:
        return manifest_signing_bytes(self.manifest)


def manifest_signing_bytes(manifest: bytes) -> bytes:
    return MANIFEST_SIGNING_DOMAIN + hashlib.sha256(manifest).digest()


@dataclass(frozen=True, kw_only=True)
class SourcesRequest:
    """Node -> coordinator: who holds these files of the manifest `manifest_digest`,
    which the node will fetch for layers [layer_start, layer_end)."""

    KIND: ClassVar[str] = "sources_request"
    manifest_digest: str = spec(DIGEST)
    layer_start: int = spec(Int())
    layer_end: int = spec(Int())
    files: tuple[str, ...] = spec(ListOf(FILE_NAME, max_items=4096))

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class Sources:
    """Coordinator -> node: for each file asked for, the peers that hold it (best uplink
    first; the coordinator itself only where no node does), where to dial each, and each
    one's measured upload."""

    KIND: ClassVar[str] = "sources"
    holders: dict[str, tuple[str, ...]] = spec(MapOf(FILE_NAME, ListOf(PEER, max_items=MAX_SOURCES_PER_FILE)))
    addrs: dict[str, tuple[str, ...]] = spec(MapOf(PEER, ListOf(ADDR, max_items=16)))
    upload_bytes_per_s: dict[str, float] = spec(MapOf(PEER, Float()))

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class FetchReport:
    """Node -> coordinator: a fetch for layers [layer_start, layer_end) ended: the bytes it
    moved, how long it took, the bytes each source served, the sources it excluded, and
    `error` when it could not finish (the coordinator then seats the ring without it)."""

    KIND: ClassVar[str] = "fetch_report"
    peer_id: str = spec(PEER)
    layer_start: int = spec(Int())
    layer_end: int = spec(Int())
    files: int = spec(Int())
    bytes: int = spec(Int())
    seconds: float = spec(Float())
    by_source: dict[str, int] = spec(MapOf(PEER, Int()))
    excluded: dict[str, str] = spec(MapOf(PEER, Str(256)))
    error: str = spec(Str(512), default="")  # why the fetch failed ("": it did not)

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class WeightsRequest:
    """Fetcher -> seeder: bytes [offset, offset + length) of a weight file of the manifest
    `manifest_digest`. Answered by WeightsChunks in order, or one WeightsRefused."""

    KIND: ClassVar[str] = "weights_request"
    manifest_digest: str = spec(DIGEST)
    file: str = spec(FILE_NAME)
    offset: int = spec(Int())
    length: int = spec(Int(1, MAX_REQUEST_BYTES))

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class WeightsChunk:
    """Seeder -> fetcher: `data` are the file's bytes from `offset`."""

    KIND: ClassVar[str] = "weights_chunk"
    offset: int = spec(Int())
    data: bytes = spec(Bytes(MAX_CHUNK_BYTES, min_bytes=1))

    def check(self, limits: Limits) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class WeightsRefused:
    """Seeder -> fetcher: the request is not served (`code`: not_held, bad_request, busy)."""

    KIND: ClassVar[str] = "weights_refused"
    code: str = spec(Str(32))
    reason: str = spec(Str(512))

    def check(self, limits: Limits) -> None:
        pass


WEIGHT_MESSAGES = (ManifestRequest, SignedManifest, SourcesRequest, Sources, FetchReport, WeightsRequest, WeightsChunk,
                   WeightsRefused)
