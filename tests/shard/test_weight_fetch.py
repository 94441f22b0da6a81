"""Fetching weight files from real seeders over libp2p (shard.weight_fetch, shard.weight_server).

Seeders are WeightServers on their own hosts serving the tiny model's prepared store; a
hostile one is the same server with its bytes flipped (a peer's code we do not control),
a dying one stops sending midway. Guards: a lying seeder's file used or kept (it must
fail the manifest's sha256, be excluded, and come from an honest seeder), a fetch that
dies midway starting over or keeping bad bytes (it must resume at the partial file's end
and end verified), a seeder serving a file it does not hold verified, and a malformed
request reaching the disk.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil

import pytest
import trio

from shard.errors import StoreError
from shard.identity import keypair_from_seed
from shard.layers import LayerRange
from shard.manifest import MANIFEST_NAME, slice_files
from shard.store import ModelStore, sha256_file
from shard.transport import open_host
from shard.weight_fetch import FetchError, fetch_files
from shard.weight_plan import WeightsConfig
from shard.weight_server import WEIGHTS_PROTOCOL, WeightServer
from shard.wire.codec import decode, encode
from shard.wire.weight_messages import WEIGHTS_LIMITS, Sources, WeightsChunk, WeightsRefused, WeightsRequest

SMALL_CHUNKS = WeightsConfig(chunk_bytes=16 << 10, request_bytes=64 << 10, progress_interval_s=0.05)


class LyingServer(WeightServer):
    """Serves every byte flipped: a seeder whose bytes fail the digest."""

    def _read(self, f, offset: int, n: int) -> bytes:
        return bytes(b ^ 0xFF for b in super()._read(f, offset, n))


class DyingServer(WeightServer):
    """Sends nothing more once it has sent `stop_after` bytes: a seeder that dies (or
    hangs) midway through a file."""

    stop_after = 48 << 10

    def _delay_s(self, nbytes: int) -> float:
        return math.inf if self.served_bytes >= self.stop_after else super()._delay_s(nbytes)


def empty_store(store: ModelStore, tmp_path) -> ModelStore:
    root = tmp_path / "empty"
    root.mkdir()
    shutil.copy(store.root / MANIFEST_NAME, root / MANIFEST_NAME)
    return ModelStore.open(root)


async def serve_seeders(nursery, servers: list[WeightServer]) -> list[tuple[str, list[str]]]:
    """A host per server, each serving WEIGHTS_PROTOCOL; their (peer id, addrs)."""
    out = []
    for server in servers:
        host = await nursery.start(_host_task)
        host.set_handler(WEIGHTS_PROTOCOL, server.serve)
        out.append((host.peer_id, host.addrs))
    return out


async def _host_task(task_status=trio.TASK_STATUS_IGNORED) -> None:
    async with open_host(keypair_from_seed(os.urandom(32))) as host:
        task_status.started(host)
        await trio.sleep_forever()


def sources_for(files, seeders) -> Sources:
    return Sources(holders={f: tuple(p for p, _ in seeders) for f in files}, addrs={p: tuple(a) for p, a in seeders},
                   upload_bytes_per_s={p: 1e9 for p, _ in seeders})


def test_a_lying_seeder_is_caught_by_the_digest_excluded_and_its_file_fetched_elsewhere(tiny_llama_store, tmp_path):
    store = tiny_llama_store
    target = empty_store(store, tmp_path)
    files = list(slice_files(LayerRange(0, 5)))

    async def main():
        async with trio.open_nursery() as nursery:
            liar = LyingServer(store.root, store.manifest, SMALL_CHUNKS)
            honest = WeightServer(store.root, store.manifest, SMALL_CHUNKS)
            seeders = await serve_seeders(nursery, [liar, honest])
            async with open_host(keypair_from_seed(os.urandom(32))) as host:
                result = await fetch_files(host, target.root, target.manifest, files, sources_for(files, seeders),
                                           SMALL_CHUNKS)
            nursery.cancel_scope.cancel()
        return result, seeders, liar

    result, seeders, liar = trio.run(main)
    liar_id, honest_id = seeders[0][0], seeders[1][0]
    assert liar.served_bytes > 0  # it did serve (and was caught), not merely never asked
    assert list(result.excluded) == [liar_id] and "sha256" in result.excluded[liar_id]
    for f in files:  # every file in place, with the manifest's digest, none from the liar
        assert sha256_file(target.root / f) == store.manifest.files[f].sha256
        assert not (target.root / (f + ".part")).exists()
    assert result.files == len(files)
    assert result.by_source[honest_id] == sum(store.manifest.files[f].bytes for f in files)


def test_a_fetch_that_dies_midway_resumes_at_the_partial_files_end(tiny_llama_store, tmp_path):
    # Bug guarded: a restarted fetch downloading the whole file again, or keeping the bytes
    # of a source that died. Sound: the second fetch receives exactly the bytes the first
    # did not, and the file ends with the manifest's digest.
    store = tiny_llama_store
    target = empty_store(store, tmp_path)
    rel = slice_files(LayerRange(1, 2))[0]
    size = store.manifest.files[rel].bytes
    assert size > 2 * DyingServer.stop_after  # the tiny layer spans several chunks

    async def fetch(server: WeightServer):
        """The fetch's result, or the FetchError it raised."""
        async with trio.open_nursery() as nursery:
            seeders = await serve_seeders(nursery, [server])
            try:
                async with open_host(keypair_from_seed(os.urandom(32))) as host:
                    try:
                        return await fetch_files(host, target.root, target.manifest, [rel],
                                                 sources_for([rel], seeders),
                                                 dataclasses.replace(SMALL_CHUNKS, chunk_timeout_s=0.5))
                    except FetchError as exc:
                        return exc
            finally:
                nursery.cancel_scope.cancel()

    failed = trio.run(fetch, DyingServer(store.root, store.manifest, SMALL_CHUNKS))
    assert isinstance(failed, FetchError) and "no source left" in str(failed)
    part = target.root / (rel + ".part")
    kept = part.stat().st_size
    assert kept == DyingServer.stop_after and not (target.root / rel).exists()
    result = trio.run(fetch, WeightServer(store.root, store.manifest, SMALL_CHUNKS))
    assert result.bytes == size - kept  # only the rest, not the file again
    assert sha256_file(target.root / rel) == store.manifest.files[rel].sha256 and not part.exists()


def test_a_seeder_serves_only_verified_files_and_refuses_bad_requests(tiny_llama_store, tmp_path):
    # Bug guarded: a node serving a file it lacks or holds corrupt, or reading past a file's
    # end for a hostile request. Sound: each case is answered by one WeightsRefused naming it.
    store = tiny_llama_store
    half = empty_store(store, tmp_path)
    rel = slice_files(LayerRange(2, 3))[0]
    corrupt = bytearray((store.root / rel).read_bytes())
    corrupt[100] ^= 1
    (half.root / rel).parent.mkdir(parents=True)
    (half.root / rel).write_bytes(bytes(corrupt))
    size = store.manifest.files[rel].bytes
    digest = store.manifest.digest

    async def ask(server, req) -> object:
        async with trio.open_nursery() as nursery:
            (peer, addrs), = await serve_seeders(nursery, [server])
            async with open_host(keypair_from_seed(os.urandom(32))) as host:
                await host.connect(addrs[0])
                stream = await host.open_stream(peer, WEIGHTS_PROTOCOL)
                await stream.send_frame(encode(req))
                reply = decode(await stream.recv_frame(WEIGHTS_LIMITS.max_frame_bytes), WEIGHTS_LIMITS)
                await stream.aclose()
            nursery.cancel_scope.cancel()
        return reply

    corrupt_server = WeightServer(half.root, half.manifest, SMALL_CHUNKS)
    honest = WeightServer(store.root, store.manifest, SMALL_CHUNKS)
    cases = [
        (corrupt_server, WeightsRequest(manifest_digest=digest, file=rel, offset=0, length=10), "not_held"),
        (corrupt_server, WeightsRequest(manifest_digest=digest, file=slice_files(LayerRange(3, 4))[0], offset=0,
                                        length=10), "not_held"),
        (honest, WeightsRequest(manifest_digest=digest, file=rel, offset=size - 5, length=10), "bad_request"),
        (honest, WeightsRequest(manifest_digest=digest, file="../../etc/passwd", offset=0, length=10), "bad_request"),
        (honest, WeightsRequest(manifest_digest=digest, file="tokenizer/tokenizer.json", offset=0, length=10),
         "bad_request"),
        (honest, WeightsRequest(manifest_digest="0" * 64, file=rel, offset=0, length=10), "bad_request"),
        (WeightServer(store.root, store.manifest, dataclasses.replace(SMALL_CHUNKS, seed_upload_share=0.0),
                      upload_bytes_per_s=1e6), WeightsRequest(manifest_digest=digest, file=rel, offset=0, length=10),
         "not_held"),  # --seed-upload-share 0: serves nothing
    ]
    for server, req, code in cases:
        reply = trio.run(ask, server, req)
        assert isinstance(reply, WeightsRefused) and reply.code == code, (req, reply)
    reply = trio.run(ask, honest, WeightsRequest(manifest_digest=digest, file=rel, offset=size - 5, length=5))
    assert isinstance(reply, WeightsChunk) and reply.data == (store.root / rel).read_bytes()[-5:]


def test_a_file_no_source_holds_fails_the_fetch_in_one_line(tiny_llama_store, tmp_path):
    target = empty_store(tiny_llama_store, tmp_path)
    rel = slice_files(LayerRange(4, 5))[0]

    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as host:
            try:
                await fetch_files(host, target.root, target.manifest, [rel],
                                  Sources(holders={rel: ()}, addrs={}, upload_bytes_per_s={}), SMALL_CHUNKS)
            except FetchError as exc:
                return exc

    assert str(trio.run(main)) == f"cannot fetch {rel}: no source left (no node holds it)"
    with pytest.raises(StoreError):
        ModelStore.open(target.root).load_layers(LayerRange(4, 5))


def test_a_disk_that_cannot_take_the_files_fails_the_fetch_in_one_line_blaming_no_source(tiny_llama_store, tmp_path):
    # Bug guarded: an OSError here escaping the fetch's task group as an ExceptionGroup (the
    # node's assignment handler catches ShardError: it would end the node's session), or a
    # source excluded for this machine's fault. Sound: `layers` is a file here, so no layer
    # file can be written; the error names the file and the cause.
    store = tiny_llama_store
    target = empty_store(store, tmp_path)
    (target.root / "layers").write_text("not a directory")
    rel = slice_files(LayerRange(1, 2))[0]

    async def main():
        async with trio.open_nursery() as nursery:
            seeders = await serve_seeders(nursery, [WeightServer(store.root, store.manifest, SMALL_CHUNKS)])
            try:
                async with open_host(keypair_from_seed(os.urandom(32))) as host:
                    try:
                        await fetch_files(host, target.root, target.manifest, [rel], sources_for([rel], seeders),
                                          SMALL_CHUNKS)
                    except FetchError as exc:
                        return exc
            finally:
                nursery.cancel_scope.cancel()

    failed = trio.run(main)
    assert isinstance(failed, FetchError) and failed.file == rel
    assert str(failed).startswith(f"cannot fetch {rel}: cannot write it under {target.root}: ")
