"""A volunteer node: register with the coordinator, take an assignment, serve ring frames.

The I/O half of a stage (trio + libp2p). It measures what it can do (compute, and its
round trip, upload and download to the coordinator; later the round trips to the peers
the coordinator names), registers, loads only the slice its signed assignment names,
accepts ring frames only from the peer that the current epoch names as its predecessor
(identity from the Noise handshake), runs each frame in a worker thread so the network
never waits on a forward, and ships the output to its successor (or straight back to the
coordinator when it is the tail). Every stream it sends on crosses the node's one
emulated uplink, and its probes measure those same links (`shard.node_links`).
It does not choose rings, schedule requests or look inside activations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
import trio
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from libp2p.peer.id import ID

from shard.errors import ShardError, WireError
from shard.frame_log import FrameLog
from shard.layers import LayerRange
from shard.linkprobe import PROBE_PROTOCOL
from shard.node_links import NodeLinks
from shard.options import option
from shard.receipt_signer import make_signer
from shard.ring_observer import NO_OBSERVER, RingObserver
from shard.sources import DEFAULT_MODEL
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import ModelStore, open_or_prepare
from shard.transport import FramedStream, Host, TransportError
from shard.wire.codec import decode, decode_frame, encode
from shard.wire.dtypes import COMPUTE_DTYPES
from shard.wire.limits import Limits
from shard.wire.messages import (ROLE_STAGE, Assignment, AuditReply, AuditRequest, EndJob, Forward, JobError,
                                 Ping, Pong, ProbePeers, Ready, Register)

log = logging.getLogger("shard.node")

CONTROL_PROTOCOL = "/shard/control/1.0.0"
RING_PROTOCOL = "/shard/ring/1.0.0"
# Frames computed and waiting for the uplink. Sending runs in its own task so a stage
# computes frame r+1 while frame r uploads (a chunked prefill would otherwise idle every
# stage for each chunk's serialisation); this bound is the backpressure that keeps a slow
# uplink from piling up outputs in memory.
OUTBOX_FRAMES = 4
# Frames read off a ring stream ahead of the one being computed: the predecessor's upload
# then lands while this stage computes instead of after (a muxed stream's window would
# otherwise stall a large frame until the reader comes back).
INBOX_FRAMES = 2


@dataclass(frozen=True)
class NodeConfig:
    """Everything `shard-node join` takes; the CLI is derived from these fields."""

    coordinator: str = option(help="the coordinator's multiaddr, ending in /p2p/<its peer id>")
    model: str = option(DEFAULT_MODEL, "model alias, HF dir or GGUF file (prepared into the store once)")
    store_dir: str | None = option(None, "model store dir (default: the shard cache)")
    key_path: str | None = option(None, "identity key file (default: <cache>/node.key)")
    listen: str = option("/ip4/127.0.0.1/tcp/0", "libp2p listen multiaddr")
    device: str = option("cpu", "torch device for this node's layers")
    dtype: str = option("float32", "compute dtype of this node's layers", choices=tuple(COMPUTE_DTYPES))
    max_memory_bytes: int = option(4 << 30, "weights + KV cache this node may use")
    torch_threads: int = option(0, "torch threads (0 = torch's default)")
    link_latency_ms: float = option(0.0, "emulated one-way latency on this node's outgoing ring edge")
    link_upload_mbps: float = option(0.0, "emulated uplink in Mbit/s (0 = unlimited)")
    link_jitter_ms: float = option(0.0, "emulated jitter on this node's outgoing ring edge")
    probe_bytes: int = option(256 << 10, "payload timing upload and download to the coordinator")
    probe_timeout_s: float = option(30.0, "one link probe; a peer that does not answer is left unmeasured")
    # Sign a receipt per frame and log frames for audits. Off only to measure their cost:
    # a coordinator that checks receipts fails every job through a node that does not sign.
    receipts: bool = option(True, "sign a receipt per frame and log frames for audits (off only to measure "
                                  "their cost)")


def public_key_of_peer(peer_id: str) -> bytes:
    """Raw Ed25519 public key embedded in an Ed25519 libp2p peer id."""
    key = ID.from_base58(peer_id).extract_public_key()
    if key is None:
        raise ShardError(f"peer id {peer_id} does not embed its public key")
    return key.to_bytes()


def verify_assignment(a: Assignment, coordinator_peer_id: str) -> None:
    try:
        Ed25519PublicKey.from_public_bytes(public_key_of_peer(coordinator_peer_id)).verify(a.signature, a.signing_bytes())
    except (InvalidSignature, ValueError) as exc:
        raise ShardError(f"assignment for epoch {a.epoch} is not signed by the coordinator {coordinator_peer_id}") from exc


def measure_compute(store: ModelStore, dtype: torch.dtype, device: str) -> tuple[float, float]:
    """(decode seconds per layer per token, prefill seconds per layer per token), measured
    on layer 0 of this model: a short self-benchmark run once at start-up."""
    from shard.kvcache import KVCache

    cfg = store.config
    r = LayerRange(0, 1)
    stage = Stage(cfg, r, store.load_layers(r, dtype, device), dtype=dtype, device=device)
    cache = KVCache(1, cfg.num_kv_heads, cfg.head_dim, dtype, 1 << 30, device)
    job = cache.open("bench", 512)
    x = torch.randn(128, cfg.hidden_size, dtype=dtype)

    def timed(t: int) -> float:
        t0 = time.perf_counter()
        stage.forward(job, x[:t], ctx_len=0 if t > 1 else 128, positions=torch.arange(t) + (0 if t > 1 else 128))
        return time.perf_counter() - t0

    timed(128)
    # The minimum, not the median: other processes only ever add time, so the fastest run
    # is the best estimate of what this node can do.
    prefill = min(timed(128) for _ in range(3)) / 128
    decode = min(timed(1) for _ in range(8))
    return decode, prefill


@dataclass
class EpochState:
    assignment: Assignment
    worker: StageWorker
    predecessor: str  # peer id allowed to send us frames this epoch
    successor: str  # peer id we send to (the coordinator when tail)


@dataclass
class Node:
    config: NodeConfig
    host: Host
    store: ModelStore
    coordinator_id: str = ""
    state: EpochState | None = None
    compute_limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    control_lock: trio.Lock = field(default_factory=trio.Lock)
    control: FramedStream | None = None
    limits: Limits = field(default_factory=Limits)
    signing_seed: bytes | None = None  # the identity's Ed25519 seed; None = do not sign receipts
    frame_log: FrameLog = field(default_factory=FrameLog)
    _out_streams: dict[str, object] = field(default_factory=dict)
    _outbox: trio.MemorySendChannel | None = None  # (state, body, frame it answers) for _send_ring_loop
    links: NodeLinks | None = None  # set in __post_init__: emulation and probes
    _tasks: trio.Nursery | None = None
    _warm: Stage | None = None  # a slice kept loaded for an off-ring role (e.g. hot standby)
    observer: RingObserver = NO_OBSERVER  # what a benchmark watches of this node's frames

    def __post_init__(self) -> None:
        cfg = self.config
        self.links = NodeLinks(self.host, self._send_control, cfg.link_latency_ms, cfg.link_upload_mbps,
                               cfg.link_jitter_ms, cfg.probe_timeout_s)

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register and serve until cancelled. Error handling: a bad frame, failed job or
        failed probe is reported and logged, never fatal; losing the coordinator's control
        stream is fatal. Resource handling: all tasks live in this call's nursery."""
        cfg = self.config
        self.limits = Limits.for_model(self.store.config, max_tokens_per_frame=2048)
        dtype = COMPUTE_DTYPES[cfg.dtype]
        decode_s, prefill_s = await trio.to_thread.run_sync(measure_compute, self.store, dtype, cfg.device)
        self.coordinator_id = await self.host.connect(cfg.coordinator)
        self.host.set_handler(RING_PROTOCOL, self._on_ring_stream)
        self.host.set_handler(PROBE_PROTOCOL, self.links.on_probe_stream)
        control = await self.host.open_stream(self.coordinator_id, CONTROL_PROTOCOL)
        try:
            await self._serve_registered(control, decode_s, prefill_s, task_status)
        finally:
            # Leaving (cancelled or failed) closes the control stream: the coordinator
            # re-forms at once instead of waiting for a ring frame to time out.
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                await control.aclose()

    async def _serve_registered(self, control: FramedStream, decode_s: float, prefill_s: float, task_status) -> None:
        cfg = self.config
        async with trio.open_nursery() as self._tasks:  # control reader, ring sender, probes, emulated-link pumps
            self.links.nursery = self._tasks
            self.control = await self.links.emulate(control)
            self._outbox, outbox = trio.open_memory_channel(OUTBOX_FRAMES)
            self._tasks.start_soon(self._send_ring_loop, outbox)
            self._tasks.start_soon(self._serve_control)
            rtt_s, upload, download = await self.links.probe_coordinator(cfg.probe_bytes)
            await self._send_control(Register(
                peer_id=self.host.peer_id, model=cfg.model, manifest_digest=self.store.digest, device=cfg.device,
                memory_bytes=cfg.max_memory_bytes, decode_s_per_layer=decode_s, prefill_s_per_layer_token=prefill_s,
                upload_bytes_per_s=upload, download_bytes_per_s=download, rtt_ms={self.coordinator_id: rtt_s * 1e3},
                listen_addrs=tuple(self.host.addrs),
            ))
            log.info("registered with %s (decode %.2f ms/layer, prefill %.3f ms/layer/token, rtt %.1f ms, "
                     "up %.1f / down %.1f Mbit/s)", self.coordinator_id, decode_s * 1e3, prefill_s * 1e3, rtt_s * 1e3,
                     upload * 8e-6, download * 8e-6)
            task_status.started()

    async def _serve_control(self) -> None:
        while True:
            msg = decode(await self.control.recv_frame(self.limits.max_frame_bytes), self.limits)
            if isinstance(msg, Assignment):
                await self._assume(msg)
            elif isinstance(msg, Pong):
                self.links.pong(msg.nonce)
            elif isinstance(msg, Ping):
                await self._send_control(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns, payload=bytes(msg.reply_bytes)))
            elif isinstance(msg, ProbePeers):
                self._tasks.start_soon(self.links.report, msg, self.coordinator_id)
            elif isinstance(msg, AuditRequest):
                await self._send_control(self._audit_reply(msg))
            else:
                log.warning("ignoring %s on the control stream", type(msg).__name__)

    def _audit_reply(self, req: AuditRequest) -> AuditReply:
        """The logged canonical bytes of one side of one frame (None if not kept)."""
        rec = self.frame_log.get(req.job_id, req.epoch, req.round)
        data = None if rec is None else (rec.input_frame if req.side == "input" else rec.output_frame)
        frame = None if data is None else torch.frombuffer(bytearray(data), dtype=torch.uint8)  # (nbytes,)
        return AuditReply(job_id=req.job_id, epoch=req.epoch, round=req.round, side=req.side, frame=frame)

    async def _send_control(self, msg) -> None:
        async with self.control_lock:
            await self.control.send_frame(encode(msg))

    async def _assume(self, a: Assignment) -> None:
        verify_assignment(a, self.coordinator_id)
        if a.manifest_digest != self.store.digest:
            raise ShardError(f"assignment names model digest {a.manifest_digest[:12]}, this node holds {self.store.digest[:12]}")
        # A role off the ring may hold nothing: the wire's empty [0, 0) is no LayerRange.
        r = LayerRange(a.layer_start, a.layer_end) if a.layer_end > a.layer_start else None
        old = self.state
        if r is None:
            stage = None
        elif old is not None and old.worker.stage.layers == r:
            stage = old.worker.stage  # same slice: keep the weights, drop the caches
        elif self._warm is not None and self._warm.layers == r:
            stage = self._warm  # kept warm for exactly this (hot standby)
        else:
            stage = await trio.to_thread.run_sync(self._load_stage, r)
        if a.role != ROLE_STAGE:
            # Off the ring: refuse every ring frame this epoch, keep the named slice warm.
            self.state, self._warm = None, stage
            self._out_streams.clear()
            log.info("epoch %d: off the ring as %s, keeping layers %s warm", a.epoch, a.role, r or "none")
            await self._send_control(Ready(peer_id=self.host.peer_id, epoch=a.epoch))
            return
        self._warm = None
        signer = None
        if self.config.receipts and self.signing_seed is not None:
            signer = make_signer(self.signing_seed, self.store, a, self.frame_log)
        worker = StageWorker(stage, WorkerConfig(
            wire_dtype=a.wire_dtype, aux_dtype=a.aux_dtype, is_tail=a.successor is None,
            max_context_tokens=self.store.config.max_context_tokens,
            max_kv_bytes=max(self.config.max_memory_bytes - self.store.layer_bytes(r), 64 << 20),
        ), signer=signer)
        self.state = EpochState(a, worker, a.predecessor or self.coordinator_id, a.successor or self.coordinator_id)
        self._out_streams.clear()
        log.info("epoch %d: serving layers %s as %s (pred %s, succ %s)", a.epoch, r, a.role,
                 a.predecessor or "coordinator", a.successor or "coordinator")
        await self._send_control(Ready(peer_id=self.host.peer_id, epoch=a.epoch))

    def _load_stage(self, r: LayerRange) -> Stage:
        cfg, dtype = self.store.config, COMPUTE_DTYPES[self.config.dtype]
        weights = self.store.load_layers(r, dtype, self.config.device)
        embedding = self.store.load_embedding(dtype, self.config.device) if r.start == 0 else None
        return Stage(cfg, r, weights, dtype=dtype, device=self.config.device, embedding=embedding)

    async def _on_ring_stream(self, stream: FramedStream) -> None:
        """Serve one incoming ring stream: frames are read ahead (INBOX_FRAMES) and
        processed in order; the first frame from a peer that is not this epoch's
        predecessor closes the stream."""
        remote = stream.remote_peer_id
        inbox_send, inbox = trio.open_memory_channel(INBOX_FRAMES)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read_ring_stream, stream, inbox_send)
                async for body in inbox:
                    state = self.state
                    if state is None or remote != state.predecessor:
                        log.warning("refused a frame from %s: not the predecessor of epoch %s",
                                    remote, state.assignment.epoch if state else "-")
                        nursery.cancel_scope.cancel()
                        break
                    try:
                        msg, canonical_len = decode_frame(body, self.limits)
                    except WireError as exc:
                        log.warning("dropped a malformed frame from %s: %s", remote, exc)
                        continue
                    await self._handle(state, msg, memoryview(body)[:canonical_len])
        finally:
            await stream.aclose()

    async def _read_ring_stream(self, stream: FramedStream, inbox: trio.MemorySendChannel) -> None:
        """Read frames into `inbox` until the stream ends or breaks (then close it, which
        ends the processing loop once the frames already read are done)."""
        remote = stream.remote_peer_id
        async with inbox:
            while True:
                try:
                    body = await stream.recv_frame(self.limits.max_frame_bytes)
                except WireError as exc:  # a length past the cap: the stream is out of sync
                    log.warning("closing ring stream from %s: %s", remote, exc)
                    return
                except TransportError as exc:
                    log.info("ring stream from %s ended: %s", remote, exc)
                    return
                await inbox.send(body)

    async def _handle(self, state: EpochState, msg, received: memoryview) -> None:
        """`received`: msg's canonical bytes as they arrived (what its receipt hashes)."""
        if isinstance(msg, EndJob):
            state.worker.end_job(msg.job_id)
            self.frame_log.end_job(msg.job_id)
            if state.assignment.successor is not None:
                await self._outbox.send((state, encode(msg), None))
            return
        if not isinstance(msg, Forward):
            log.warning("ignoring %s on a ring stream", type(msg).__name__)
            return
        if msg.epoch != state.assignment.epoch:
            await self._job_error(msg, "stale_epoch", f"frame for epoch {msg.epoch}, serving {state.assignment.epoch}")
            return
        self.observer.stage_received(self.host.peer_id, msg)
        try:
            _, out = await trio.to_thread.run_sync(state.worker.process_frame, msg, received, limiter=self.compute_limiter)
        except ShardError as exc:
            log.warning("job %s round %d failed: %s", msg.job_id, msg.round, exc)
            await self._job_error(msg, type(exc).__name__, str(exc))
            return
        self.observer.stage_computed(self.host.peer_id, msg)
        await self._outbox.send((state, out, msg))  # returns at once unless OUTBOX_FRAMES wait

    async def _send_ring_loop(self, outbox: trio.MemoryReceiveChannel) -> None:
        """Send computed frames to the successor in the order they were computed. A frame
        of an epoch this node no longer serves is dropped (the coordinator ignores its
        result and resumes the job on the new ring). Error handling: a send failure fails
        that frame's job (JobError to the coordinator) and the next frame re-dials."""
        async for state, body, answers in outbox:
            if state is not self.state:
                continue
            try:
                await self._send_ring(state, body)
            except TransportError as exc:
                self._out_streams.pop(state.successor, None)
                if answers is not None:
                    await self._job_error(answers, "successor_unreachable", str(exc))
                else:
                    log.info("could not forward an end of job to %s: %s", state.successor, exc)

    async def _job_error(self, msg: Forward, code: str, text: str) -> None:
        if self.state is not None:
            self.state.worker.end_job(msg.job_id)  # the coordinator re-prefills it if it retries
        await self._send_control(JobError(job_id=msg.job_id, epoch=msg.epoch, round=msg.round, code=code[:64],
                                          message=text[:1024], stage=self.host.peer_id))

    async def _send_ring(self, state: EpochState, body: bytes) -> None:
        """Send an encoded frame body to the successor (dialling it on first use)."""
        target = state.successor
        stream = self._out_streams.get(target)
        if stream is None:
            for addr in state.assignment.successor_addrs if target != self.coordinator_id else ():
                try:
                    await self.host.connect(addr)
                    break
                except TransportError as exc:
                    log.info("could not dial successor at %s: %s", addr, exc)
            stream = await self.host.open_stream(target, RING_PROTOCOL)
            stream = await self.links.emulate(stream)
            self._out_streams[target] = stream
        self.observer.frame_sent(self.host.peer_id, len(body) + 4)
        await stream.send_frame(body)


async def run_node(config: NodeConfig, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Prepare (or verify) the model store, start the host and serve until cancelled."""
    from shard.identity import identity_signing_key, load_or_create_identity
    from shard.store import cache_root
    from shard.transport import open_host

    if config.torch_threads:
        torch.set_num_threads(config.torch_threads)
    store = await trio.to_thread.run_sync(lambda: open_or_prepare(config.model, config.store_dir))
    keypair = load_or_create_identity(config.key_path or cache_root() / "node.key")
    async with open_host(keypair, config.listen) as host:
        node = Node(config, host, store, signing_seed=identity_signing_key(keypair))
        await node.serve(task_status=task_status)
