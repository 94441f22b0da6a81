"""A volunteer node: register with the coordinator, take an assignment, serve ring frames.

The I/O half of a stage (trio + libp2p). It measures what it can do, registers, loads
only the slice its signed assignment names, accepts ring frames only from the peer that
the current epoch names as its predecessor (identity from the Noise handshake), runs
each frame in a worker thread so the network never waits on a forward, and ships the
output to its successor (or straight back to the coordinator when it is the tail).
It does not choose rings, schedule requests or look inside activations.
"""

from __future__ import annotations

import logging
import math
import os
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
from shard.receipt_signer import make_signer
from shard.stage import Stage
from shard.stage_worker import StageWorker, WorkerConfig
from shard.store import ModelStore, open_or_prepare
from shard.transport import FramedStream, Host, TransportError
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import (Assignment, AuditReply, AuditRequest, EndJob, Forward, JobError, Ping, Pong, Ready,
                                 Register, Result)

log = logging.getLogger("shard.node")

CONTROL_PROTOCOL = "/shard/control/1.0.0"
RING_PROTOCOL = "/shard/ring/1.0.0"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class NodeConfig:
    """Everything `shard-node join` takes; the CLI is derived from these fields."""

    coordinator: str  # multiaddr ending in /p2p/<coordinator peer id>
    model: str = "smollm2-135m"
    store_dir: str | None = None  # default: the shared cache (shard.store)
    key_path: str | None = None  # default: <cache>/node.key
    listen: str = "/ip4/127.0.0.1/tcp/0"
    device: str = "cpu"
    dtype: str = "float32"
    max_memory_bytes: int = 4 << 30  # weights + KV cache this node may use
    torch_threads: int = 0  # 0 = torch's default
    link_latency_ms: float = 0.0  # emulated one-way latency on this node's outgoing ring edge
    link_upload_mbps: float = 0.0  # emulated uplink; 0 = unlimited
    link_jitter_ms: float = 0.0
    # Sign a receipt per frame and log frames for audits. Off only to measure their cost:
    # a coordinator that checks receipts fails every job through a node that does not sign.
    receipts: bool = True


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
    _links: trio.Nursery | None = None

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register and serve until cancelled. Error handling: a bad frame or failed job is
        reported and logged, never fatal; losing the coordinator's control stream is fatal.
        Resource handling: all tasks live in this call's nursery."""
        cfg = self.config
        self.limits = Limits.for_model(self.store.config, max_tokens_per_frame=2048)
        dtype = DTYPES[cfg.dtype]
        decode_s, prefill_s = await trio.to_thread.run_sync(measure_compute, self.store, dtype, cfg.device)
        self.coordinator_id = await self.host.connect(cfg.coordinator)
        self.host.set_handler(RING_PROTOCOL, self._on_ring_stream)
        self.control = await self.host.open_stream(self.coordinator_id, CONTROL_PROTOCOL)
        upload = await self._probe_upload()
        await self._send_control(Register(
            peer_id=self.host.peer_id, model=cfg.model, manifest_digest=self.store.digest, device=cfg.device,
            memory_bytes=cfg.max_memory_bytes, decode_s_per_layer=decode_s, prefill_s_per_layer_token=prefill_s,
            upload_bytes_per_s=upload, download_bytes_per_s=upload, rtt_ms={}, listen_addrs=tuple(self.host.addrs),
        ))
        log.info("registered with %s (decode %.2f ms/layer, prefill %.3f ms/layer/token)",
                 self.coordinator_id, decode_s * 1e3, prefill_s * 1e3)
        task_status.started()
        async with trio.open_nursery() as self._links:  # pumps of emulated outgoing links
            while True:
                msg = decode(await self.control.recv_frame(self.limits.max_frame_bytes), self.limits)
                if isinstance(msg, Assignment):
                    await self._assume(msg)
                elif isinstance(msg, Ping):
                    await self._send_control(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns))
                elif isinstance(msg, AuditRequest):
                    await self._send_control(self._audit_reply(msg))
                else:
                    log.warning("ignoring %s on the control stream", type(msg).__name__)

    async def _probe_upload(self) -> float:
        """Bytes/s to the coordinator, from echoing a 256 KiB ping (rough; refreshed later)."""
        payload = os.urandom(256 << 10)
        t0 = time.perf_counter_ns()
        await self._send_control(Ping(nonce=1, sent_ns=t0, payload=payload))
        reply = decode(await self.control.recv_frame(self.limits.max_frame_bytes), self.limits)
        elapsed = max((time.perf_counter_ns() - t0) / 1e9, 1e-6)
        if not isinstance(reply, Pong):
            raise ShardError(f"coordinator answered a ping with {type(reply).__name__}")
        return 2 * len(payload) / elapsed

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
        r = LayerRange(a.layer_start, a.layer_end)
        old = self.state
        if old is not None and LayerRange(old.assignment.layer_start, old.assignment.layer_end) == r:
            stage = old.worker.stage  # same slice: keep the weights, drop the caches
        else:
            stage = await trio.to_thread.run_sync(self._load_stage, r)
        signer = None
        if self.config.receipts and self.signing_seed is not None:
            signer = make_signer(self.signing_seed, self.store, a, self.frame_log)
        worker = StageWorker(stage, WorkerConfig(
            wire_dtype=a.wire_dtype, is_tail=a.successor is None, max_context_tokens=self.store.config.max_context_tokens,
            max_kv_bytes=max(self.config.max_memory_bytes - self.store.layer_bytes(r), 64 << 20),
        ), signer=signer)
        self.state = EpochState(a, worker, a.predecessor or self.coordinator_id, a.successor or self.coordinator_id)
        self._out_streams.clear()
        log.info("epoch %d: serving layers %s as %s (pred %s, succ %s)", a.epoch, r, a.role,
                 a.predecessor or "coordinator", a.successor or "coordinator")
        await self._send_control(Ready(peer_id=self.host.peer_id, epoch=a.epoch))

    def _load_stage(self, r: LayerRange) -> Stage:
        cfg, dtype = self.store.config, DTYPES[self.config.dtype]
        weights = self.store.load_layers(r, dtype, self.config.device)
        embedding = self.store.load_embedding(dtype, self.config.device) if r.start == 0 else None
        return Stage(cfg, r, weights, dtype=dtype, device=self.config.device, embedding=embedding)

    async def _on_ring_stream(self, stream: FramedStream) -> None:
        remote = stream.remote_peer_id
        try:
            while True:
                try:
                    body = await stream.recv_frame(self.limits.max_frame_bytes)
                except WireError as exc:  # a length past the cap: the stream is out of sync
                    log.warning("closing ring stream from %s: %s", remote, exc)
                    return
                state = self.state
                if state is None or remote != state.predecessor:
                    log.warning("refused a frame from %s: not the predecessor of epoch %s",
                                remote, state.assignment.epoch if state else "-")
                    return
                try:
                    msg = decode(body, self.limits)
                except WireError as exc:
                    log.warning("dropped a malformed frame from %s: %s", remote, exc)
                    continue
                await self._handle(state, msg)
        except TransportError as exc:
            log.info("ring stream from %s ended: %s", remote, exc)
        finally:
            await stream.aclose()

    async def _handle(self, state: EpochState, msg) -> None:
        if isinstance(msg, EndJob):
            state.worker.end_job(msg.job_id)
            self.frame_log.end_job(msg.job_id)
            if state.assignment.successor is not None:
                await self._send_ring(state, msg)
            return
        if not isinstance(msg, Forward):
            log.warning("ignoring %s on a ring stream", type(msg).__name__)
            return
        if msg.epoch != state.assignment.epoch:
            await self._job_error(msg, "stale_epoch", f"frame for epoch {msg.epoch}, serving {state.assignment.epoch}")
            return
        try:
            out = await trio.to_thread.run_sync(state.worker.process, msg, limiter=self.compute_limiter)
        except ShardError as exc:
            log.warning("job %s round %d failed: %s", msg.job_id, msg.round, exc)
            await self._job_error(msg, type(exc).__name__, str(exc))
            return
        try:
            await self._send_ring(state, out)
        except TransportError as exc:
            self._out_streams.pop(state.successor, None)
            await self._job_error(msg, "successor_unreachable", str(exc))

    async def _job_error(self, msg: Forward, code: str, text: str) -> None:
        if self.state is not None:
            self.state.worker.end_job(msg.job_id)  # the coordinator re-prefills it if it retries
        await self._send_control(JobError(job_id=msg.job_id, epoch=msg.epoch, round=msg.round, code=code[:64],
                                          message=text[:1024], stage=self.host.peer_id))

    async def _send_ring(self, state: EpochState, msg: Forward | Result | EndJob) -> None:
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
            stream = await self._emulate(stream)
            self._out_streams[target] = stream
        await stream.send_frame(encode(msg))

    async def _emulate(self, stream):
        """Wrap an outgoing ring edge in the configured link emulation (a transport
        decorator: nothing else in the node knows about it)."""
        cfg = self.config
        if not (cfg.link_latency_ms or cfg.link_upload_mbps or cfg.link_jitter_ms):
            return stream
        from shard.linkemu import EmulatedLink

        link = EmulatedLink(stream, one_way_latency_s=cfg.link_latency_ms / 1e3,
                            upload_bytes_per_s=cfg.link_upload_mbps * 1e6 / 8 if cfg.link_upload_mbps else math.inf,
                            jitter_s=cfg.link_jitter_ms / 1e3)
        await self._links.start(link.serve)
        return link


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
