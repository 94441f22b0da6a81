"""More attacks for scripts/bench_hostile_ring.py against the live ring (issue 20): kept
apart so that script stays within its line budget.

coordinator_flood: N libp2p connections to the coordinator, each opened and closed before
the next (py-libp2p alone kept a slot per closed connection and refused every inbound one
past 250, so a flood of 246 once blocked every later `shard-node join`); then a fresh
identity must still connect (the coordinator serves no probe protocol: the attack list's
node joining afterwards shows it still admits nodes).

window_abuse: strangers push raw yamux DATA past a stage's receive window on every protocol
it serves them (py-libp2p 0.8.1 only logged that and kept buffering: 600 MB once).
replayed_assignment: a stage's old, validly signed Assignment, and another stage's, sent
on the coordinator's own control streams (a replay injected in transit).
"""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import trio
from libp2p.peer.id import ID

from shard.errors import TransportError
from shard.identity import keypair_from_seed
from shard.transport import open_host
from shard.wire.limits import FRAME_PREFIX


async def flood(addr: str, peer: str, connections: int) -> tuple[int, float]:
    """Open and close `connections` connections to `peer` at `addr` one at a time, from one
    fresh identity: (connections accepted, seconds). Also bench_hostile's node flood."""
    accepted, t0 = 0, time.perf_counter()
    async with open_host(keypair_from_seed(os.urandom(32))) as flooder:
        for _ in range(connections):
            try:
                with trio.fail_after(10):
                    await flooder.connect(addr)
                accepted += 1
            except (TransportError, trio.TooSlowError):
                pass
            await flooder._host.disconnect(ID.from_base58(peer))
    return accepted, time.perf_counter() - t0


async def coordinator_flood(addr: str, connections: int) -> dict:
    """The flood against the coordinator at `addr` (…/p2p/<id>), then a fresh identity connects."""
    accepted, flood_s = await flood(addr, addr.rsplit("/p2p/", 1)[1], connections)
    async with open_host(keypair_from_seed(os.urandom(32))) as newcomer:
        t1 = time.perf_counter()
        with trio.fail_after(30):
            await newcomer.connect(addr)
        connect_s = time.perf_counter() - t1
    return {"connections": connections, "accepted": accepted, "flood_s": round(flood_s, 1),
            "newcomer_connected_in_ms": round(connect_s * 1e3, 1)}


# -- HTTP (the bench's http attack) -------------------------------------------------
async def http(port: int, raw: bytes, *, read: bool = True, timeout_s: float = 60.0) -> tuple[int | None, float]:
    """Send `raw` on a fresh connection; (the response's status or None if the server
    closed it first, seconds until then)."""
    t0 = time.perf_counter()
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    data = b""
    with trio.move_on_after(timeout_s):
        try:
            await stream.send_all(raw)
            while read and b"\r\n" not in data:
                chunk = await stream.receive_some(65536)
                if not chunk:
                    break
                data += chunk
        except trio.BrokenResourceError:
            pass
    await stream.aclose()
    status = int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else None
    return status, time.perf_counter() - t0


def post_head(length: int | None = None, chunked: bool = False) -> bytes:
    lines = ["POST /v1/chat/completions HTTP/1.1", "Host: bench", "Content-Type: application/json"]
    lines += [f"Content-Length: {length}"] if length is not None else []
    lines += ["Transfer-Encoding: chunked"] if chunked else []
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


# -- window abuse -------------------------------------------------------------------
DATA_HEADER = struct.Struct("!BBHII")  # yamux: version, type (0 = DATA), flags, stream id, length
CHUNK_BYTES = 1 << 16  # one yamux DATA frame: a quarter of a fresh stream's window, so they fill it


def abuse_chunk(stream_id: int) -> bytes:
    """One raw yamux DATA frame for `stream_id` holding one 4-byte-length-prefixed b"P"
    frame: a probe ping, which a probe server echoes (its echoes unread, it blocks on its
    send window and stops reading: the worst case for its buffer); a ring or weights
    server refuses it."""
    ping = FRAME_PREFIX.pack(CHUNK_BYTES - FRAME_PREFIX.size) + b"P" + bytes(CHUNK_BYTES - FRAME_PREFIX.size - 1)
    return DATA_HEADER.pack(0, 0, 0, stream_id, CHUNK_BYTES) + ping


async def push_past_window(attacker, peer: str, protocol: str, total_bytes: int, linger_s: float) -> dict:
    """Open a `protocol` stream to `peer` and write `total_bytes` as raw yamux DATA frames,
    past any window granted (no wait for WINDOW_UPDATE), until the node resets or closes it;
    then wait up to `linger_s` for a reset or close in flight. Bytes written, seconds until
    the node cut the stream (None: it held it), how."""
    t0 = time.perf_counter()
    try:
        stream = await attacker.open_stream(peer, protocol)
    except TransportError:  # reset before the attacker had read the node's protocol agreement
        return {"written_bytes": 0, "cut_after_s": round(time.perf_counter() - t0, 3), "how": "reset while opening"}
    muxed_stream = stream._stream.muxed_stream
    muxed, chunk = muxed_stream.conn, abuse_chunk(muxed_stream.stream_id)
    cut = lambda: muxed_stream.reset_received or muxed_stream.recv_closed  # noqa: E731
    written = 0
    while written < total_bytes and not cut():
        async with muxed._write_lock:  # a raw write between the muxer's own would garble its Noise stream
            await muxed.secured_conn.write(chunk)
        written += CHUNK_BYTES
    with trio.move_on_after(linger_s):
        while not cut():
            await trio.sleep(0.05)
    how = "reset" if muxed_stream.reset_received else "closed" if muxed_stream.recv_closed else "held open"
    return {"written_bytes": written, "cut_after_s": round(time.perf_counter() - t0, 3) if cut() else None, "how": how}


async def window_abuse(addr: str, peer: str, rss_mb: Callable[[], float], log_bytes: Callable[[], int], *,
                       protocols: tuple[str, ...], streams: int, bytes_per_stream: int, linger_s: float,
                       settle_s: float) -> dict:
    """Per protocol: `streams` streams to `peer` at `addr`, each from a fresh identity, all
    at once, each pushed `bytes_per_stream` past its window; the node's RSS before, while
    the attackers still hold their connections (after the push and `linger_s`), and
    `settle_s` after they left; its log's growth."""
    facts: dict = {}
    for protocol in protocols:
        before, log_before, results = rss_mb(), log_bytes(), []
        async with AsyncExitStack() as hosts:
            attackers = [await hosts.enter_async_context(open_host(keypair_from_seed(os.urandom(32)))) for _ in range(streams)]
            for a in attackers:
                await a.connect(addr)
            async with trio.open_nursery() as nursery:
                for a in attackers:
                    nursery.start_soon(_collect, results, push_past_window(a, peer, protocol, bytes_per_stream, linger_s))
            held = rss_mb()
        await trio.sleep(settle_s)
        facts[protocol] = {"streams": results, "node_rss_mb_before": round(before, 1),
                           "node_rss_mb_while_held": round(held, 1), "node_rss_mb_settled": round(rss_mb(), 1),
                           "node_log_bytes_added": log_bytes() - log_before}
    return {"bytes_per_stream": bytes_per_stream, "streams_per_protocol": streams, "identities": "one fresh per stream",
            "linger_s": linger_s, "settle_s": settle_s, "protocols": facts}


async def _collect(results: list, push) -> None:
    results.append(await push)


# -- replayed assignment --------------------------------------------------------------
async def replayed_assignment(swarm, bump_epoch: Callable[[], Awaitable[None]], settle_s: float = 30.0) -> dict:
    """Keep every stage's signed Assignment of the ring now (epoch e), `bump_epoch()` (the
    ring re-forms, same stages, a newer epoch), then over the coordinator's own control
    streams send each stage its epoch-e assignment (a replay) and its successor's current
    one (misaddressed), then each its current one again, which a node acknowledges with
    Ready. Sound: a node reads its control stream in order, so once every stage has
    acknowledged, a replay it had taken would have answered Ready first; so refused =
    exactly one Ready per stage, the ring's epoch and the slices held unchanged."""
    stages = [p for p, _ in swarm.ring.stages]
    old, old_epoch = {p: swarm.members[p].assignment for p in stages}, swarm.ring.epoch
    await bump_epoch()
    ring = swarm.ring
    if {p for p, _ in ring.stages} != set(stages) or ring.epoch <= old_epoch:
        raise RuntimeError(f"the ring re-formed at epoch {ring.epoch} on {[p[-6:] for p, _ in ring.stages]}, "
                           f"not on the same stages after epoch {old_epoch}")
    current, held = {p: swarm.members[p].assignment for p in stages}, dict(swarm.held)
    readies: list[tuple[str, int]] = []
    on_ready = swarm._on_ready
    swarm._on_ready = lambda peer, msg: (readies.append((peer, msg.epoch)), on_ready(peer, msg))
    try:
        for i, p in enumerate(stages):
            await swarm.send_control(p, old[p])  # a replay of its own, older epoch
            await swarm.send_control(stages[(i + 1) % len(stages)], current[p])  # another node's, this epoch
        for p in stages:
            await swarm.send_control(p, current[p])
        with trio.move_on_after(settle_s):
            while {p for p, _ in readies} != set(stages):
                await trio.sleep(0.1)
    finally:
        swarm._on_ready = on_ready
    return {"epoch_replayed": old_epoch, "epoch_now": ring.epoch, "replays_sent": len(stages), "misaddressed_sent": len(stages),
            "readies": [[p[-6:], e] for p, e in readies],
            "refused": sorted(p for p, _ in readies) == sorted(stages) and all(e == ring.epoch for _, e in readies),
            "ring_epoch_unchanged": swarm.ring is not None and swarm.ring.epoch == ring.epoch,
            "slices_held_unchanged": dict(swarm.held) == held}


async def middle_stage_window_abuse(swarm, nodes, streams: int, bytes_per_stream: int) -> dict:
    """window_abuse against the live ring's second stage (`nodes`: the bench's Nodes) on the
    protocols a stranger reaches: ring (refused: not its predecessor), probe, weights."""
    from scripts.bench_hostile import rss_mb
    from shard.linkprobe import PROBE_PROTOCOL
    from shard.node import RING_PROTOCOL
    from shard.weight_server import WEIGHTS_PROTOCOL

    target = swarm.ring.stages[1][0]
    name = nodes.named()[target]
    pid, log = nodes.procs[name].pid, os.path.join(nodes.tmp, f"{name}.log")
    facts = await window_abuse(swarm.members[target].register.listen_addrs[0], target, lambda: rss_mb(pid),
                               lambda: os.path.getsize(log), protocols=(RING_PROTOCOL, PROBE_PROTOCOL, WEIGHTS_PROTOCOL),
                               streams=streams, bytes_per_stream=bytes_per_stream, linger_s=5.0, settle_s=10.0)
    return {"target_stage": f"{name} ({target[-6:]})", **facts}
