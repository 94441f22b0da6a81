"""More attacks for scripts/bench_hostile_ring.py against the live ring's coordinator
(issue 20): kept apart so that script stays within its line budget.

coordinator_flood: N libp2p connections to the coordinator, each opened and closed before
the next (py-libp2p alone kept a slot per closed connection and refused every inbound one
past 250, so a flood of 246 once blocked every later `shard-node join`); then a fresh
identity must still connect (the coordinator serves no probe protocol: the attack list's
node joining afterwards shows it still admits nodes).
"""

from __future__ import annotations

import os
import time

import trio
from libp2p.peer.id import ID

from shard.errors import TransportError
from shard.identity import keypair_from_seed
from shard.transport import open_host


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
