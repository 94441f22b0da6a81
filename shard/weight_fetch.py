"""Fetching weight files from peers: the signed manifest from the coordinator, a slice's
files from the nodes that hold them, several at once, chunked, resumable and checked.

`open_fetched_store` gives a node with no weights its store: the coordinator's manifest,
verified against the coordinator's key (its peer id), written as `manifest.json` into an
otherwise empty store dir. `ensure_slice` makes a slice's files present before the node
loads it: the files already there are hashed against the manifest (shard.store), the rest
are fetched. For those it asks the coordinator who holds them (`/shard/sources/1.0.0`),
fetches each file from one source at a time, several files in parallel from different
sources (rarest first, shard.weight_plan), appends the chunks to `<file>.part` (a partial
file resumes where it stopped, also after a restart), hashes them as they arrive and only
renames a file into place when its sha256 is the manifest's. A source that serves bytes
failing the digest, refuses, stalls or breaks the protocol is excluded and its file fetched
from another. Progress goes to the log with bytes/s and ETA; the coordinator gets a
FetchReport. Knows nothing of stages, the ring, or how sources were chosen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pathlib
import time
from dataclasses import dataclass, field

import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from shard.assignment_rules import public_key_of_peer
from shard.errors import ShardError, StoreError, StreamClosedError, TransportError, WireError
from shard.layers import LayerRange
from shard.manifest import MANIFEST_NAME, Manifest, slice_files
from shard.store import ModelStore, default_store_dir, mark_verified, verify_file
from shard.weight_plan import (WeightsConfig, check_chunk, choose_file, progress_line, request_deadline_s, requests,
                               resume_offset, unservable)
from shard.weight_server import WEIGHTS_PROTOCOL
from shard.wire.codec import decode, encode
from shard.wire.weight_messages import (SOURCES_LIMITS, WEIGHTS_LIMITS, FetchReport, ManifestRequest, SignedManifest,
                                        Sources, SourcesRequest, WeightsRefused, WeightsRequest)

log = logging.getLogger("shard.weights")

SOURCES_PROTOCOL = "/shard/sources/1.0.0"
PART_SUFFIX = ".part"
REPORT_ACK_S = 5.0  # how long a fetch report waits for the coordinator to record it


class FetchError(ShardError):
    """A slice could not be fetched. Fields: the file that could not be, and why."""

    def __init__(self, file: str, reason: str) -> None:
        self.file, self.reason = file, reason
        super().__init__(f"cannot fetch {file}: {reason}")


class SourceFailed(ShardError):
    """A source failed one file: it is excluded. `digest`: its bytes failed the sha256."""

    def __init__(self, source: str, reason: str, digest: bool = False) -> None:
        self.source, self.reason, self.digest = source, reason, digest
        super().__init__(f"source {source}: {reason}")


@dataclass
class FetchResult:
    files: int = 0  # files fetched (those already present verified are not counted)
    bytes: int = 0  # bytes received from sources this run (a resumed file's earlier part not included)
    seconds: float = 0.0
    by_source: dict[str, int] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)  # source -> why


# -- the coordinator's side: manifest, sources, report ----------------------------------
async def _ask(host, coordinator_id: str, msg) -> object:
    stream = await host.open_stream(coordinator_id, SOURCES_PROTOCOL)
    async with stream:
        await stream.send_frame(encode(msg))
        return decode(await stream.recv_frame(SOURCES_LIMITS.max_frame_bytes), SOURCES_LIMITS)


async def request_manifest(host, coordinator_id: str) -> Manifest:
    """The coordinator's manifest, its signature checked against `coordinator_id`'s key.
    Error handling: StoreError for an unsigned, mis-signed or inconsistent manifest."""
    reply = await _ask(host, coordinator_id, ManifestRequest(peer_id=host.peer_id))
    if not isinstance(reply, SignedManifest):
        raise StoreError(f"coordinator {coordinator_id} answered a manifest request with {type(reply).__name__}")
    try:
        Ed25519PublicKey.from_public_bytes(public_key_of_peer(coordinator_id)).verify(reply.signature,
                                                                                      reply.signing_bytes())
    except (InvalidSignature, ValueError) as exc:
        raise StoreError(f"the manifest from {coordinator_id} is not signed by it") from exc
    try:
        raw = json.loads(reply.manifest)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"the manifest from {coordinator_id} is not JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise StoreError(f"the manifest from {coordinator_id} is not a JSON object")
    return Manifest.from_dict(raw, where=f"the manifest from {coordinator_id}")


def install_manifest(manifest: Manifest, store_dir: str | os.PathLike[str] | None) -> ModelStore:
    """The store at `store_dir` (default: the cache's dir for the manifest's model) for
    `manifest`: the manifest written there unless it is already, weight files as they are.
    Error handling: StoreError when the dir holds another model's manifest."""
    root = pathlib.Path(store_dir) if store_dir is not None else default_store_dir(manifest.name)
    path = root / MANIFEST_NAME
    if path.exists():
        store = ModelStore.open(root)
        if store.digest != manifest.digest:
            raise StoreError(f"{root} holds model {store.manifest.name} (digest {store.digest[:12]}), not the "
                             f"coordinator's {manifest.name} (digest {manifest.digest[:12]}): pass another --store-dir")
        return store
    root.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(MANIFEST_NAME + PART_SUFFIX)
    tmp.write_text(manifest.to_json())
    tmp.replace(path)
    return ModelStore.open(root)


async def open_fetched_store(host, coordinator_addr: str, store_dir: str | os.PathLike[str] | None) -> ModelStore:
    """The store of a node that joins with no weights: the coordinator's signed manifest,
    installed (install_manifest); the weight files come later, slice by slice."""
    coordinator_id = await host.connect(coordinator_addr)
    manifest = await request_manifest(host, coordinator_id)
    store = await trio.to_thread.run_sync(install_manifest, manifest, store_dir)
    log.info("model %s (digest %s…) from the coordinator's signed manifest, store at %s", manifest.name,
             manifest.digest[:12], store.root)
    return store


async def request_sources(host, coordinator_id: str, manifest: Manifest, r: LayerRange, files: list[str]) -> Sources:
    reply = await _ask(host, coordinator_id, SourcesRequest(manifest_digest=manifest.digest, layer_start=r.start,
                                                            layer_end=r.end, files=files))
    if not isinstance(reply, Sources):
        raise FetchError(files[0], f"the coordinator answered a sources request with {type(reply).__name__}")
    return reply


async def report_fetch(host, coordinator_id: str, report: FetchReport) -> None:
    """Tell the coordinator how a fetch went (for /v1/ring); it closes the stream once it
    has recorded it, so the report is in before this node's Ready. Best effort: a failure
    is logged."""
    try:
        stream = await host.open_stream(coordinator_id, SOURCES_PROTOCOL)
        async with stream:
            await stream.send_frame(encode(report))
            with trio.move_on_after(REPORT_ACK_S):
                await stream.recv_frame(SOURCES_LIMITS.max_frame_bytes)  # returns only by the close
    except StreamClosedError:
        pass  # recorded
    except (TransportError, WireError) as exc:
        log.info("could not report a fetch to the coordinator: %s", exc)


# -- fetching -----------------------------------------------------------------------
def _present(root: pathlib.Path, manifest: Manifest, rel: str) -> bool:
    """Whether `rel` is in place and hashes to the manifest's sha256; a file that does not
    is removed (it would otherwise be served or loaded)."""
    try:
        verify_file(root / rel, manifest.files[rel], rel)
        return True
    except StoreError:
        (root / rel).unlink(missing_ok=True)
        return False


async def ensure_slice(host, coordinator_id: str, store: ModelStore, r: LayerRange, config: WeightsConfig
                       ) -> FetchResult | None:
    """Make layers `r`'s files present and verified in `store`, fetching what is missing from
    peers, and tell the coordinator how it went; None when nothing was missing. Error
    handling: FetchError when some file has no source left or cannot be written here (the
    coordinator is told first); TransportError when the coordinator cannot be asked."""
    files = list(slice_files(r))
    missing = [f for f in files if not await trio.to_thread.run_sync(_present, store.root, store.manifest, f)]
    if not missing:
        return None
    sources = await request_sources(host, coordinator_id, store.manifest, r, missing)
    fetch = _Fetch(host, store.root, store.manifest, sources, config, missing)
    try:
        result = await fetch.run(f"layers {r}")
    except FetchError as exc:  # told, so the coordinator re-forms without this node at once
        await report_fetch(host, coordinator_id, _report(host.peer_id, r, fetch.result, str(exc)))
        raise
    await report_fetch(host, coordinator_id, _report(host.peer_id, r, result, ""))
    return result


def _report(peer_id: str, r: LayerRange, result: FetchResult, error: str) -> FetchReport:
    return FetchReport(peer_id=peer_id, layer_start=r.start, layer_end=r.end, files=result.files, bytes=result.bytes,
                       seconds=result.seconds, by_source=result.by_source,
                       excluded={p: why[:256] for p, why in result.excluded.items()}, error=error[:512])


async def fetch_files(host, root: pathlib.Path, manifest: Manifest, files: list[str], sources: Sources,
                      config: WeightsConfig, *, what: str = "weights") -> FetchResult:
    """Fetch `files` of `manifest` into `root` from `sources`. Error handling: FetchError
    naming a file no source that is left holds. Resource handling: every stream is closed
    on return; partial files stay for the next attempt to resume."""
    fetch = _Fetch(host, pathlib.Path(root), manifest, sources, config, list(files))
    return await fetch.run(what)


class _Fetch:
    """One fetch's state: which files wait, which are being fetched, who is excluded."""

    def __init__(self, host, root: pathlib.Path, manifest: Manifest, sources: Sources, config: WeightsConfig,
                 files: list[str]) -> None:
        self.host, self.root, self.manifest, self.config = host, root, manifest, config
        self.holders = {f: tuple(p for p in sources.holders.get(f, ()) if p != host.peer_id) for f in files}
        self.addrs = sources.addrs
        self.pending, self.busy = list(files), set()
        self.result = FetchResult()
        self.total = sum(manifest.files[f].bytes for f in files)
        self.done = 0  # bytes in place or in partial files, of `total`
        self.limiter = trio.CapacityLimiter(config.max_sources)
        self._changed = trio.Event()
        self.failed: FetchError | None = None  # a failure that is not a source's (this disk's)
        self.workers: trio.Nursery | None = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def run(self, what: str) -> FetchResult:
        start = time.monotonic()
        for f in self.pending:
            self.done += min(_part_bytes(self.root, f), self.manifest.files[f].bytes)
        peers = sorted({p for hs in self.holders.values() for p in hs})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._log_progress, what, start)
            async with trio.open_nursery() as self.workers:
                for peer in peers:
                    self.workers.start_soon(self._work, peer)
            nursery.cancel_scope.cancel()
        self.result.seconds = time.monotonic() - start
        if self.failed is not None:
            raise self.failed
        stuck = unservable(self.pending, self.holders, set(self.result.excluded))
        if stuck is not None or self.pending:
            why = "; ".join(f"{p[-8:]}: {r}" for p, r in self.result.excluded.items()) or "no node holds it"
            raise FetchError(stuck or self.pending[0], f"no source left ({why})")
        s = self.result.seconds
        log.info("fetched %s: %d files, %.1f MB in %.1f s (%.2f MB/s) from %d sources%s", what, self.result.files,
                 self.result.bytes / 1e6, s, self.result.bytes / 1e6 / s if s > 0 else 0.0, len(self.result.by_source),
                 f", excluded {sorted(self.result.excluded)}" if self.result.excluded else "")
        return self.result

    async def _log_progress(self, what: str, start: float) -> None:
        while True:
            await trio.sleep(self.config.progress_interval_s)
            active = len(self.busy)
            log.info(progress_line(what, self.done, self.total, time.monotonic() - start, active))

    async def _work(self, peer: str) -> None:
        """Fetch files from `peer` one at a time until none is left for it."""
        stream = None
        try:
            while peer not in self.result.excluded:
                f = choose_file(self.pending, self.holders, self.busy, set(self.result.excluded), peer)
                if f is None:
                    if not any(peer in self.holders[p] for p in self.pending):
                        return  # nothing left it holds (busy files come back to pending if they fail)
                    await self._changed.wait()
                    continue
                self.busy.add(f)
                try:
                    async with self.limiter:
                        if stream is None:
                            stream = await self._open(peer)
                        placed = await self._fetch_file(stream, peer, f)
                    if placed:
                        self.pending.remove(f)
                        self.result.files += 1
                except SourceFailed as exc:
                    log.warning("excluding source %s for %s: %s", peer, f, exc.reason)
                    self.result.excluded[peer] = exc.reason
                except (TransportError, WireError) as exc:
                    log.warning("excluding source %s for %s: %s", peer, f, exc)
                    self.result.excluded[peer] = f"{type(exc).__name__}: {exc}"
                except OSError as exc:  # ours, not the source's: this disk cannot take the file; stop all
                    self.failed = FetchError(f, f"cannot write it under {self.root}: {exc}")
                    self.workers.cancel_scope.cancel()
                finally:
                    self.busy.discard(f)
                    self._notify()
        finally:
            if stream is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await stream.aclose()

    async def _open(self, peer: str):
        for addr in self.addrs.get(peer, ()):
            try:
                await self.host.connect(addr)
                break
            except TransportError as exc:
                log.info("could not dial source %s at %s: %s", peer, addr, exc)
        return await self.host.open_stream(peer, WEIGHTS_PROTOCOL)

    async def _fetch_file(self, stream, peer: str, rel: str) -> bool:
        """Fetch `rel` from `peer` into place (True), or find that a resumed partial file was
        bad and remove it (False: fetch it again). Raises SourceFailed (the peer's fault)."""
        entry, final = self.manifest.files[rel], self.root / rel
        part = final.with_name(final.name + PART_SUFFIX)
        part.parent.mkdir(parents=True, exist_ok=True)
        offset = resume_offset(_part_bytes(self.root, rel), entry.bytes)
        hasher = hashlib.sha256()
        if offset:
            await trio.to_thread.run_sync(_hash_prefix, part, offset, hasher)
            log.info("resuming %s at %d of %d bytes", rel, offset, entry.bytes)
        with open(part, "r+b" if offset else "wb") as out:
            out.seek(offset)
            out.truncate()
            for start, length in requests(offset, entry.bytes, self.config.request_bytes):
                await stream.send_frame(encode(WeightsRequest(manifest_digest=self.manifest.digest, file=rel,
                                                              offset=start, length=length)))
                at, end = start, start + length
                asked = trio.current_time()
                deadline = asked + request_deadline_s(length, self.config)
                while at < end:
                    with trio.move_on_at(min(deadline, trio.current_time() + self.config.chunk_timeout_s)) as timer:
                        body = await stream.recv_frame(WEIGHTS_LIMITS.max_frame_bytes)
                    if timer.cancelled_caught:
                        raise SourceFailed(peer, f"sent {at - start} of {length} bytes of {rel} in "
                                                 f"{trio.current_time() - asked:.0f} s (no chunk for "
                                                 f"{self.config.chunk_timeout_s:.0f} s, or slower than "
                                                 f"{self.config.min_source_bytes_per_s / 1e3:.0f} kB/s)")
                    msg = decode(body, WEIGHTS_LIMITS)
                    if isinstance(msg, WeightsRefused):
                        raise SourceFailed(peer, f"refused {rel} ({msg.code}): {msg.reason}")
                    problem = check_chunk(msg, at, end)
                    if problem is not None:
                        raise SourceFailed(peer, f"{rel}: {problem}")
                    out.write(msg.data)
                    hasher.update(msg.data)
                    n = len(msg.data)
                    at += n
                    self.done += n
                    self.result.bytes += n
                    self.result.by_source[peer] = self.result.by_source.get(peer, 0) + n
        if hasher.hexdigest() != entry.sha256:
            part.unlink(missing_ok=True)
            self.done -= entry.bytes
            if offset:  # the prefix came from an earlier attempt, maybe another source: start over, blame no one
                log.warning("%s resumed at %d failed its sha256: fetching it again from the start", rel, offset)
                return False
            raise SourceFailed(peer, f"served bytes of {rel} that fail the manifest's sha256", digest=True)
        part.replace(final)
        mark_verified(final, entry.sha256)
        return True


def _part_bytes(root: pathlib.Path, rel: str) -> int:
    try:
        return (root / (rel + PART_SUFFIX)).stat().st_size
    except OSError:
        return 0


def _hash_prefix(path: pathlib.Path, n: int, hasher) -> None:
    with open(path, "rb") as f:
        while n > 0:
            block = f.read(min(n, 1 << 20))
            if not block:
                break
            hasher.update(block)
            n -= len(block)
