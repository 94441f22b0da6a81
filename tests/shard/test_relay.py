"""shard.relay on real hosts over loopback: reservations, circuits, hole punching, AutoNAT.

Bugs guarded: a host behind a NAT advertised only addresses nobody could dial (issue 19);
py-libp2p's AutoNAT server "dialled back" over the requester's own connection and told
every peer it was public; a circuit's path was reported as direct. Sound: each path is
read from the connection the stream actually crosses (its type and its /p2p-circuit
address), and the dial-back verdicts are for an address where something listens and one
where nothing does, over a connection that already exists in both cases.
"""

from __future__ import annotations

import os
import socket

import multiaddr
import trio

from shard.identity import keypair_from_seed
from shard.relay import DIRECT, HOLE_PUNCHED, PATHS, RELAYED, ReachConfig, circuit_addr, is_circuit, path_kind
from shard.transport import open_host
from shard.wire.messages import HOP_PATHS

PROTO = "/shard-test/relay-echo/1"


def _key():
    return keypair_from_seed(os.urandom(32))


def test_path_names_are_the_wires():
    assert set(PATHS) == set(HOP_PATHS)


def test_path_kind_and_circuit_addresses():
    assert (path_kind(True, True), path_kind(True, False)) == (RELAYED, RELAYED)
    assert (path_kind(False, True), path_kind(False, False)) == (HOLE_PUNCHED, DIRECT)
    addr = circuit_addr("/ip4/10.0.0.1/tcp/4001/p2p/R", "D")
    assert addr == "/ip4/10.0.0.1/tcp/4001/p2p/R/p2p-circuit/p2p/D" and is_circuit(addr)
    assert not is_circuit("/ip4/10.0.0.1/tcp/4001/p2p/R")


async def _echo(stream) -> None:
    await stream.send_frame(await stream.recv_frame(1024))


def _through_relay(punch: bool) -> tuple[list[str], str, bytes, str]:
    """A destination reserved on a relay; a source dials the circuit it advertises and
    echoes a frame. Returns (dest addrs, path of the source's stream, echo, path after)."""
    got: list = []
    config = ReachConfig() if punch else ReachConfig(punch_timeout_s=0.0)

    async def main():
        async with (open_host(_key(), relay_hop=True) as relay, open_host(_key()) as dest,
                    open_host(_key(), reach_config=config) as source):
            dest.set_handler(PROTO, _echo)
            with trio.fail_after(60):
                relay_addr = relay.addrs[0]
                await dest.connect(relay_addr)
                await dest.reach.reserve(relay_addr)
                advertised = dest.addrs
                await source.connect(advertised[0])
                stream = await source.open_stream(dest.peer_id, PROTO)
                path = source.path_of(stream)
                await stream.send_frame(b"hello")
                got.extend([advertised, path, await stream.recv_frame(1024)])
                await stream.aclose()

    trio.run(main)
    return tuple(got)


def test_a_host_reached_through_its_relay_is_on_a_relayed_path():
    advertised, path, echo = _through_relay(punch=False)
    assert is_circuit(advertised[0]) and not any(map(is_circuit, advertised[1:]))
    assert (path, echo) == (RELAYED, b"hello")


def test_a_relayed_host_that_can_be_reached_directly_is_hole_punched():
    # On loopback nothing blocks a direct connection: DCUtR must find one, and the stream
    # opened after it must cross it.
    _, path, echo = _through_relay(punch=True)
    assert (path, echo) == (HOLE_PUNCHED, b"hello")


def test_a_plain_dial_is_direct():
    got = []

    async def main():
        async with open_host(_key()) as a, open_host(_key()) as b:
            b.set_handler(PROTO, _echo)
            with trio.fail_after(30):
                await a.connect(b.addrs[0])
                got.append(a.path_of(await a.open_stream(b.peer_id, PROTO)))

    trio.run(main)
    assert got == [DIRECT]


def _unused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_autonat_dials_back_on_a_new_connection():
    # The requester is connected to the server already; py-libp2p's own dial-back reused
    # that connection and said OK for any address with the requester's IP.
    got = []

    async def main():
        async with open_host(_key(), relay_hop=True) as server, open_host(_key()) as client:
            with trio.fail_after(60):
                await client.connect(server.addrs[0])
                server_id = multiaddr.Multiaddr(server.addrs[0]).get_peer_id()
                from libp2p.peer.id import ID
                sid = ID.from_base58(server_id)
                dead = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{_unused_port()}").to_bytes()
                live = [multiaddr.Multiaddr(a.split("/p2p/")[0]).to_bytes() for a in client.addrs]
                got.append((await client.reach.autonat.query_server(sid, addrs=[dead]))[0])
                got.append((await client.reach.autonat.query_server(sid, addrs=live))[0])
                got.append(await client.reach.reachable_by(server_id))

    trio.run(main)
    dead_status, live_status, verdict = got
    assert dead_status != 0 and live_status == 0 and verdict is True


def test_a_host_its_relay_cannot_dial_reserves_and_advertises_a_circuit():
    # use_relay + connect: the relay dials back the host's own addresses; one that
    # listens only where the relay cannot reach it (here: advertised addresses nobody
    # listens on) is told it is private and reserves.
    got = []

    async def main():
        async with open_host(_key(), relay_hop=True) as relay, open_host(_key()) as node:
            node._host.get_addrs = lambda: [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{_unused_port()}")]
            node.reach.use_relay(relay.addrs[0])
            with trio.fail_after(60):
                await node.connect(relay.addrs[0])
            got.append(node.addrs)

    trio.run(main)
    (addrs,) = got
    assert is_circuit(addrs[0]) and addrs[0].endswith("/p2p-circuit/p2p/" + addrs[0].rsplit("/", 1)[1])


def test_a_node_on_the_relays_machine_listening_on_loopback_is_reachable():
    # A --local-nodes node listens on 127.0.0.1 and may dial the coordinator at one of
    # the machine's interface addresses: AutoNAT's observed-IP rule alone would find no
    # address to dial back and call it private, and its peers would reach it through the
    # relay. Sound: whichever address the relay advertises first, the node is on its machine.
    got = []

    async def main():
        async with (open_host(_key(), "/ip4/0.0.0.0/tcp/0", relay_hop=True) as relay,
                    open_host(_key(), "/ip4/127.0.0.1/tcp/0") as node):
            node.reach.use_relay(relay.addrs[0])
            with trio.fail_after(60):
                await node.connect(relay.addrs[0])
            got.append((relay.addrs[0], node.addrs))

    trio.run(main)
    (relay_addr, addrs) = got[0]
    assert not any(map(is_circuit, addrs)), (relay_addr, addrs)


def _assignment(peer: str, role: str, relay_addrs: tuple[str, ...] = (), relay_for: tuple[str, ...] = ()):
    from shard.wire.messages import Assignment
    return Assignment(epoch=1, peer_id=peer, role=role, layer_start=0, layer_end=0, predecessor=None, successor=None,
                      relay_addrs=relay_addrs, relay_for=relay_for, model="m", manifest_digest="d", wire_dtype="f32")


def test_a_relay_role_node_relays_and_a_sender_crosses_it_instead_of_the_gateways_circuit():
    # Bug guarded (issue 19): the relay role did nothing, so every relayed hop crossed the
    # gateway. A node given the role starts relaying; a node told to reserve there does
    # (retrying while the relay has not taken its role yet); a sender already joined to it
    # through the gateway's circuit (a link probe's) dials the relay-role circuit it was
    # given, and its ring stream crosses that relay, as `via` reports. Sound: the gateway
    # and the relay are distinct hosts, and `via` is read off the connection the stream uses.
    from shard import reach_duty
    got = {}

    async def main():
        async with (open_host(_key(), relay_hop=True) as gateway, open_host(_key()) as relay,
                    open_host(_key()) as dest, open_host(_key(), reach_config=ReachConfig(punch_timeout_s=0.0)) as src):
            dest.set_handler(PROTO, _echo)
            with trio.fail_after(60):
                await dest.connect(gateway.addrs[0])
                await dest.reach.reserve(gateway.addrs[0])
                await src.connect(circuit_addr(gateway.addrs[0], dest.peer_id))  # as a link probe would
                got["before"] = src.via_of(await src.open_stream(dest.peer_id, PROTO))
                async with trio.open_nursery() as nursery:  # the reservation waits for the role
                    nursery.start_soon(reach_duty.take_duty, dest, _assignment(dest.peer_id, "stage", tuple(relay.addrs)))
                    await trio.sleep(1.0)
                    got["relaying_before_role"] = relay.reach.hop
                    await reach_duty.take_duty(relay, _assignment(relay.peer_id, "relay", relay_for=(dest.peer_id,)))
                assert relay.peer_id in dest.reach.reservations
                await reach_duty.dial_first(src, [circuit_addr(relay.addrs[0], dest.peer_id)])
                stream = await src.open_stream(dest.peer_id, PROTO)
                await stream.send_frame(b"hi")
                got["echo"] = await stream.recv_frame(1024)
                got["hop"] = reach_duty.hop_path(src, stream, dest.peer_id)
                got["ids"] = gateway.peer_id, relay.peer_id

    trio.run(main)
    gateway_id, relay_id = got["ids"]
    assert got["before"] == gateway_id and got["relaying_before_role"] is False
    assert got["echo"] == b"hi"
    assert (got["hop"].path, got["hop"].via) == (RELAYED, relay_id)


def test_a_relay_for_named_peers_refuses_anyone_elses_reservation():
    # Bug guarded: a volunteer given the relay role relayed for whoever asked, its uplink
    # open to any host. Sound: two hosts ask the same relay, only the named one is granted.
    from shard.errors import DialError
    got = {}

    async def main():
        async with open_host(_key()) as relay, open_host(_key()) as named, open_host(_key()) as other:
            relay.reach.enable_hop([named.peer_id])
            with trio.fail_after(60):
                for host in (named, other):
                    await host.connect(relay.addrs[0])
                    try:
                        await host.reach.reserve(relay.addrs[0])
                        got[host is named] = "granted"
                    except DialError as exc:
                        got[host is named] = exc.reason

    trio.run(main)
    assert got[True] == "granted" and got[False] == "the relay refused a reservation", got
