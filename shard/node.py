"""A volunteer node: register with the coordinator, take an assignment, serve ring frames.

The I/O half of a stage (trio + libp2p). It measures what it can do (compute, and its
round trip, upload and download to the coordinator; later the round trips to the peers
the coordinator names), registers, loads only the slice its signed assignment names,
accepts ring frames only from the peer that the current epoch names as its predecessor
(identity from the Noise handshake; `shard.ring_inbox` bounds what each stream may hold),
queues the frames of every job that wait for it (`shard.stage_scheduler`), runs what waits
as one forward in a worker thread so the network never waits on a forward, and ships each
frame's output to its job's successor (or back to the coordinator when it is the tail). No frame
ends the process: whatever goes wrong with one ends its job with a JobError; a bug outside a frame
ends the session, not the node (`shard.reconnect`: its jobs dropped, it registers again). Every
stream it sends on crosses the node's one emulated uplink, its probes measure those same links
(`shard.node_links`), and audits' replays run when its stage is idle (`shard.verifier`).
It does not choose rings, schedule requests or look inside activations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

import trio

from shard import audit_answers, reach_duty
from shard.assignment_rules import ACKNOWLEDGE, decide, verify_assignment
from shard.errors import JobRef, ShardError, WireError
from shard.frame_log import FrameLog
from shard.heap import return_freed_heap
from shard.layers import LayerRange
from shard.linkprobe import PROBE_PROTOCOL
from shard.node_links import NodeLinks
from shard.node_config import NodeConfig, load_stage, measure_compute, worker_config  # noqa: F401 (NodeConfig re-exported)
from shard.kv_budget import held_bytes_per_layer
from shard.quant import effective_scheme, scheme
from shard.receipt_signer import make_signer
from shard.reconnect import ReconnectPolicy, RegistrationRefused, serve_reconnecting
from shard.ring_inbox import InboxConfig, RingInbox
from shard.ring_observer import NO_OBSERVER, RingObserver
from shard.stage import Stage
from shard.stage_scheduler import StageScheduler, Waiting
from shard.stage_worker import StageWorker, WallClock
from shard.store import ModelStore, stored_weight_files
from shard.transport import FramedStream, Host, TransportError
from shard.verifier import Verifier
from shard.weight_fetch import ensure_slice
from shard.weight_server import WEIGHTS_PROTOCOL, WeightServer
from shard.wire.codec import decode, decode_frame, encode, frame_job
from shard.wire.dtypes import COMPUTE_DTYPES
from shard.wire.limits import Limits
from shard.wire.verify import VerifyPart, VerifyRequest, control_limits
from shard.wire.messages import (ROLE_STAGE, Assignment, AuditRequest, EndJob, Forward, JobError, Ping, Pong,
                                 ProbePeers, Ready, Refused, Register, ReleaseFrames)

log = logging.getLogger("shard.node")

CONTROL_PROTOCOL = "/shard/control/1.0.0"
RING_PROTOCOL = "/shard/ring/1.0.0"
# Batches computed and waiting for the uplink. Sending runs in its own task so a stage
# computes batch r+1 while batch r uploads (a chunked prefill would otherwise idle every
# stage for each chunk's serialisation); this bound is the backpressure that keeps a slow
# uplink from piling up outputs in memory (a batch's outputs are at most its token budget's rows).
OUTBOX_BATCHES = 4


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
    held: Assignment | None = None  # the assignment last taken (a stage's or a role's)
    compute_limiter: trio.CapacityLimiter = field(default_factory=lambda: trio.CapacityLimiter(1))
    control_lock: trio.Lock = field(default_factory=trio.Lock)
    control: FramedStream | None = None
    limits: Limits = field(default_factory=Limits)
    signing_seed: bytes | None = None  # the identity's Ed25519 seed; None = do not sign receipts
    frame_log: FrameLog = field(default_factory=FrameLog)
    _out_streams: dict[str, object] = field(default_factory=dict)
    _outbox: trio.MemorySendChannel | None = None  # (state, [(body, frame it answers)]) for _send_ring_loop
    links: NodeLinks | None = None  # set in __post_init__: emulation and probes
    weights: WeightServer | None = None  # set in __post_init__: serves the weight files held here to peers
    scheduler: StageScheduler | None = None  # set in __post_init__: the frames waiting for a forward
    _tasks: trio.Nursery | None = None
    _warm: Stage | None = None  # a slice kept loaded for an off-ring role (e.g. hot standby)
    verifier: Verifier | None = None  # made on the first VerifyRequest (shard.verifier)
    observer: RingObserver = NO_OBSERVER  # what a benchmark watches of this node's frames
    inbox_config: InboxConfig = InboxConfig()
    reconnect: ReconnectPolicy = ReconnectPolicy()
    wall_clock: WallClock = time.time  # its clock_s stamps and Pongs (a test skews it as another machine's)

    def __post_init__(self) -> None:
        # A store kept quantised runs its own grid: what the node declares, sizes and loads.
        self.config = replace(self.config, quant=effective_scheme(self.store.manifest.quant, self.config.quant).name)
        cfg = self.config
        self.links = NodeLinks(self.host, self._send_control, cfg.link_latency_ms, cfg.link_upload_mbps,
                               cfg.link_jitter_ms, cfg.probe_timeout_s)
        self.weights = WeightServer(self.store.root, self.store.manifest, cfg.weights, open_link=self.links.open_link)
        self.scheduler = StageScheduler(lambda: self.state, self._run_batch, cfg.scheduler_config())

    async def serve(self, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Register and serve until cancelled. Error handling: a bad frame, failed job or
        failed probe is reported and logged, never fatal; losing the coordinator's control
        stream, or a bug (its jobs dropped: _drop_jobs), ends only the session: the node keeps
        its slice and registers again after a backoff (shard.reconnect, which bounds a bug's
        restarts); a refused registration raises RegistrationRefused.
        Resource handling: all tasks live in this call's nurseries."""
        cfg = self.config
        self.limits = Limits.for_model(self.store.config, max_tokens_per_frame=2048)
        dtype = COMPUTE_DTYPES[cfg.dtype]
        decode_s, prefill_s = await trio.to_thread.run_sync(measure_compute, self.store, dtype, cfg.device, scheme(cfg.quant))
        inbox = RingInbox(lambda peer: self.state is not None and peer == self.state.predecessor, self._serve_frame,
                          lambda: self.limits.max_frame_bytes, self.inbox_config)
        self.host.set_handler(RING_PROTOCOL, inbox.serve)
        self.host.set_handler(PROBE_PROTOCOL, self.links.on_probe_stream)
        self.host.set_handler(WEIGHTS_PROTOCOL, self.weights.serve)

        async def session(registered) -> None:
            self.coordinator_id = await self.host.connect(cfg.coordinator)
            control = await self.host.open_stream(self.coordinator_id, CONTROL_PROTOCOL)
            try:
                await self._serve_registered(control, decode_s, prefill_s, registered)
            finally:
                # Leaving (cancelled or failed) closes the control stream: the coordinator
                # re-forms at once instead of waiting for a ring frame to time out.
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    await control.aclose()

        await serve_reconnecting(session, self.reconnect, task_status, on_crash=self._drop_jobs)

    def _drop_jobs(self) -> None:
        """After a session that failed on a bug: every job's K/V and waiting frame goes (the
        coordinator resumes them, losslessly); the slice, the store and the epoch held stay."""
        dropped = self.state.worker.drop_jobs("dropped when the node's session failed") if self.state else []
        log.info("dropped %d jobs and %d waiting frames", len(dropped), self.scheduler.clear())
        self._out_streams.clear()

    async def _serve_registered(self, control: FramedStream, decode_s: float, prefill_s: float, registered) -> None:
        cfg = self.config
        async with trio.open_nursery() as self._tasks:  # control reader, ring sender, probes, emulated-link pumps
            self.links.nursery = self._tasks
            self.control = await self.links.emulate(control)
            self._outbox, outbox = trio.open_memory_channel(OUTBOX_BATCHES)
            self._tasks.start_soon(self._send_ring_loop, outbox)
            self._tasks.start_soon(self.scheduler.serve)
            self._tasks.start_soon(self._serve_control)
            self._tasks.start_soon(self._sweep_idle_jobs)
            rtt_s, upload, download = await self.links.probe_coordinator(cfg.probe_bytes)
            self.weights.set_upload(upload)  # seeds at a share of what it measured
            await self._send_control(Register(
                peer_id=self.host.peer_id, model=cfg.model, manifest_digest=self.store.digest, device=cfg.device,
                memory_bytes=cfg.max_memory_bytes, decode_s_per_layer=decode_s, prefill_s_per_layer_token=prefill_s,
                upload_bytes_per_s=upload, download_bytes_per_s=download, rtt_ms={self.coordinator_id: rtt_s * 1e3},
                listen_addrs=tuple(self.host.addrs), held_epoch=self.held.epoch if self.held is not None else -1,
                held_role=self.held.role if self.held is not None and self._loaded else "",
                held_start=self._loaded.start if self._loaded else 0, held_end=self._loaded.end if self._loaded else 0,
                quant=cfg.quant, bytes_per_layer=held_bytes_per_layer(self.store.config, cfg.quant, cfg.dtype),
                stored_files=stored_weight_files(self.store.root, self.store.manifest),
            ))
            log.info("registered with %s (decode %.2f ms/layer, prefill %.3f ms/layer/token, rtt %.1f ms, "
                     "up %.1f / down %.1f Mbit/s)", self.coordinator_id, decode_s * 1e3, prefill_s * 1e3, rtt_s * 1e3,
                     upload * 8e-6, download * 8e-6)
            registered()

    @property
    def _loaded(self) -> LayerRange | None:
        """The slice this node has loaded (a stage's, or a role's kept warm)."""
        stage = self.state.worker.stage if self.state is not None else self._warm
        return stage.layers if stage is not None else None

    async def _serve_control(self) -> None:
        while True:
            body = await self.control.recv_frame(self.limits.max_frame_bytes)
            try:
                msg = decode(body, control_limits(self.limits))
            except WireError as exc:  # costs that message; a bad length prefix (above) ends the stream
                log.warning("dropped a malformed control message: %s", exc)
                continue
            if isinstance(msg, Assignment):
                try:
                    await self._assume(msg)
                except ShardError as exc:  # a replayed, misaddressed or unsigned assignment
                    log.warning("refused an assignment for epoch %d: %s", msg.epoch, exc)
            elif isinstance(msg, Pong):
                self.links.pong(msg.nonce)
            elif isinstance(msg, Ping):
                await self._send_control(Pong(nonce=msg.nonce, sent_ns=msg.sent_ns, payload=bytes(msg.reply_bytes), clock_s=self.wall_clock()))
            elif isinstance(msg, ProbePeers):
                self._tasks.start_soon(self.links.report, msg, self.coordinator_id)
            elif isinstance(msg, (AuditRequest, ReleaseFrames)):  # the coordinator's alone: only it has this stream
                await audit_answers.reply(self.frame_log, msg, self._send_control)
            elif isinstance(msg, (VerifyRequest, VerifyPart)):  # an audit's recomputation, whole or in parts
                self._verify(msg)
            elif isinstance(msg, Refused):
                raise RegistrationRefused(msg.code, msg.reason)
            else:
                log.warning("ignoring %s on the control stream", type(msg).__name__)

    def _verify(self, msg: VerifyRequest | VerifyPart) -> None:
        self.verifier = self.verifier or Verifier(
            self.store, self.config.device, self.compute_limiter, idle=self.scheduler.idle, cache_bytes=self.config.verify_cache_mb << 20,
            fetch=lambda r: ensure_slice(self.host, self.coordinator_id, self.store, r, self.config.weights))
        warm = (self._warm, self.config.quant) if self._warm is not None else None
        self.verifier.receive(msg, self.limits, warm, self._tasks, self._send_control)  # answers in its own task

    async def _send_control(self, msg) -> None:  # a Message, or one already encoded
        async with self.control_lock:
            await self.control.send_frame(msg if isinstance(msg, bytes) else encode(msg))

    async def _assume(self, a: Assignment) -> None:
        """Take `a` (shard.assignment_rules decides) and answer Ready. Raises ShardError,
        changing nothing, for an assignment this node refuses."""
        verify_assignment(a, self.coordinator_id)
        if decide(a, self.host.peer_id, self.store.digest, self.held) == ACKNOWLEDGE:
            await self._send_control(Ready(peer_id=self.host.peer_id, epoch=a.epoch))
            return
        await reach_duty.take_duty(self.host, a)  # relay for others, or reserve on the relay named
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
            await ensure_slice(self.host, self.coordinator_id, self.store, r, self.config.weights)  # fetch what is missing
            stage = await trio.to_thread.run_sync(load_stage, self.config, self.store, r)
        if a.role != ROLE_STAGE:
            # Off the ring: refuse every ring frame this epoch, keep the named slice warm.
            self.state, self._warm, self.held = None, stage, a
            self._out_streams.clear()
            log.info("epoch %d: off the ring as %s, keeping layers %s warm", a.epoch, a.role, r or "none")
            await self._send_control(Ready(peer_id=self.host.peer_id, epoch=a.epoch))
            return
        self._warm = None
        signer = (make_signer(self.signing_seed, self.store, a, self.frame_log)
                  if self.config.receipts and self.signing_seed is not None else None)
        worker = StageWorker(stage, worker_config(self.config, self.store, a, r), signer=signer, wall_clock=self.wall_clock)
        self.state = EpochState(a, worker, a.predecessor or self.coordinator_id, a.successor or self.coordinator_id)
        self.held = a
        self._out_streams.clear()
        log.info("epoch %d: serving layers %s as %s (pred %s, succ %s)", a.epoch, r, a.role,
                 a.predecessor or "coordinator", a.successor or "coordinator")
        await self._send_control(Ready(peer_id=self.host.peer_id, epoch=a.epoch))

    async def _serve_frame(self, remote: str, body: bytes) -> bool:
        """Decode and handle one frame body (RingInbox.serve_frame; False ends its stream): one that
        fails (malformed, or a bug of ours) costs that frame and the job it names, never the stream."""
        state = self.state
        if state is None or remote != state.predecessor:
            log.warning("refused a frame from %s: not the predecessor of epoch %s",
                        remote, state.assignment.epoch if state else "-")
            return False
        received_at_s = self.wall_clock()  # wall clock: where the hop from the predecessor ends (Forward.clock_s)
        try:
            msg, canonical_len = decode_frame(body, self.limits)
        except Exception as exc:  # noqa: BLE001 (the peer's WireError, or a bug of ours: the frame's cost alone)
            job, what, code = ((exc.job, str(exc), "malformed_frame") if isinstance(exc, WireError)
                               else (frame_job(body, self.limits), f"{type(exc).__name__}: {exc}", "internal_error"))
            log.warning("dropped a frame from %s that did not decode: %s", remote, what)
            if job is not None:
                await self._job_error(job, code, what)
            return True
        msg = replace(msg, clock_s=(*msg.clock_s, received_at_s)) if isinstance(msg, Forward) else msg
        try:
            await self._handle(state, msg, memoryview(body)[:canonical_len])
        except ShardError:
            raise  # the control stream lost (no JobError can go): RingInbox logs it; the session ends on its own
        except Exception as exc:  # a check we missed: its job's end, never the node's
            log.exception("a frame of job %s raised", msg.job_id)
            await self._job_error(JobRef(msg.job_id, msg.epoch, getattr(msg, "round", 0)), "internal_error", repr(exc))
        return True

    async def _sweep_idle_jobs(self) -> None:
        """Every few seconds free idle jobs' KV, drop frame logs past their grace, return the freed heap."""
        while True:
            await trio.sleep(min(self.config.job_idle_timeout_s / 4, 10.0))
            await self.evict_idle_jobs()
            self.frame_log.sweep()
            return_freed_heap()

    async def evict_idle_jobs(self) -> list[str]:
        """Free idle jobs' KV now (under the compute limiter: no frame is mid-forward)."""
        state = self.state
        if state is None:
            return []
        async with self.compute_limiter:
            evicted = state.worker.evict_idle(state.worker.config.job_idle_timeout_s)
        for job_id in evicted:
            self.frame_log.abandon(job_id)
            log.info("job %s: KV freed after %.0f s idle", job_id, state.worker.config.job_idle_timeout_s)
        return evicted

    async def _handle(self, state: EpochState, msg, received: memoryview) -> None:
        """Queues a job's frame or its end for the scheduler (`received`: its bytes as they arrived, what receipts hash)."""
        if isinstance(msg, Forward) and msg.epoch != state.assignment.epoch:
            await self._job_error(msg, "stale_epoch", f"frame for epoch {msg.epoch}, serving {state.assignment.epoch}")
            return
        if isinstance(msg, EndJob) and msg.epoch != state.assignment.epoch:  # the job resumed here may share its id
            log.debug("ignoring the end of job %s on epoch %d, serving %d", msg.job_id, msg.epoch, state.assignment.epoch)
            return
        if not isinstance(msg, (Forward, EndJob)):
            log.warning("ignoring %s on a ring stream", type(msg).__name__)
            return
        if isinstance(msg, Forward):
            self.observer.stage_received(self.host.peer_id, msg)
        rows, split_row_bytes = state.worker.queued_rows(msg)
        if not await self.scheduler.submit(Waiting(state, msg, received, msg.job_id, rows, len(received.obj), split_row_bytes)):
            await self._job_error(msg, "job_ended", "a frame of a job after its end at this stage")  # answered, as every frame

    async def _run_batch(self, state: EpochState, batch: list[Waiting]) -> list[str]:
        """Run a batch's frames (or pieces) in one forward; each output goes on to its own job's
        successor, each failure ends its own job alone: returns their ids (StageScheduler.run_batch)."""
        frames, outs, sends = [w for w in batch if isinstance(w.msg, Forward)], [], []
        first = {w.job_id for w in batch if isinstance(w.msg, EndJob)} - {w.job_id for w in frames}
        for w in (w for w in batch if w.job_id in first):  # ends before others' frames, which may need their K/V room
            self._end_job(state, w, sends)
        if frames:  # a bug costs only the frame that raises it (process_frames_alone_on_error)
            outs = await trio.to_thread.run_sync(state.worker.process_frames_alone_on_error, [
                (w.msg, w.received) for w in frames], [w.piece for w in frames], limiter=self.compute_limiter)
        for w, out in zip(frames, outs):
            msg = w.msg
            if isinstance(out, ShardError):  # the frame's fault: the stage cannot serve it
                log.warning("job %s round %d failed: %s", msg.job_id, msg.round, out)
                await self._job_error(msg, type(out).__name__, str(out))
            elif isinstance(out, Exception):
                await self._job_error(msg, "internal_error", f"{type(out).__name__}: {out}")
            elif out is not None:  # None: a piece of a frame whose last rows run in a later forward
                self.observer.stage_computed(self.host.peer_id, msg)
                sends.append((out[1], msg))
        for w in (w for w in batch if isinstance(w.msg, EndJob) and w.job_id not in first):  # after its own frames
            self._end_job(state, w, sends)
        if sends:
            await self._outbox.send((state, sends))  # returns at once unless OUTBOX_BATCHES wait
        return [w.job_id for w, out in zip(frames, outs) if isinstance(out, Exception)]

    def _end_job(self, state: EpochState, end: Waiting, sends: list) -> None:  # K/V freed (kept: a prefix source), passed on
        if not end.msg.keep:
            state.worker.end_job(end.job_id)
            self.frame_log.end_job(end.job_id)
        if state.assignment.successor is not None:
            sends.append((encode(end.msg), None))

    async def _send_ring_loop(self, outbox: trio.MemoryReceiveChannel) -> None:
        """Send computed frames to the successor in the order they were computed, a batch's
        in one write. A frame of an epoch this node no longer serves is dropped (the coordinator
        ignores its result and resumes the job on the new ring). Error handling: a failed write
        fails the jobs of the frames in it (JobError to the coordinator); the next one re-dials."""
        async for state, sends in outbox:
            if state is not self.state:
                continue
            try:
                await self._send_ring(state, [body for body, _ in sends])
            except Exception as exc:  # noqa: BLE001 (a bug too costs that batch's jobs alone)
                self._out_streams.pop(state.successor, None)
                code, text = "successor_unreachable", str(exc)
                if not isinstance(exc, TransportError):
                    log.exception("sending frames to %s raised", state.successor)
                    code, text = "internal_error", repr(exc)
                for answers in (answers for _, answers in sends if answers is not None):
                    await self._job_error(answers, code, text)
                if any(answers is None for _, answers in sends):
                    log.info("could not forward an end of job to %s: %s", state.successor, exc)

    async def _job_error(self, msg: Forward | JobRef, code: str, text: str) -> None:
        if self.state is not None and msg.epoch == self.state.assignment.epoch:  # a former epoch's K/V left with it
            async with self.compute_limiter:  # not while a frame of any job is mid-forward
                self.state.worker.end_job(msg.job_id)  # the coordinator re-prefills it if it retries
        await self._send_control(JobError(job_id=msg.job_id, epoch=msg.epoch, round=msg.round, code=code[:64],
                                          message=text[:1024], stage=self.host.peer_id))

    async def _send_ring(self, state: EpochState, bodies: list[bytes]) -> None:
        """Send encoded frame bodies to the successor in one write (dialling it on first use)."""
        target = state.successor
        stream = self._out_streams.get(target)
        if stream is None:
            if target != self.coordinator_id:
                await reach_duty.dial_first(self.host, state.assignment.successor_addrs)
            stream = await self.host.open_stream(target, RING_PROTOCOL)
            if target != self.coordinator_id:  # the coordinator reads the tail's path off its own end
                await self._send_control(reach_duty.hop_path(self.host, stream, target))
            stream = await self.links.emulate(stream)
            self._out_streams[target] = stream
        for body in bodies:
            self.observer.frame_sent(self.host.peer_id, len(body) + 4)
        await stream.send_frames(bodies)
