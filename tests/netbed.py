"""A small internet on one machine: network namespaces on a bridge (issue 19's test bed).

"Public" hosts sit on one bridge, each with its own address and its upload shaped by
`tc ... tbf`; a "home" is a router namespace doing iptables MASQUERADE for the hosts
behind it, which can dial out and cannot be dialled. The bridge itself lives in a
namespace of its own, so nothing here touches the machine's own interfaces or routes: no
address it hands out is reachable from outside the namespaces it creates, and there is
no route out of them. `ip netns exec NS` is the prefix that runs a process on a host.

Needs root (CI runs as root); `ensure_tools()` installs iproute2 and iptables with apt
when they are missing. Latency is not emulated here (netem is not available); the
transport's own link emulation does that. Every namespace is deleted on close, however
the test ends.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

PUBLIC_NET = "10.19.0"  # the bridge's /24: hosts .2 upward, home routers' WAN side too
HOME_NET = "192.168.{}"  # each home's LAN /24: router .1, hosts .2 upward


class NetbedError(RuntimeError):
    """The test bed cannot be built here (not root, a tool missing, a command failing)."""


def ensure_tools() -> None:
    """Root, `ip`, `tc` and `iptables`; the last three installed with apt-get when absent.
    Raises NetbedError saying what is missing when that cannot be done."""
    if os.geteuid() != 0:
        raise NetbedError("the namespace test bed needs root (network namespaces, tc, iptables); CI runs as root")
    missing = [pkg for tool, pkg in (("ip", "iproute2"), ("tc", "iproute2"), ("iptables", "iptables"))
               if shutil.which(tool) is None]
    if missing:
        got = subprocess.run(["apt-get", "install", "-y", *sorted(set(missing))], capture_output=True, text=True,
                             timeout=600)
        if got.returncode != 0:
            raise NetbedError(f"apt-get install {' '.join(sorted(set(missing)))} failed: {got.stderr[-500:]}")


def run(*args: str) -> str:
    got = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if got.returncode != 0:
        raise NetbedError(f"{' '.join(args)}: {got.stderr.strip() or got.stdout.strip()}")
    return got.stdout


@dataclass(frozen=True)
class NetHost:
    name: str
    ns: str
    ip: str  # its own address (behind a NAT: its LAN address)
    public_ip: str  # what others see it come from (its router's for a home host)

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]


@dataclass
class Netbed:
    tag: str = field(default_factory=lambda: f"sh{os.getpid() % 100000}")
    namespaces: list[str] = field(default_factory=list)
    hosts: dict[str, NetHost] = field(default_factory=dict)
    _next_ip: itertools.count = field(default_factory=lambda: itertools.count(2))
    _next_home: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def net(self) -> str:
        return f"{self.tag}-net"

    def open(self) -> "Netbed":
        ensure_tools()
        self._add_ns(self.net)
        run("ip", "-n", self.net, "link", "add", "br0", "type", "bridge")
        run("ip", "-n", self.net, "link", "set", "br0", "up")
        return self

    def _add_ns(self, ns: str) -> None:
        run("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        run("ip", "-n", ns, "link", "set", "lo", "up")

    def _wire(self, ns: str, port: str, ip: str) -> None:
        """A veth from the bridge to `ns` (its end named eth0 there, address `ip`/24)."""
        run("ip", "-n", self.net, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
        run("ip", "-n", self.net, "link", "set", port, "master", "br0", "up")
        run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        run("ip", "-n", ns, "link", "set", "eth0", "up")

    def add_public(self, name: str, upload_mbit: float | None = None) -> NetHost:
        """A host on the bridge, dialable by everyone; its egress shaped to `upload_mbit`."""
        ns, ip = f"{self.tag}-{name}", f"{PUBLIC_NET}.{next(self._next_ip)}"
        self._add_ns(ns)
        self._wire(ns, f"p{len(self.namespaces)}", ip)
        if upload_mbit is not None:
            shape(ns, "eth0", upload_mbit)
        host = self.hosts[name] = NetHost(name, ns, ip, ip)
        return host

    def add_home(self, name: str, hosts: Sequence[str], upload_mbit: float | None = None,
                 symmetric: bool = False) -> list[NetHost]:
        """A router on the bridge masquerading for `hosts` behind it (one LAN): they dial
        out through it, and nothing on the bridge can open a connection to them. It keeps a
        connection's source port where it can (hole punching can predict it); `symmetric`
        gives each connection a random one instead (as carrier-grade NATs do: no punching)."""
        home = next(self._next_home)
        router, wan_ip, lan = f"{self.tag}-{name}", f"{PUBLIC_NET}.{next(self._next_ip)}", HOME_NET.format(home)
        self._add_ns(router)
        self._wire(router, f"p{len(self.namespaces)}", wan_ip)
        if upload_mbit is not None:
            shape(router, "eth0", upload_mbit)
        run("ip", "-n", router, "link", "add", "lan", "type", "bridge")
        run("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "lan")
        run("ip", "-n", router, "link", "set", "lan", "up")
        run("ip", "netns", "exec", router, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        nat = ["ip", "netns", "exec", router, "iptables"]
        run(*nat, "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "eth0", "-j", "MASQUERADE",
            *(["--random-fully"] if symmetric else []))
        run(*nat, "-A", "FORWARD", "-i", "eth0", "-o", "lan", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
            "-j", "ACCEPT")
        run(*nat, "-A", "FORWARD", "-i", "eth0", "-o", "lan", "-j", "DROP")
        # Like a home router, answer unsolicited connections to the WAN address with
        # silence, not a reset: a reset would also erase the mapping a hole punch's own SYN
        # just made (TCP simultaneous open needs the crossing SYNs to meet state, not RSTs).
        run(*nat, "-A", "INPUT", "-i", "eth0", "-p", "tcp", "--syn", "-j", "DROP")
        out = []
        for i, host_name in enumerate(hosts, start=2):
            ns, ip = f"{self.tag}-{host_name}", f"{lan}.{i}"
            self._add_ns(ns)
            port = f"l{i}"
            run("ip", "-n", router, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("ip", "-n", router, "link", "set", port, "master", "lan", "up")
            run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
            run("ip", "-n", ns, "route", "add", "default", "via", f"{lan}.1")
            out.append(self.hosts.setdefault(host_name, NetHost(host_name, ns, ip, wan_ip)))
        return out

    def close(self) -> None:
        """Delete every namespace made (their links, addresses and rules go with them)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.namespaces.clear()

    def __enter__(self) -> "Netbed":
        try:
            return self.open()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def shape(ns: str, dev: str, upload_mbit: float) -> None:
    """Egress of `dev` in `ns` at `upload_mbit` (token bucket: 32 KiB burst, 200 ms queue)."""
    run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
        f"{upload_mbit}mbit", "burst", "32kb", "latency", "200ms")


def can_connect(src: NetHost, dst_ip: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether a TCP connection from `src` to dst_ip:port opens (something must listen)."""
    code = (f"import socket; s = socket.create_connection(({dst_ip!r}, {port}), timeout={timeout_s}); s.close()")
    return subprocess.run([*src.prefix, "python3", "-c", code], capture_output=True, timeout=30).returncode == 0
