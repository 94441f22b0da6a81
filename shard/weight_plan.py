"""Weights from peers, the decisions: which byte ranges to ask for, where a partial file
resumes, which source fetches which file, how fast a seeder may send, and whether a
peer's request or chunk is one to accept. Pure: no files, no streams, no clocks read
(callers pass `now_s`). shard.weight_fetch and shard.weight_server do the I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

from shard.manifest import Manifest, is_weight_file
from shard.options import option
from shard.wire.weight_messages import MAX_CHUNK_BYTES, MAX_REQUEST_BYTES, WeightsChunk, WeightsRequest


@dataclass(frozen=True)
class WeightsConfig:
    """How a node fetches and serves weight files. The `option` fields are flags of
    `shard-node join`; the rest are code-only."""

    fetch_weights: bool = option(False, "join with no weights: take the model's manifest from the coordinator (signed "
                                        "by it) and fetch each assigned slice's files from the peers that hold them")
    # Half the measured uplink: a ring stage's own frames keep the other half (a prefill
    # chunk's activations are the burst that matters), so seeding at most doubles a stage's
    # send time while a newcomer still fetches at half the seeder's line rate; a seeder
    # off the ring loses nothing it needs. The selector predicts fetches with the same share.
    seed_upload_share: float = option(0.5, "share of this node's measured upload it may spend serving weight files "
                                           "to peers (0 serves none)")
    chunk_bytes: int = MAX_CHUNK_BYTES  # one WeightsChunk
    request_bytes: int = 16 << 20  # one WeightsRequest: a resumed stream re-asks at most this much
    max_sources: int = 8  # files fetched at once, one source each
    chunk_timeout_s: float = 60.0  # a source that sends no chunk for this long is dropped
    # A source slower than this over a whole request is dropped too (a peer trickling a byte
    # a minute would otherwise hold a file forever). 32 kB/s: a seeder on a 2 Mbit/s home
    # uplink serving its share to four fetchers at once still passes.
    min_source_bytes_per_s: float = 32e3
    progress_interval_s: float = 2.0  # a progress line at most this often
    max_serve_streams: int = 8  # fetchers this node serves at once; more are refused "busy"

    def __post_init__(self) -> None:
        if not 0.0 <= self.seed_upload_share <= 1.0:
            raise ValueError(f"seed_upload_share must be in [0, 1], got {self.seed_upload_share}")
        if not 1 <= self.chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(f"chunk_bytes must be in [1, {MAX_CHUNK_BYTES}], got {self.chunk_bytes}")
        if not self.chunk_bytes <= self.request_bytes <= MAX_REQUEST_BYTES:
            raise ValueError(f"request_bytes must be in [chunk_bytes, {MAX_REQUEST_BYTES}], got {self.request_bytes}")


def resume_offset(part_bytes: int, file_bytes: int) -> int:
    """Where a fetch of a `file_bytes` file resumes, given a partial file of `part_bytes`
    (a contiguous prefix: chunks are written in order). A partial file longer than the
    file is not a prefix of it: start over."""
    return part_bytes if 0 <= part_bytes <= file_bytes else 0


def request_deadline_s(length: int, config: WeightsConfig) -> float:
    """The most a source may take to serve a request of `length` bytes."""
    return config.chunk_timeout_s + length / config.min_source_bytes_per_s


def requests(offset: int, file_bytes: int, request_bytes: int) -> list[tuple[int, int]]:
    """(offset, length) of each request that fetches [offset, file_bytes), in order."""
    return [(o, min(request_bytes, file_bytes - o)) for o in range(offset, file_bytes, request_bytes)]


def choose_file(pending: Sequence[str], holders: Mapping[str, Sequence[str]], busy: Set[str], excluded: Set[str],
                source: str) -> str | None:
    """The next file `source` should fetch: one it holds that no other source is fetching,
    the rarest first (fewest sources not excluded; a file only this source holds must not
    wait behind files anyone could serve), ties in `pending` order. None: nothing for it."""
    best, best_key = None, None
    for i, f in enumerate(pending):
        if f in busy or source in excluded or source not in holders.get(f, ()):
            continue
        key = (sum(1 for p in holders[f] if p not in excluded), i)
        if best_key is None or key < best_key:
            best, best_key = f, key
    return best


def unservable(pending: Sequence[str], holders: Mapping[str, Sequence[str]], excluded: Set[str]) -> str | None:
    """A pending file no source that is not excluded holds (the fetch cannot finish), or None."""
    for f in pending:
        if all(p in excluded for p in holders.get(f, ())):
            return f
    return None


def check_request(manifest: Manifest, req: WeightsRequest) -> str | None:
    """Why a peer's request is malformed for this manifest (one line), or None."""
    if req.manifest_digest != manifest.digest:
        return f"manifest digest {req.manifest_digest[:12]} is not this node's model {manifest.digest[:12]}"
    entry = manifest.files.get(req.file)
    if entry is None or not is_weight_file(req.file):
        return f"{req.file!r} is not a weight file of the manifest"
    if req.offset + req.length > entry.bytes:
        return f"range [{req.offset}, {req.offset + req.length}) is past the end of {req.file} ({entry.bytes} bytes)"
    return None


def check_chunk(chunk: object, expected_offset: int, end: int) -> str | None:
    """Why a seeder's answer is not the next chunk of [expected_offset, end), or None."""
    if not isinstance(chunk, WeightsChunk):
        return f"sent {type(chunk).__name__} where a weights_chunk was due"
    if chunk.offset != expected_offset:
        return f"chunk at offset {chunk.offset}, expected {expected_offset}"
    if expected_offset + len(chunk.data) > end:
        return f"chunk of {len(chunk.data)} bytes runs past the requested end {end}"
    return None


@dataclass
class TokenBucket:
    """A seeder's upload budget: `rate_bytes_per_s` sustained, bursts up to
    `capacity_bytes`. `reserve` queues a send (FIFO, like an uplink) and says how long to
    wait before it; the debt it records is what later senders wait behind."""

    rate_bytes_per_s: float
    capacity_bytes: float
    _tokens: float = 0.0
    _at_s: float = -math.inf

    def reserve(self, nbytes: int, now_s: float) -> float:
        if math.isinf(self.rate_bytes_per_s):
            return 0.0
        if not self.rate_bytes_per_s > 0:
            raise ValueError("a bucket with rate 0 serves nothing")
        elapsed = now_s - self._at_s
        self._tokens = min(self.capacity_bytes, self._tokens + elapsed * self.rate_bytes_per_s) \
            if math.isfinite(elapsed) else self.capacity_bytes
        self._at_s = now_s
        self._tokens -= nbytes
        return max(0.0, -self._tokens / self.rate_bytes_per_s)


def progress_line(what: str, done_bytes: int, total_bytes: int, elapsed_s: float, sources: int) -> str:
    """'fetching <what>: 45.2 of 140.0 MB (32%), 11.3 MB/s, ETA 8 s, 2 sources'."""
    rate = done_bytes / elapsed_s if elapsed_s > 0 else 0.0
    left = max(0, total_bytes - done_bytes)
    eta = f"ETA {left / rate:.0f} s" if rate > 0 else "ETA ?"
    pct = 100.0 * done_bytes / total_bytes if total_bytes else 100.0
    return (f"fetching {what}: {done_bytes / 1e6:.1f} of {total_bytes / 1e6:.1f} MB ({pct:.0f}%), "
            f"{rate / 1e6:.2f} MB/s, {eta}, {sources} source{'s' if sources != 1 else ''}")
