"""py-libp2p 0.8.1's circuit relay v2 carries a stream between two of our hosts (issue 19).

Not shard code yet: the fact the NAT work builds on. A node behind a NAT would reserve a
slot on a relay (the coordinator) and be dialled at /…/p2p/<relay>/p2p-circuit/p2p/<node>.
This pins that the library's relay (hop on the relay, reservation and STOP on the
destination, dial on the source) works on trio with our hosts as built (Noise, yamux,
shard.transport.open_host), so the integration is ours to do, not a library bug to wait
for. Sound: the echo crosses a connection the source never had directly (it only ever
dialled the relay), and the swarm records it as a relayed connection.
"""

from __future__ import annotations

import os

import multiaddr
import trio
from libp2p.connection_types import ConnectionType
from libp2p.custom_types import TProtocol
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID, CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from shard.identity import keypair_from_seed
from shard.transport import open_host

ECHO = TProtocol("/shard-test/echo/1")


def test_a_stream_reaches_a_host_through_a_relay_it_reserved_on():
    got: list = []

    async def main():
        async with (open_host(keypair_from_seed(os.urandom(32))) as relay,
                    open_host(keypair_from_seed(os.urandom(32))) as dest,
                    open_host(keypair_from_seed(os.urandom(32))) as source,
                    trio.open_nursery() as nursery):
            r, d, s = relay._host, dest._host, source._host
            hop, stop_d, stop_s = (CircuitV2Protocol(r, allow_hop=True), CircuitV2Protocol(d), CircuitV2Protocol(s))
            async with background_trio_service(hop), background_trio_service(stop_d), background_trio_service(stop_s):
                roles = RelayConfig(roles=RelayRole.STOP | RelayRole.CLIENT)
                dest_client, source_client = CircuitV2Transport(d, stop_d, roles), CircuitV2Transport(s, stop_s, roles)

                async def echo(stream) -> None:
                    await stream.write(await stream.read(5))
                    await stream.close()

                d.set_stream_handler(ECHO, echo)
                with trio.fail_after(30):
                    await dest.connect(relay.addrs[0])
                    await source.connect(relay.addrs[0])
                    reserved = await dest_client.reserve(await d.new_stream(r.get_id(), [PROTOCOL_ID]), r.get_id(),
                                                         nursery)
                    circuit = multiaddr.Multiaddr(f"{relay.addrs[0]}/p2p-circuit/p2p/{dest.peer_id}")
                    conn = await source_client.dial(circuit)
                    stream = await s.new_stream(d.get_id(), [ECHO])
                    await stream.write(b"hello")
                    answer = await stream.read(5)
                kinds = [c.get_connection_type() for c in s.get_network().connections.get(d.get_id(), [])]
                got.extend([reserved, conn is not None, answer, kinds])
                nursery.cancel_scope.cancel()  # the reservation's refresher

    trio.run(main)
    reserved, dialled, answer, kinds = got
    assert reserved and dialled and answer == b"hello"
    assert ConnectionType.RELAYED in kinds, kinds
