"""Emulate separate hosts' compute on one machine: each process in its own CPU quota.

The transport emulates a WAN's latency and tc its bandwidth; a pool of volunteers also
brings one machine each, which processes sharing this machine's cores do not. CpuQuotas
puts every process it is given in a cgroup of its own limited to `cores` CPUs (the CFS
bandwidth controller: `cores` x 10 ms of CPU every 10 ms period), so a node process
gets what a host of that size would give it, however many run here. Threads follow the
process (cgroup.procs moves the whole thread group) and so do children started later.

cgroup v1's `cpu` controller (/sys/fs/cgroup/cpu) first, else cgroup v2 (cpu.max, at
/sys/fs/cgroup/unified on a hybrid host or /sys/fs/cgroup). Needs root; `CpuQuotas`
raises QuotaError with one line saying what is missing otherwise. Groups are named
shard-bench-<our pid>-<n>; `close` moves anything left back to the root group and
removes them, and a run killed outright leaves groups that the next one removes (their
owner pid is gone). Each group also weighs more than a plain process (SHARES), so a busy
machine still gives every node its quota; a machine with fewer free cores than the quotas
add up to cannot, which the load average and each node's CPU seconds show.
"""

from __future__ import annotations

import os
from pathlib import Path

# The CFS period: short, so that a node is throttled in small slices, as a slower host is
# slower at every scale. With the kernel's default 100 ms, a 0.25-core process runs a
# 20 ms forward at full speed and then waits 75 ms: a node's speed probe (one short
# forward) saw a 4x faster host than its rounds then had, and the round deadlines built
# on that prediction blamed an honest stage as stalled (bench_rings, 2 rings).
PERIOD_US = 10_000
V1 = Path("/sys/fs/cgroup/cpu")
V2 = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
PREFIX = "shard-bench-"
# A group's weight against everything else on the machine (1024 is one plain process):
# high, so that a node gets its quota while other work keeps the cores busy, as it would
# on a host of its own; the quota still caps it.
SHARES = 8192


class QuotaError(RuntimeError):
    pass


def _controller() -> tuple[Path, int]:
    """(root of the cpu hierarchy, cgroup version)."""
    if (V1 / "cpu.cfs_quota_us").exists():
        return V1, 1
    for root in V2:
        try:
            if "cpu" in (root / "cgroup.controllers").read_text().split():
                return root, 2
        except OSError:
            continue
    raise QuotaError("no cgroup cpu controller: neither /sys/fs/cgroup/cpu (v1) nor cpu in a cgroup2 "
                     "cgroup.controllers; per-node CPU quotas cannot be set on this machine")


def _remove_stale(root: Path) -> None:
    """Groups of an earlier run that was killed before it could remove them."""
    for group in root.glob(PREFIX + "*"):
        owner = group.name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            _empty_and_remove(group, root)


def _empty_and_remove(group: Path, root: Path) -> None:
    try:
        for pid in (group / "cgroup.procs").read_text().split():
            try:
                (root / "cgroup.procs").write_text(pid)
            except OSError:
                pass  # exited meanwhile
        group.rmdir()
    except OSError:
        pass


class CpuQuotas:
    """One cgroup of `cores` CPUs per process added; remove them all with close()."""

    def __init__(self, cores: float) -> None:
        if not cores > 0:
            raise QuotaError(f"a CPU quota must be > 0 cores, got {cores}")
        if os.geteuid() != 0:
            raise QuotaError("per-node CPU quotas need root (they write cgroups); run as root or without --node-cpu")
        self.cores = cores
        self.root, self.version = _controller()
        _remove_stale(self.root)
        if self.version == 2:
            try:
                (self.root / "cgroup.subtree_control").write_text("+cpu")
            except OSError as exc:
                raise QuotaError(f"cannot enable the cgroup2 cpu controller under {self.root}: {exc}") from None
        self.groups: list[Path] = []

    def add(self, pid: int) -> Path:
        """Move process `pid` (all its threads) into a new group of its own."""
        group = self.root / f"{PREFIX}{os.getpid()}-{len(self.groups)}"
        try:
            group.mkdir()
            self.groups.append(group)
            quota = max(1000, round(self.cores * PERIOD_US))
            if self.version == 1:
                (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (group / "cpu.cfs_quota_us").write_text(str(quota))
                (group / "cpu.shares").write_text(str(SHARES))
            else:
                (group / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                (group / "cpu.weight").write_text(str(SHARES * 100 // 1024))
            (group / "cgroup.procs").write_text(str(pid))
        except OSError as exc:
            raise QuotaError(f"cannot put pid {pid} in a {self.cores:g}-core cgroup at {group}: {exc}") from None
        return group

    def stats(self) -> list[dict]:
        """Per group, in the order added: CFS periods and throttled periods so far."""
        out = []
        for group in self.groups:
            try:
                stat = dict(line.split() for line in (group / "cpu.stat").read_text().splitlines())
                out.append({"periods": int(stat["nr_periods"]), "throttled": int(stat["nr_throttled"])})
            except (OSError, KeyError, ValueError):
                out.append({"periods": None, "throttled": None})
        return out

    def close(self) -> None:
        """Move what is left back to the root group and remove every group."""
        for group in self.groups:
            _empty_and_remove(group, self.root)
        self.groups = [g for g in self.groups if g.exists()]

    def __enter__(self) -> CpuQuotas:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe(cores: float) -> str:
    """The condition a benchmark states for a `cores` quota per node."""
    return (f"each node process in its own cgroup (v{_controller()[1]}) limited to {cores:g} CPU "
            f"({round(cores * PERIOD_US)} us per {PERIOD_US} us period); the coordinator unconstrained")


def throttling(before: list[dict], after: list[dict]) -> list[float | None]:
    """Fraction of the CFS periods between two stats() readings in which each group was
    throttled (ran out of its quota): near 1 means the process wanted more than its cores."""
    out = []
    for a, b in zip(before, after):
        if a["periods"] is None or b["periods"] is None or b["periods"] == a["periods"]:
            out.append(None if a["periods"] is None or b["periods"] is None else 0.0)
        else:
            out.append(round((b["throttled"] - a["throttled"]) / (b["periods"] - a["periods"]), 2))
    return out
