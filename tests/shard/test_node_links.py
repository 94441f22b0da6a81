"""A node's probe server holds bounded resources for strangers, and its link report fails
entry by entry (shard.node_links).

Bug guarded: any peer could open probe streams without bound and keep each forever (the
issue's red team buffered 600 MB on the probe protocol). Sound: a peer's third concurrent
probe stream is reset unread while its two others still echo, and a probe stream the
peer leaves open is closed by the node after twice probe_timeout_s (0.5 s here).
"""

from __future__ import annotations

import logging
import os

import pytest
import trio
from libp2p.peer.id import ID

from shard import node_links
from shard.identity import keypair_from_seed
from shard.linkprobe import PROBE_PROTOCOL, measure_rtt
from shard.node_links import MAX_PROBE_STREAMS_PER_PEER, NodeLinks
from shard.transport import TransportError, open_host
from shard.wire.messages import LinkReport, ProbePeers


async def _no_control(msg) -> None:
    raise AssertionError("probes answer on their own stream, not the control stream")


def test_a_peer_holds_few_probe_streams_and_none_forever():
    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as node, \
                open_host(keypair_from_seed(os.urandom(32))) as peer:
            links = NodeLinks(node, _no_control, probe_timeout_s=0.5)
            node.set_handler(PROBE_PROTOCOL, links.on_probe_stream)
            with trio.fail_after(20):
                await peer.connect(node.addrs[0])
                kept = [await peer.open_stream(node.peer_id, PROBE_PROTOCOL) for _ in range(MAX_PROBE_STREAMS_PER_PEER)]
                for stream in kept:
                    assert (await measure_rtt(stream, 1)).min_s > 0
                with pytest.raises(TransportError):
                    extra = await peer.open_stream(node.peer_id, PROBE_PROTOCOL)
                    await measure_rtt(extra, 1)
                for stream in kept:  # left open by the peer: closed by the node within 1 s
                    with pytest.raises(TransportError):
                        await stream.recv_frame(1 << 10)

    trio.run(main)


def test_a_malformed_entry_or_a_probe_that_raises_costs_only_that_entry(monkeypatch, caplog):
    # Bug guarded: NodeLinks.report caught only transport errors, so a bug in one peer's
    # probe (or in the bandwidth probe) raised out of the node's session task and restarted
    # the session, and no LinkReport was sent for the peers that were measured. Sound: the
    # report runs against a real reachable peer, a stranger given malformed or unusable
    # addresses, and a peer whose probe is made to raise a non-transport error; the report
    # must still go out once, holding exactly the reachable peer, and report() must return.
    caplog.set_level(logging.INFO, logger="shard.node")
    honest = node_links.measure_rtt

    async def buggy(link, n):
        if link.remote_peer_id == buggy.peer:
            raise KeyError("a bug in the probe")
        return await honest(link, n)

    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as node, \
                open_host(keypair_from_seed(os.urandom(32))) as good, \
                open_host(keypair_from_seed(os.urandom(32))) as cursed:
            sent = []

            async def send_control(msg) -> None:
                sent.append(msg)

            for peer in (good, cursed):
                peer.set_handler(PROBE_PROTOCOL, NodeLinks(peer, _no_control).on_probe_stream)
            buggy.peer = cursed.peer_id
            stranger = keypair_from_seed(os.urandom(32))
            stranger_id = ID.from_pubkey(stranger.public_key).to_base58()
            links = NodeLinks(node, send_control, probe_timeout_s=5)
            req = ProbePeers(peers={good.peer_id: (good.addrs[0],), cursed.peer_id: (cursed.addrs[0],),
                                    stranger_id: ("garbage", "/ip4/300.1.1.1/tcp/1", f"/p2p-circuit/p2p/{stranger_id}")})
            with trio.fail_after(20):
                await links.report(req, "coordinator")
            return sent, good.peer_id, cursed.peer_id, stranger_id

    monkeypatch.setattr(node_links, "measure_rtt", buggy)
    sent, good_id, cursed_id, stranger_id = trio.run(main)
    [report] = sent
    assert isinstance(report, LinkReport) and set(report.rtt_ms) == {good_id} and report.rtt_ms[good_id] > 0
    assert f"no round trip to {cursed_id}: KeyError: 'a bug in the probe'" in caplog.messages
    assert any(m.startswith(f"no round trip to {stranger_id}") for m in caplog.messages)


def test_a_bandwidth_probe_that_raises_leaves_the_round_trips_reported(monkeypatch, caplog):
    # The same for the coordinator's bandwidth probe: its bug costs the bandwidth figures
    # (and the coordinator's round trip) alone; the report still goes, with the peers'.
    caplog.set_level(logging.INFO, logger="shard.node")

    async def broken(self, nbytes):
        raise ZeroDivisionError("a bug in the bandwidth probe")

    async def main():
        async with open_host(keypair_from_seed(os.urandom(32))) as node, \
                open_host(keypair_from_seed(os.urandom(32))) as good:
            sent = []

            async def send_control(msg) -> None:
                sent.append(msg)

            good.set_handler(PROBE_PROTOCOL, NodeLinks(good, _no_control).on_probe_stream)
            with trio.fail_after(20):
                await NodeLinks(node, send_control).report(ProbePeers(peers={good.peer_id: (good.addrs[0],)},
                                                                      bandwidth_bytes=1 << 16), "coordinator")
            return sent, good.peer_id

    monkeypatch.setattr(NodeLinks, "probe_coordinator", broken)
    [report], good_id = trio.run(main)
    assert set(report.rtt_ms) == {good_id} and report.upload_bytes_per_s is None and report.download_bytes_per_s is None
    assert "no bandwidth probe to the coordinator: ZeroDivisionError: a bug in the bandwidth probe" in caplog.messages
