"""Weights from peers, the coordinator's part: the signed manifest, who holds which files,
and how fetches went against their prediction.

On `/shard/sources/1.0.0` (one request per stream) a node asks for the model's manifest
(answered signed with the coordinator's identity key, so a node with no weights knows what
to fetch and that the digest is the ring's), for the sources of the files it lacks (the
registered nodes that hold each file, best uplink first, never the asker or a node audits
excluded; the coordinator itself only where no node holds a file), and reports a finished
fetch (kept with its prediction for /v1/ring). The coordinator also serves its own store
on `/shard/weights/1.0.0` at the rate the selector's move plan assumes for it.
Holder choice and the log are pure; knows nothing of how rings are chosen or formed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from coordinator.swarm import topology
from ring import ChurnPolicy, PeerId, RingError, Stage, fetch_seconds, plan_moves
from shard.errors import TransportError, WireError
from shard.layers import LayerRange
from shard.manifest import is_weight_file, layer_file, slice_files
from shard.store import ModelStore, stored_weight_files
from shard.transport import FramedStream
from shard.weight_plan import WeightsConfig
from shard.weight_server import WeightServer
from shard.wire.codec import decode, encode
from shard.wire.messages import Register
from shard.wire.weight_messages import (MAX_SOURCES_PER_FILE, SOURCES_LIMITS, FetchReport, ManifestRequest,
                                        SignedManifest, Sources, SourcesRequest, manifest_signing_bytes)

log = logging.getLogger("shard.coordinator")


def files_held(register: Register, loaded: LayerRange | None) -> frozenset[str]:
    """The weight files a node holds: those it registered as stored, and its loaded slice's."""
    return frozenset(register.stored_files) | frozenset(slice_files(loaded) if loaded is not None else ())


def held_or_stored(registrations: Mapping[PeerId, Register], loaded: Mapping[PeerId, LayerRange],
                   num_layers: int) -> dict[PeerId, LayerRange]:
    """What each node holds as the selector's move plan should see it: its loaded slice, else
    the longest run of consecutive layers whose files it stores (a node that holds the whole
    model on disk moves nothing over the network to serve any slice; a node that joined
    empty holds what it fetched). Ties go to the lowest layers."""
    out = dict(loaded)
    for peer, reg in registrations.items():
        if peer in out:
            continue
        stored = set(reg.stored_files)
        best, run_start = None, None
        for i in range(num_layers + 1):
            if i < num_layers and layer_file(i) in stored:
                run_start = i if run_start is None else run_start
                continue
            if run_start is not None and (best is None or i - run_start > len(best)):
                best = LayerRange(run_start, i)
            run_start = None
        if best is not None:
            out[peer] = best
    return out


def holders(files: Iterable[str], held: Mapping[PeerId, frozenset[str]], uploads: Mapping[PeerId, float],
            asker: PeerId, coordinator: PeerId, coordinator_files: frozenset[str]) -> dict[str, tuple[PeerId, ...]]:
    """file -> the peers to fetch it from: nodes holding it, best upload first (ties by peer
    id), at most MAX_SOURCES_PER_FILE, never the asker; the coordinator only when no node holds it."""
    out = {}
    for f in files:
        nodes = sorted((p for p, fs in held.items() if f in fs and p != asker), key=lambda p: (-uploads.get(p, 0.0), p))
        out[f] = tuple(nodes[:MAX_SOURCES_PER_FILE]) or ((coordinator,) if f in coordinator_files else ())
    return out


def predicted_fetch_s(nbytes: int, files: Mapping[str, tuple[PeerId, ...]], download_bytes_per_s: float,
                      uploads: Mapping[PeerId, float], coordinator: PeerId, policy: ChurnPolicy) -> float | None:
    """What ring.churn.fetch_seconds predicts for fetching `nbytes` in these files from these
    holders (the coordinator at its origin rate); None when some file has no holder."""
    sources = {p for hs in files.values() for p in hs}
    if not files or any(not hs for hs in files.values()):
        return None
    rates = [policy.origin_upload_bytes_per_s / policy.seed_upload_share if p == coordinator else uploads.get(p, 0.0)
             for p in sources]
    try:
        return fetch_seconds(nbytes, len(files), download_bytes_per_s, rates, policy.seed_upload_share)
    except RingError:
        return None


@dataclass(frozen=True)
class FetchRecord:
    peer: PeerId
    layers: LayerRange
    files: int
    bytes: int
    measured_s: float
    predicted_s: float | None  # ring.churn.fetch_seconds over the sources handed out
    plan_move_s: float | None  # ring.churn.plan_moves for this peer and slice, as the selector costs it
    by_source: Mapping[str, int]
    excluded: Mapping[str, str]
    at_unix_s: float
    error: str = ""  # why the fetch failed ("": it did not)


@dataclass
class FetchLog:
    """Recent fetches nodes reported, with their predictions (a bounded window)."""

    window: int = 64
    records: deque[FetchRecord] = field(default_factory=deque)

    def add(self, record: FetchRecord) -> None:
        self.records.append(record)
        while len(self.records) > self.window:
            self.records.popleft()

    def summary(self) -> list[dict[str, Any]]:
        return [{"peer": r.peer, "layers": [r.layers.start, r.layers.end], "files": r.files, "bytes": r.bytes,
                 "measured_s": r.measured_s, "predicted_s": r.predicted_s, "plan_move_s": r.plan_move_s,
                 "measured_bytes_per_s": r.bytes / r.measured_s if r.measured_s > 0 else None,
                 "by_source": dict(r.by_source), "excluded": dict(r.excluded), "at_unix_s": r.at_unix_s,
                 "error": r.error or None}
                for r in self.records]


class Seeding:
    """Serves `/shard/sources/1.0.0` for `swarm` (its members, what they hold, the plan)
    and the coordinator's own `store` on `/shard/weights/1.0.0` (`self.server`)."""

    def __init__(self, swarm, store: ModelStore, signing_key: bytes, policy: ChurnPolicy, fetches: FetchLog) -> None:
        self.swarm, self.store, self.policy, self.fetches = swarm, store, policy, fetches
        self.manifest_json = store.manifest.to_json().encode()
        key = Ed25519PrivateKey.from_private_bytes(signing_key)
        self.signed = SignedManifest(manifest=self.manifest_json, signature=key.sign(manifest_signing_bytes(self.manifest_json)))
        self.server = WeightServer(store.root, store.manifest, WeightsConfig(seed_upload_share=1.0),
                                   upload_bytes_per_s=policy.origin_upload_bytes_per_s)
        # peer -> (layers, fetch_seconds over the sources handed out, the move plan's seconds)
        self._predicted: dict[PeerId, tuple[LayerRange, float | None, float | None]] = {}

    async def handle(self, stream: FramedStream) -> None:
        """Answer one request. Error handling: a malformed one ends the stream (logged)."""
        peer = PeerId(stream.remote_peer_id)
        try:
            msg = decode(await stream.recv_frame(SOURCES_LIMITS.max_frame_bytes), SOURCES_LIMITS)
            if isinstance(msg, ManifestRequest):
                await stream.send_frame(encode(self.signed, SOURCES_LIMITS))
            elif isinstance(msg, SourcesRequest):
                await stream.send_frame(encode(self.sources(peer, msg), SOURCES_LIMITS))
            elif isinstance(msg, FetchReport):
                self.record(peer, msg)
            else:
                log.warning("ignoring %s from %s on the sources protocol", msg.KIND, peer)
        except (TransportError, WireError) as exc:
            log.info("sources request from %s failed: %s", peer, exc)

    def sources(self, asker: PeerId, req: SourcesRequest) -> Sources:
        manifest = self.store.manifest
        files = [f for f in req.files if f in manifest.files and is_weight_file(f)]
        if req.manifest_digest != manifest.digest:
            files = []  # another model: nobody here holds its files
        members = {p: m for p, m in self.swarm.members.items() if p not in self.swarm.faulty}
        held = {p: files_held(m.register, self.swarm.held.get(p)) for p, m in members.items()}
        uploads = {p: m.register.upload_bytes_per_s for p, m in members.items()}
        coordinator = PeerId(self.swarm.peer_id)
        here = frozenset(stored_weight_files(self.store.root, manifest))  # a layerless gateway holds few
        chosen = holders(files, held, uploads, asker, coordinator, here)
        addrs = {p: members[p].register.listen_addrs[:16] for hs in chosen.values() for p in hs if p in members}
        asking = members.get(asker)
        if req.layer_end > req.layer_start:
            download = asking.register.download_bytes_per_s if asking is not None else float("inf")
            nbytes = sum(manifest.files[f].bytes for f in files)
            layers = LayerRange(req.layer_start, req.layer_end)
            self._predicted[asker] = (layers, predicted_fetch_s(nbytes, chosen, download, uploads, coordinator,
                                                                self.policy), self._plan_move_s(asker, layers))
        log.info("sources for %s's %d files: %s", asker[-8:], len(files),
                 ", ".join(sorted({p[-8:] for hs in chosen.values() for p in hs})) or "none")
        return Sources(holders=chosen, addrs=addrs,
                       upload_bytes_per_s={p: uploads.get(p, self.policy.origin_upload_bytes_per_s)
                                           for hs in chosen.values() for p in hs})

    def _plan_move_s(self, peer: PeerId, layers: LayerRange) -> float | None:
        """What the selector's move plan charges `peer` for taking `layers` (ring.churn.plan_moves
        on the pool as formation sees it, weights on disk included); None if it cannot say."""
        snap = self.swarm.snapshot()
        if peer not in snap.registrations:
            return None
        regs = snap.registrations
        try:
            network = topology.build_network(snap.coordinator, regs, snap.links,
                                             held_or_stored(regs, snap.held, self.swarm.model.num_layers),
                                             self.swarm.config.topology, self.swarm.model)
            moves, _ = plan_moves([Stage(peer, layers)], network, self.swarm.model, self.policy)
        except RingError:
            return None
        return moves[0].seconds if moves else 0.0

    def record(self, peer: PeerId, report: FetchReport) -> None:
        if report.peer_id != peer or report.layer_end <= report.layer_start:
            log.warning("ignoring a fetch report from %s about %s", peer, report.peer_id)
            return
        layers = LayerRange(report.layer_start, report.layer_end)
        predicted_layers, predicted, planned = self._predicted.pop(peer, (None, None, None))
        if predicted_layers != layers:
            predicted = planned = None
        record = FetchRecord(peer, layers, report.files, report.bytes, report.seconds, predicted, planned,
                             report.by_source, report.excluded, time.time(), report.error)
        self.fetches.add(record)
        if report.error:  # it cannot serve that slice: seat the ring without it (it sits out a backoff)
            log.warning("node %s could not fetch layers %s: %s", peer[-8:], layers, report.error)
            self.swarm.report_unreachable(peer, f"could not fetch its slice {layers}: {report.error}")
            return
        log.info("node %s fetched layers %s: %.1f MB in %.1f s (predicted %s)%s", peer[-8:], layers, report.bytes / 1e6,
                 report.seconds, f"{predicted:.1f} s" if record.predicted_s is not None else "-",
                 f", excluded {sorted(report.excluded)}" if report.excluded else "")
