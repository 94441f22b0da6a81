"""Which of a host's addresses others are told to dial.

A host listening on 0.0.0.0 (or ::) is listening on every interface, but "0.0.0.0" sent
to a peer makes it dial its own machine. `advertised` is the host's libp2p AddrsFactory:
wildcards become each interface's address (py-libp2p's `expand_wildcard_address`),
routable ones first and loopback last, and observed addresses identify confirmed pass
through. `dialable_from_elsewhere` is what the coordinator hands a node's peers: a node
whose control connection came neither over loopback nor from one of this machine's own
addresses lives on another machine, so its loopback addresses (and any unspecified one)
are dropped there.
`refuse_if_in_use` keeps a second coordinator off a port the first listens on.
Pure apart from reading the interface table; knows nothing of rings or registration.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Collection, Iterable

import multiaddr
from libp2p.utils.address_validation import expand_wildcard_address

from shard.errors import TransportError

_IP_PROTOCOLS = ("ip4", "ip6")


def ip_of(addr: multiaddr.Multiaddr | str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The IP an address names (None: a DNS name, a relay circuit without one, ...)."""
    try:
        ma = addr if isinstance(addr, multiaddr.Multiaddr) else multiaddr.Multiaddr(addr)
    except (multiaddr.exceptions.Error, ValueError):
        return None  # not a multiaddr: whoever dials it gets the DialError
    for proto in _IP_PROTOCOLS:
        try:
            return ipaddress.ip_address(ma.value_for_protocol(proto))
        except (multiaddr.exceptions.ProtocolLookupError, ValueError):
            continue
    return None


def advertised(candidates: Iterable[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
    """`candidates` (listen addresses, then observed ones) with every wildcard expanded to
    the interfaces' addresses; routable before loopback, duplicates dropped, order kept
    otherwise."""
    out: list[multiaddr.Multiaddr] = []
    for addr in candidates:
        ip = ip_of(addr)
        out += expand_wildcard_address(addr) if ip is not None and ip.is_unspecified else [addr]
    seen: set[str] = set()
    unique = [a for a in out if not (str(a) in seen or seen.add(str(a)))]
    usable = [a for a in unique if (ip := ip_of(a)) is None or not ip.is_unspecified]
    return sorted(usable, key=lambda a: bool((ip := ip_of(a)) is not None and ip.is_loopback))


def this_machines_ips() -> frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The IPs of this machine's interfaces: what a wildcard listen address covers."""
    ips = set()
    # A placeholder port: py-libp2p hands a port-0 wildcard back unexpanded.
    for wildcard in ("/ip4/0.0.0.0/tcp/1", "/ip6/::/tcp/1"):
        for addr in expand_wildcard_address(multiaddr.Multiaddr(wildcard)):
            if (ip := ip_of(addr)) is not None and not ip.is_unspecified:
                ips.add(ip)
    return frozenset(ips)


def dialable_from_elsewhere(addrs: Iterable[str], observed_ip: str | None,
                            own_ips: Collection[ipaddress.IPv4Address | ipaddress.IPv6Address] | None = None
                            ) -> tuple[str, ...]:
    """What peers are told to dial for a node whose connection came from `observed_ip`
    (None: unknown, e.g. an in-memory stream): never an unspecified address, and loopback
    ones only when the node is on this machine: it connected over loopback, or from one of
    this machine's own addresses (`own_ips`, default this_machines_ips()), or from where
    is unknown."""
    observed = None if observed_ip is None else ipaddress.ip_address(observed_ip)
    local = observed is None or observed.is_loopback or observed in (
        this_machines_ips() if own_ips is None else own_ips)
    out = []
    for addr in addrs:
        ip = ip_of(addr)
        if ip is not None and (ip.is_unspecified or (ip.is_loopback and not local)):
            continue
        out.append(addr)
    return tuple(out)


def refuse_if_in_use(listen: str) -> None:
    """Raise TransportError if a TCP listen address with a fixed port is already taken.
    py-libp2p listens with SO_REUSEPORT (for hole punching), so a second process on the
    same port would silently share it and the kernel would split connections between the
    two; a plain bind, without that option, still fails while the first one listens."""
    ma = multiaddr.Multiaddr(listen)
    ip, port = ip_of(ma), int(ma.value_for_protocol("tcp"))
    if ip is None or port == 0:
        return
    with socket.socket(socket.AF_INET6 if ip.version == 6 else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT; never past a listener
        try:
            probe.bind((str(ip), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise TransportError(f"{listen} is in use (another shard-coord, or another program): stop it, or "
                                     "pass --listen with another port") from None
            raise
