"""Reaching a host that cannot be dialled: py-libp2p 0.8.1's circuit relay v2, DCUtR hole
punching and AutoNAT, wired to one of our hosts.

Every host serves the relay's STOP side (it accepts circuits relayed to it) and DCUtR;
a host made with `hop=True` (the coordinator) also relays for others and answers AutoNAT
dial-back requests, and `enable_hop` makes any host relay later (a node given the relay
role, shard.reach_duty). A host asks a peer it already reaches (its
coordinator) to dial it back (`reachable_by`); if that fails it reserves a slot there
(`reserve`) and advertises `<relay addr>/p2p-circuit/p2p/<itself>`. A host dialling such
an address reaches its peer through the relay, then asks DCUtR at once for a direct
connection (TCP simultaneous open from both listen ports), so the ring stream opened
right after uses the direct connection when the NATs allowed one and the circuit when
not. `path_of(stream)` says which of the two a stream crosses.

py-libp2p 0.8.1 quirks handled here:
- AutoNATService dials back with `host.connect`, which returns at once when a connection
  to the peer already exists, and the requester is always connected to the server: every
  peer would be told it is public. `_DialBackAutoNAT` dials a fresh connection.
- DCUtR's auto-drive loop starts a second session to any relayed peer every 2 s,
  concurrent with ours; `_DirectUpgrade` leaves the initiative to `connect_relayed`.
- A relay limit of data=0 resets every circuit at its first byte (the per-reservation
  fallback compares against 0); activations cross circuits for as long as a ring lives,
  so the caps are set high instead of to "unlimited".

Knows nothing of rings, frames or the coordinator's protocol.
"""

from __future__ import annotations

import ipaddress
import logging
import weakref
from collections.abc import Collection
from dataclasses import dataclass

import multiaddr
import trio
from libp2p.abc import INotifee
from libp2p.connection_types import ConnectionType
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from shard.addresses import ip_of, this_machines_ips
from shard.errors import DialError

log = logging.getLogger(__name__)

DIRECT, HOLE_PUNCHED, RELAYED = "direct", "hole_punched", "relayed"
PATHS = (DIRECT, HOLE_PUNCHED, RELAYED)
CIRCUIT = "/p2p-circuit"
_AUTONAT_OK = 0  # Message.OK in py-libp2p's autonat protobuf


@dataclass(frozen=True)
class ReachConfig:
    """What a relay grants and how long each step may take; the only home of these defaults."""

    max_reservations: int = 256  # hosts behind NATs one relay serves
    max_circuits_per_peer: int = 16  # a stage has one predecessor; probes and redials overlap
    max_circuit_bytes: int = 2**62  # see the module docstring: 0 would mean "none", not "any"
    dial_back_timeout_s: float = 5.0  # one AutoNAT dial-back
    autonat_timeout_s: float = 15.0  # the whole reachability query
    punch_timeout_s: float = 12.0  # DCUtR's exchange and its simultaneous dials
    # How long a link probe waits for that: a reversal (the prober dialable, its peer dialling
    # back) is done well within it, so the probe measures the direct path; a punch the NATs
    # defeat takes punch_timeout_s, which a link report must not wait for.
    probe_punch_wait_s: float = 4.0

    def limits(self) -> RelayLimits:
        # duration 0: a circuit lives as long as its ring (py-libp2p reads 0 as no cap).
        return RelayLimits(duration=0, data=self.max_circuit_bytes, max_circuit_conns=self.max_circuits_per_peer,
                           max_reservations=self.max_reservations)


def is_circuit(addr: str) -> bool:
    return CIRCUIT in addr


def circuit_addr(relay_addr: str, peer_id: str) -> str:
    """The address at which `peer_id` is reached through the relay at `relay_addr` (…/p2p/<relay>)."""
    return f"{relay_addr}{CIRCUIT}/p2p/{peer_id}"


def path_kind(relayed: bool, opened_beside_a_relay: bool) -> str:
    """A connection's path: relayed, a direct one opened while the two peers were joined
    by a relayed one (DCUtR's upgrade: hole-punched), or direct."""
    if relayed:
        return RELAYED
    return HOLE_PUNCHED if opened_beside_a_relay else DIRECT


def relay_in(addr: str) -> str | None:
    """The relay's peer id in a circuit address (…/p2p/<relay>/p2p-circuit/…); None if none."""
    relay_part, circuit, _ = addr.partition(CIRCUIT)
    _, p2p, relay = relay_part.rpartition("/p2p/")
    return relay if circuit and p2p and relay else None


def is_relayed(swarm_conn) -> bool:
    """Whether a libp2p connection runs through a relay: its type or its address says so."""
    addrs = [str(a) for a in (swarm_conn.get_transport_addresses() or [])]
    return swarm_conn.get_connection_type() == ConnectionType.RELAYED or any(map(is_circuit, addrs))


class _Upgrades(INotifee):
    """Remembers each direct connection that opened while a relayed one to the same peer
    was open: whoever dialled it, that is the hole punch (or DCUtR's direct dial)."""

    def __init__(self) -> None:
        self.punched: weakref.WeakSet = weakref.WeakSet()

    async def connected(self, network, conn) -> None:
        peer = conn.muxed_conn.peer_id
        if not is_relayed(conn) and any(is_relayed(c) for c in network.connections.get(peer, []) if c is not conn):
            self.punched.add(conn)

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def disconnected(self, network, conn) -> None:
        pass

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass


class _DialBackAutoNAT(AutoNATService):
    """AutoNAT whose dial-back opens a new connection (see the module docstring), and
    which dials a requester on this machine (it came over loopback or from one of this
    machine's own addresses) at its loopback addresses too, as shard.addresses hands them
    to its peers: a local node listening on 127.0.0.1 is reachable, not behind a NAT."""

    dial_back_timeout_s = ReachConfig.dial_back_timeout_s

    @staticmethod
    def _filter_by_observed_ip(addrs: list[bytes], observed_ip: str | None) -> list[bytes]:
        dialable = AutoNATService._filter_by_observed_ip(addrs, observed_ip)
        try:
            observed = ipaddress.ip_address(observed_ip) if observed_ip else None
        except ValueError:
            observed = None
        if observed is None or not (observed.is_loopback or observed in this_machines_ips()):
            return dialable
        local = []
        for raw in addrs:
            try:
                ip = ip_of(multiaddr.Multiaddr(raw))
            except Exception:  # noqa: BLE001 (a malformed address is not dialled)
                continue
            if ip is not None and ip.is_loopback and raw not in dialable:
                local.append(raw)
        return dialable + local

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        network = self.host.get_network()
        for raw in addrs:
            conn = None
            with trio.move_on_after(self.dial_back_timeout_s):
                try:
                    conn = await network.dial_addr(multiaddr.Multiaddr(raw), peer_id)
                except Exception as exc:  # noqa: BLE001 (any failure is the verdict "not dialable")
                    log.debug("dial-back to %s at %s failed: %s", peer_id, multiaddr.Multiaddr(raw), exc)
            if conn is not None:
                with trio.CancelScope(shield=True):
                    await conn.close()
                return raw
        return None


class _DirectUpgrade(DCUtRProtocol):
    """DCUtR without the auto-drive loop: `Reach.connect_relayed` starts each session."""

    async def _auto_drive_loop(self) -> None:
        return


class Reach:
    """One host's relay (STOP always, HOP with `hop`), DCUtR and AutoNAT, and what it
    learned: where it holds reservations and which direct connections replaced a relay.
    Made by `open_reach`; valid inside its block."""

    def __init__(self, libp2p_host, hop: bool, config: ReachConfig) -> None:
        self._host, self.hop, self.config = libp2p_host, hop, config
        # No CLIENT role: with it, every circuit dial first reserves a slot for the dialler too.
        roles = RelayRole.STOP | RelayRole.HOP if hop else RelayRole.STOP
        self.protocol = CircuitV2Protocol(libp2p_host, limits=config.limits(), allow_hop=hop)
        self.client = CircuitV2Transport(libp2p_host, self.protocol, RelayConfig(roles=roles))
        self.dcutr = _DirectUpgrade(libp2p_host)
        self.autonat = _DialBackAutoNAT(libp2p_host, serve=hop, confirmations=1)
        self.autonat.dial_back_timeout_s = config.dial_back_timeout_s
        self.relays: dict[str, str] = {}  # peer id -> address: where to reserve when not dialable
        self.reservations: dict[str, str] = {}  # relay peer id -> our circuit address through it
        self._checked: dict[str, object] = {}  # relay peer id -> the connection its verdict came over
        self._upgrades = _Upgrades()
        self._punches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # relayed conn -> its attempt, ended when set
        libp2p_host.get_network().register_notifee(self._upgrades)
        self._nursery: trio.Nursery | None = None

    @property
    def circuit_addrs(self) -> list[str]:
        return list(self.reservations.values())

    async def reachable_by(self, server: str) -> bool | None:
        """Whether `server` (connected, serving AutoNAT) could open a new connection to us:
        True public, False not, None it could not say (no AutoNAT there, timeout)."""
        try:
            with trio.fail_after(self.config.autonat_timeout_s):
                status, _ = await self.autonat.query_server(ID.from_base58(server),
                                                            timeout=self.config.autonat_timeout_s)
        except Exception as exc:  # noqa: BLE001 (a server that cannot answer leaves us unknowing)
            log.info("no reachability verdict from %s: %s", server, exc)
            return None
        return status == _AUTONAT_OK

    async def reserve(self, relay_addr: str) -> str:
        """Reserve a slot on the relay at `relay_addr` (…/p2p/<relay>, connected); return
        our circuit address there. DialError when the relay refuses or cannot be asked."""
        relay = multiaddr.Multiaddr(relay_addr).get_peer_id()
        relay_id = ID.from_base58(relay)
        try:
            with trio.fail_after(self.config.autonat_timeout_s):
                stream = await self._host.new_stream(relay_id, [HOP_PROTOCOL])
                ok = await self.client.reserve(stream, relay_id, self._nursery)
                await stream.close()
        except Exception as exc:  # noqa: BLE001 (every failure is "no slot there")
            raise DialError(relay_addr, f"no relay reservation: {type(exc).__name__}: {exc}", relay) from exc
        if not ok:
            raise DialError(relay_addr, "the relay refused a reservation", relay)
        addr = circuit_addr(relay_addr, self._host.get_id().to_base58())
        self.reservations[relay] = addr
        log.info("reachable through the relay %s at %s", relay, addr)
        return addr

    def use_relay(self, addr: str) -> None:
        """Reserve on the peer at `addr` (…/p2p/<id>) whenever it says we are not dialable."""
        self.relays[multiaddr.Multiaddr(addr).get_peer_id()] = addr

    async def after_connect(self, peer: str) -> None:
        """Once per connection to a relay named by `use_relay`: ask it to dial us back, and
        reserve a slot there if it cannot (again after a restart: it forgot the old slot).
        Error handling: DialError if a slot was needed and the relay gave none."""
        addr, conn = self.relays.get(peer), self._connection(peer)
        if addr is None or conn is None or self._checked.get(peer) is conn:
            return
        self._checked[peer] = conn
        if await self.reachable_by(peer) is False:
            await self.reserve(addr)
        else:
            self.reservations.pop(peer, None)

    async def connect_relayed(self, addr: str, peer_id: str, timeout_s: float, punch_wait_s: float | None = None) -> None:
        """Reach `peer_id` through the relay in circuit `addr`, and try DCUtR once per relayed
        connection for a direct one (staying relayed when the NATs do not allow one); return
        once that attempt ended, so a stream opened next crosses the direct connection if one
        opened, or after `punch_wait_s` (a link probe: ReachConfig.probe_punch_wait_s), the
        attempt going on in the background.
        Error handling: DialError if no circuit opens within `timeout_s`.
        A direct connection to the peer is kept and so is one through this same relay; one
        through another relay (a link probe's, through the coordinator) is closed once this
        circuit is open, so the streams opened next cross the relay `addr` names."""
        relay, conns = relay_in(addr), self._connections(peer_id)
        if any(not is_relayed(c) for c in conns):
            return
        if not any(self.via_of(c) == relay for c in conns):
            with trio.move_on_after(timeout_s) as scope:
                try:
                    await self.client.dial(multiaddr.Multiaddr(addr))
                except Exception as exc:  # noqa: BLE001 (the relay's errors are all "no circuit")
                    raise DialError(addr, f"no circuit: {type(exc).__name__}: {exc}", peer_id) from exc
            if scope.cancelled_caught:
                raise DialError(addr, f"no circuit within {timeout_s} s", peer_id)
            for other in conns:
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await other.close()
        circuit = next((c for c in self._connections(peer_id) if self.via_of(c) == relay), None)
        if circuit is None or any(not is_relayed(c) for c in self._connections(peer_id)):
            return
        attempt = self._punches.get(circuit)
        if attempt is None:
            attempt = self._punches[circuit] = trio.Event()
            self._nursery.start_soon(self._punch, peer_id, attempt)
        with trio.move_on_after(self.config.punch_timeout_s + 1.0 if punch_wait_s is None else punch_wait_s):
            await attempt.wait()

    async def _punch(self, peer_id: str, done: trio.Event) -> None:
        punched = False
        try:
            with trio.move_on_after(self.config.punch_timeout_s):
                punched = await self.dcutr.initiate_hole_punch(ID.from_base58(peer_id))
        except Exception as exc:  # noqa: BLE001 (a failed punch leaves the relayed connection)
            log.debug("hole punch to %s raised: %s", peer_id, exc)
        finally:
            done.set()
        log.info("reached %s through a relay; hole punch %s", peer_id, "succeeded" if punched else "failed")

    def path_of(self, swarm_conn) -> str:
        """The path of one libp2p connection (a stream's `swarm_conn`)."""
        return path_kind(is_relayed(swarm_conn), swarm_conn in self._upgrades.punched)

    @staticmethod
    def via_of(swarm_conn) -> str | None:
        """The relay a relayed connection crosses (its peer id); None for a direct one."""
        if not is_relayed(swarm_conn):
            return None
        return next(filter(None, (relay_in(str(a)) for a in swarm_conn.get_transport_addresses() or [])), None)

    def enable_hop(self, serve: Collection[str] | None = None) -> None:
        """Start relaying for others (the relay role), under the same limits as a relay
        made with `hop=True`; the AutoNAT service stays the coordinator's. `serve`: the
        peer ids whose reservations it accepts (None: any); a later call replaces them."""
        allowed = None if serve is None else frozenset(serve)
        accepts = self.protocol.resource_manager.can_accept_reservation
        accepts = getattr(accepts, "unrestricted", accepts)
        if allowed is not None:
            def restricted(peer_id: ID, accepts=accepts) -> bool:
                return peer_id.to_base58() in allowed and accepts(peer_id)
            restricted.unrestricted = accepts
            self.protocol.resource_manager.can_accept_reservation = restricted
        else:
            self.protocol.resource_manager.can_accept_reservation = accepts
        if not self.hop:
            self.hop = self.protocol.allow_hop = True
            self._host.set_stream_handler(HOP_PROTOCOL, self.protocol._handle_hop_stream)
        log.info("relaying for %s", "any host" if allowed is None else f"{len(allowed)} hosts behind NATs")

    def _connections(self, peer: str) -> list:
        return list(self._host.get_network().connections.get(ID.from_base58(peer)) or [])

    def _connection(self, peer: str):
        conns = self._connections(peer)
        direct = [c for c in conns if c.get_connection_type() != ConnectionType.RELAYED]
        return (direct or conns or [None])[0]

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Run the relay and DCUtR services (and reservation refreshes) until cancelled."""
        async with (background_trio_service(self.protocol), background_trio_service(self.dcutr),
                    trio.open_nursery() as nursery):
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()
