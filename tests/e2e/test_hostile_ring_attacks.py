"""The attacks scripts/bench_hostile_ring.py adds for issue 20 (scripts/hostile_ring_attacks.py),
checked on their own before a bench run depends on them.

Bug guarded: the bench's --attacks list and its table drifting (a name the parser refuses,
or one it accepts that the run then cannot find), and a window-abuse attacker that stops at
its window (then it abuses nothing) or that misreads a cut stream as held open.
"""

from __future__ import annotations

import os
import struct

import pytest
import trio

from scripts.bench_hostile_ring import parse_args
from scripts.hostile_ring_attacks import CHUNK_BYTES, abuse_chunk, window_abuse
from shard.identity import keypair_from_seed
from shard.transport import open_host
from libp2p.stream_muxer.yamux.yamux import DEFAULT_WINDOW_SIZE

NEW = "frames_warmup,window_abuse,replayed_assignment,new_node_joins_afterwards"


def test_the_bench_accepts_the_new_attacks_and_refuses_unknown_ones(capsys):
    assert parse_args(["--json", "out.json", "--attacks", NEW]).attacks == NEW
    assert "window_abuse,replayed_assignment" in parse_args(["--json", "out.json"]).attacks  # in the default run too
    with pytest.raises(SystemExit):
        parse_args(["--json", "out.json", "--attacks", "window_abuse,replay"])
    assert "--attacks: unknown ['replay']" in capsys.readouterr().err


def test_an_abuse_chunk_is_one_data_frame_holding_one_probe_ping():
    chunk = abuse_chunk(7)
    assert struct.unpack("!BBHII", chunk[:12]) == (0, 0, 0, 7, CHUNK_BYTES) and len(chunk) == 12 + CHUNK_BYTES
    assert chunk[12:17] == struct.pack(">I", CHUNK_BYTES - 4) + b"P" and not any(chunk[17:])
    assert DEFAULT_WINDOW_SIZE % CHUNK_BYTES == 0  # whole chunks fill a fresh window


def test_the_attacker_writes_past_the_window_and_sees_a_reset_as_one():
    # Sound: a handler that never reads holds the stream, so every byte asked for is written
    # (48 MiB, three times the largest window) and the server's buffer for it stays within
    # the window it granted, measured while the attacker still holds the connection; a
    # handler that resets at once costs the attacker its stream before its first MiB is
    # through, and is reported as a reset.
    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as server:
            server.set_handler("/sink/1", lambda stream: trio.sleep_forever())

            async def refuse(stream):
                await stream.reset()

            server.set_handler("/refuse/1", refuse)

            def buffered_mb() -> float:
                conns = [c for cs in server._host.get_network().connections.values() for c in cs]
                return max((len(b) for c in conns for b in c.muxed_conn.stream_buffers.values()), default=0) / 2**20

            with trio.fail_after(60):
                return await window_abuse(server.addrs[0], server.peer_id, buffered_mb, lambda: 0,
                                          protocols=("/sink/1", "/refuse/1"), streams=2, bytes_per_stream=48 << 20,
                                          linger_s=0.5, settle_s=0.0)

    facts = trio.run(main)["protocols"]
    sink, refused = facts["/sink/1"], facts["/refuse/1"]
    assert [s["written_bytes"] for s in sink["streams"]] == [48 << 20] * 2
    assert all(s["how"] == "held open" and s["cut_after_s"] is None for s in sink["streams"])
    assert 0 < sink["node_rss_mb_while_held"] <= DEFAULT_WINDOW_SIZE / 2**20
    assert all(s["how"] in ("reset", "reset while opening") and s["written_bytes"] < 48 << 20 for s in refused["streams"])
