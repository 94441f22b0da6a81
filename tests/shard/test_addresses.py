"""What a node tells others to dial (shard.addresses), issue 19.

Bug guarded: a node listening on 0.0.0.0 advertised /ip4/0.0.0.0/..., which makes every
peer dial its own machine; nodes on other hosts were handed 127.0.0.1 addresses. The ring
"formed" and every request failed. Sound: the factory is run on the real interface table
(whatever this machine has, the wildcard must be gone and a concrete address in its place).
"""

from __future__ import annotations

import ipaddress

import multiaddr

from shard.addresses import advertised, dialable_from_elsewhere, ip_of

PEER = "12D3KooWGzBqWv1o7w7yWd8yBvZZ8CZbSrYkLqUhHwPqCFDKkV8q"


def test_a_wildcard_listen_address_is_advertised_as_concrete_interface_addresses():
    got = advertised([multiaddr.Multiaddr("/ip4/0.0.0.0/tcp/4001")])
    assert got and all(not ip_of(a).is_unspecified for a in got)
    assert all(a.value_for_protocol("tcp") == "4001" for a in got)
    loopback = [ip_of(a).is_loopback for a in got]
    assert loopback == sorted(loopback)  # routable ones first: the coordinator's join line prints the first


def test_a_concrete_listen_address_is_advertised_as_it_is():
    addr = multiaddr.Multiaddr("/ip4/127.0.0.1/tcp/5000")
    assert advertised([addr, addr]) == [addr]


def test_peers_elsewhere_are_never_told_loopback_or_unspecified_addresses():
    addrs = [f"/ip4/127.0.0.1/tcp/1/p2p/{PEER}", f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}", f"/ip4/0.0.0.0/tcp/1/p2p/{PEER}"]
    assert dialable_from_elsewhere(addrs, "10.0.0.9") == (f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}",)
    assert dialable_from_elsewhere(addrs, "10.0.0.9", own_ips=()) == (f"/ip4/10.0.0.2/tcp/1/p2p/{PEER}",)
    # A node on the coordinator's own machine keeps its loopback address (all of a local
    # ring), whether it dialled loopback or one of the machine's own interface addresses
    # (a coordinator on 0.0.0.0 prints its interface address; withholding loopback there
    # made every hop of the demo's local ring fail).
    assert dialable_from_elsewhere(addrs, "127.0.0.1") == tuple(addrs[:2])
    own = ipaddress.ip_address("10.0.0.9")
    assert dialable_from_elsewhere(addrs, "10.0.0.9", own_ips={own}) == tuple(addrs[:2])


def test_a_fixed_port_another_process_listens_on_is_refused_and_port_0_never_is():
    # Bug guarded: py-libp2p listens with SO_REUSEPORT, so a second coordinator on the
    # default port 4001 started silently and the kernel split joining nodes between the two.
    import socket

    import pytest

    from shard.addresses import refuse_if_in_use
    from shard.errors import TransportError

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as py-libp2p's listener does
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(TransportError) as caught:
            refuse_if_in_use(f"/ip4/127.0.0.1/tcp/{port}")
        refuse_if_in_use("/ip4/127.0.0.1/tcp/0")
    assert str(caught.value) == (f"/ip4/127.0.0.1/tcp/{port} is in use (another shard-coord, or another program): "
                                 "stop it, or pass --listen with another port")
    refuse_if_in_use(f"/ip4/127.0.0.1/tcp/{port}")  # free again once it closed
