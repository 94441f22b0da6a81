"""Inbound connections of a py-libp2p 0.8.1 host: each releases its admission slot on close.

Upstream bug worked around here: the swarm admits an inbound connection by taking a slot
of `_inbound_limiter` (a trio.CapacityLimiter of max_connections - min_connections = 250
by default) and gives it back when the connection's handler returns; but after a
successful upgrade that handler waits for the whole swarm to finish
(`await self.manager.wait_finished()`), so every inbound connection ever accepted keeps
its slot for the host's life, and the 251st is refused however many have closed
(tests/shard/test_inbound_conns.py reproduces it with a cap of 3). `release_slots_on_close`
gives one swarm a handler that waits for that connection's own close instead. Open
connections stay bounded: the swarm still checks max_connections against the connections
it holds, and the slot limiter against those still open.
Does not know frames, protocols or who is on the ring.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from libp2p.network.connection.raw_connection import RawConnection

log = logging.getLogger(__name__)


async def _close_quietly(conn: Any) -> None:
    try:
        await conn.close()
    except Exception:  # already gone: closing is idempotent
        pass


async def _serve_inbound(swarm: Any, read_write_closer: Any, maddr: Any, failure_event: Any) -> None:
    """Swarm._do_handle_inbound_connection for TCP, minus the wait for the swarm's end:
    gate, upgrade (security, muxer, add_conn), then hold the slot until this connection
    closes. Error handling: a refused or failed upgrade closes the socket (upstream's own
    cleanup ran) and returns, which frees the slot. trio.Cancelled passes."""
    remote = swarm._build_remote_multiaddr(read_write_closer)
    if remote is not None and not await swarm.connection_gate.is_allowed(remote):
        await _close_quietly(read_write_closer)
        return
    raw = RawConnection(read_write_closer, False)
    try:
        muxed = await swarm.upgrade_inbound_raw_conn(raw, maddr)
    except Exception as exc:
        log.debug("inbound connection from %s not upgraded: %s", remote, exc)
        await _close_quietly(raw)
        return
    closed = getattr(muxed, "event_closed", None)
    if closed is None:  # a muxer without the event: upstream's behaviour
        await swarm.manager.wait_finished()
    else:
        await closed.wait()


def release_slots_on_close(swarm: Any) -> None:
    """Replace `swarm`'s inbound handler with one whose slot ends with its connection.
    Logs and changes nothing if the swarm is not the py-libp2p 0.8.1 shape patched here."""
    if not hasattr(type(swarm), "_do_handle_inbound_connection") or not hasattr(swarm, "_inbound_limiter"):
        log.warning("py-libp2p swarm %s has no inbound slot handler to patch; leaving it as is", type(swarm).__name__)
        return
    swarm._do_handle_inbound_connection = functools.partial(_serve_inbound, swarm)
