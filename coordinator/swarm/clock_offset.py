"""Each node's wall-clock offset against the coordinator's, NTP-style, from Ping/Pong.

Every `interval_s` the coordinator sends each member a small Ping on its control stream,
noting its own wall clock and monotonic clock; the node answers with a Pong stamped with
its wall clock (`Pong.clock_s`). With rtt the round trip, the node's clock was read
somewhere within it, so offset = t_node - (t_sent + rtt/2) is off by at most rtt/2: the
difference of the two directions' delays, halved. `estimate` keeps the minimum-RTT
samples of a window; `ClockOffsets` holds them per peer; `keep_measuring` is the loop.
hop_times subtracts a stage's `applied_s` from its stamps. Knows nothing of rings'
plans, HTTP or Prometheus.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import trio

from shard.transport import TransportError
from shard.wire.messages import Ping, Pong

SAMPLES_PER_PEER = 16  # the window the minimum-RTT sample is chosen from
PING_INTERVAL_S = 2.0  # ~40 bytes each way per node: cheap, and a new node is measured within seconds
MAX_PENDING = 1024  # unanswered Pings remembered (a node that never answers cannot grow it)


@dataclass(frozen=True)
class Sample:
    sent_s: float  # coordinator wall clock when the Ping left
    rtt_s: float  # coordinator monotonic round trip
    node_s: float  # node wall clock in its Pong


@dataclass(frozen=True)
class Estimate:
    offset_s: float  # node clock minus coordinator clock
    uncertainty_s: float  # |true offset - offset_s| <= this (rtt/2 of the sample used)
    samples: int

    @property
    def applied_s(self) -> float:
        """What hop_times subtracts: 0 when the round trips cannot tell the clocks apart
        (|offset| within its uncertainty). Clocks on one machine, or kept by NTP to well
        under a round trip, then stay exact: the midpoint would add the link's asymmetry
        (up to rtt/2) to stamps that carried no error."""
        return self.offset_s if abs(self.offset_s) > self.uncertainty_s else 0.0


def sample_offset_s(sample: Sample) -> float:
    return sample.node_s - (sample.sent_s + sample.rtt_s / 2)


def estimate(samples: Iterable[Sample]) -> Estimate | None:
    """The offset from the minimum-RTT sample (None: no samples). Why the minimum: a
    sample's error is bounded by half its round trip, and queueing (on the uplink, in
    a busy event loop) only ever lengthens a round trip and mostly one direction, so the
    fastest round trip is the one least skewed (NTP's clock filter makes the same choice;
    a mean would average the queueing asymmetry in)."""
    samples = list(samples)
    if not samples:
        return None
    best = min(samples, key=lambda s: s.rtt_s)
    return Estimate(sample_offset_s(best), best.rtt_s / 2, len(samples))


class ClockOffsets:
    """Per peer: recent samples and Pings still unanswered. `wall`, `mono`: the
    coordinator's clocks (the wall clock is the one its own stamps use)."""

    def __init__(self, wall: Callable[[], float] = time.time, mono: Callable[[], float] = time.monotonic,
                 window: int = SAMPLES_PER_PEER) -> None:
        self.wall, self.mono, self.window = wall, mono, window
        self.samples: dict[str, deque[Sample]] = {}
        self._pending: dict[int, tuple[str, float, float]] = {}  # nonce -> (peer, wall, monotonic)
        self._nonces = itertools.count(1)

    def ping(self, peer: str) -> Ping:
        nonce = next(self._nonces)
        while len(self._pending) >= MAX_PENDING:
            self._pending.pop(next(iter(self._pending)))
        sent_s = self.wall()
        self._pending[nonce] = (peer, sent_s, self.mono())
        return Ping(nonce=nonce, sent_ns=int(sent_s * 1e9))

    def pong(self, peer: str, msg: Pong) -> None:
        """A Pong from `peer`. Ignored unless it answers a Ping we sent that peer and
        carries a clock (a node predating Pong.clock_s sends none)."""
        pending = self._pending.get(msg.nonce)
        if pending is None or pending[0] != peer or msg.clock_s is None:
            return
        del self._pending[msg.nonce]
        self.samples.setdefault(peer, deque(maxlen=self.window)).append(
            Sample(pending[1], self.mono() - pending[2], msg.clock_s))

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the peers not in `keep` (they left)."""
        keep = set(keep)
        for peer in set(self.samples) - keep:
            del self.samples[peer]

    def get(self, peer: str) -> Estimate | None:
        return estimate(self.samples.get(peer, ()))

    def stage_offsets_s(self, peers: Sequence[str]) -> tuple[float, ...]:
        """Each stage's applied offset, in ring order (0 for one not measured yet)."""
        return tuple(e.applied_s if (e := self.get(p)) is not None else 0.0 for p in peers)

    def summary(self) -> dict[str, dict[str, float | int]]:
        """Per peer: offset, uncertainty, what hop times apply, and the samples it is over
        (GET /v1/ring's topology.clocks)."""
        out = {}
        for peer in sorted(self.samples):
            if (e := self.get(peer)) is not None:
                out[peer] = {"offset_s": e.offset_s, "uncertainty_s": e.uncertainty_s, "applied_s": e.applied_s,
                             "samples": e.samples}
        return out


async def keep_measuring(clocks: ClockOffsets, peers: Callable[[], Iterable[str]],
                         send: Callable[[str, Ping], Awaitable[None]], interval_s: float = PING_INTERVAL_S) -> None:
    """Ping every member now and every `interval_s`. Never returns. Error handling: a
    peer whose stream fails is skipped (the swarm notices it leaving)."""
    while True:
        members = sorted(peers())
        clocks.forget(members)
        for peer in members:
            try:
                await send(peer, clocks.ping(peer))
            except TransportError:
                pass
        await trio.sleep(interval_s)
