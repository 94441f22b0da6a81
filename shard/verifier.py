"""A verifier node's job: recompute an audited stage's slice on the input frames it logged.

The coordinator sends a VerifyRequest (shard.wire.verify) with a stage's logged input
frames of one (job, epoch) and the slice, weight quantisation and wire formats the stage
served them under. The verifier replays them (shard.replay: in f32, quantised as the stage
declared) on its own copy of the slice, the one it keeps warm for its role when that
matches, else one it loads from its store (kept for the next audit), first fetching from
peers whatever files of the slice the store lacks (`fetch`, shard.weight_fetch on a
node), and answers with the rows it recomputed. So the gateway that asks needs no layers
of its own. A request or reply past one control frame travels as VerifyParts
(shard.verify_parts): `receive` puts a request back together (bounded by the model:
upload_cap) and answers in parts of the asker's max_part_bytes.

It does not see the stage's outputs, compare anything or judge anyone (the coordinator
does: coordinator.trust.audit); it never raises on a request: whatever is wrong with one
(frames that do not decode, a slice its store lacks, a replay that fails, an answer over
the size the coordinator accepts) is that request's one-line error reply.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Generator
from typing import TypeVar

import torch
import trio

from shard.errors import ShardError
from shard.layers import LayerRange
from shard.low_priority import LowPriorityThread
from shard.quant import scheme
from shard.replay import LeadCache, Replayed, ReplayStats, replay_steps
from shard.slice_cache import SliceCache
from shard.stage import Stage
from shard.store import ModelStore
from shard.verify_parts import Uploads, assemble, split, upload_cap, whole_limits
from shard.wire.codec import decode, encode
from shard.wire.limits import Limits
from shard.wire.messages import Forward, Message
from shard.wire.verify import TIMING_ERROR, VerifyPart, VerifyReply, VerifyRequest, is_timing

log = logging.getLogger("shard.node")
T = TypeVar("T")
# Rows per replay forward on a node that also serves a ring stage: the replay runs one
# forward at a time (holding the compute limiter, or at the lowest CPU priority: Verifier.
# _in_background), so the stage's own frames run between. A whole
# audited job in one forward (1931 rows of a 10-layer SmolLM2 slice: 3.3 CPU-s, ~10 s at
# load 4) stalled every job on the ring behind it (issue 21: ITL p95 12 s at 16 streams),
# and so did steps of 256 rows (~0.3-0.5 s each on the 2-core dev VM): at 16 streams the
# audits' steps silenced the whole ring for 1-2.5 s at a time. A step of 64 rows is about
# one forward of a group's decode rows with a prefill piece beside them (shard.batch_plan's
# piece_rows); longer frames replay in pieces of it (shard.replay.split_long).
STEP_ROWS = 64
# A step waits for the node's stage to be idle (no frame waiting or running: `idle`) at
# most this long, so that audits still progress, a step at a time, on a stage that never is.
IDLE_WAIT_S = 1.0
# After each step a node's replays pause this many times the step's CPU time, so they take
# at most 1 / (1 + PAUSE_RATIO) of its time: on a loaded ring the audits of jobs that end
# together (a closed loop's clients finish in clusters) no longer take ~1.5 of the 2 cores
# for seconds at a time (the 16-stream ring then fell from ~130 to ~40 tok/s, the ITL tail),
# and the same CPU is spread over a few seconds more. An audit waits; no token does.
PAUSE_RATIO = 4.0
# Loaded slices kept for later replays, past the one in use, while their weights fit this.
# A ring stage verifies the other stages' slices, drawn at random per audit (which one
# answers is unpredictable: coordinator.trust.opinions), so keeping only one reloaded it
# whenever the draw alternated: 0.25-0.7 CPU-s a load for a 10-layer SmolLM2 slice (140 MB
# in f32) on the dev VM, as much as the replay, at 16 streams most audits.
CACHE_BYTES = 512 << 20
# What replaying forked jobs' sources left (shard.replay.LeadState), kept for the next fork
# of the same source on the same slice: a fork's audit replays its source's frames first
# (coordinator.trust.prefix_audit), ~40% of the rows replayed at 16 streams of the short
# mix, the same rows at every audit of a fork of that source. A 200-token prompt's state on a
# 10-layer SmolLM2 slice is ~3 MB (its K/V in f32), a 1.9k-token one ~29 MB. 64 MB held one
# long source's state a node: at 32 streams of the full mix (two long sources, two slices a
# verifier) its replays missed, 3.5-4.3 CPU-s each, and 61 of 274 audits in 600 s went stale;
# with 256 MB 644 were done, 10 stale, at 115.9 against 123.9 tok/s and ~80 MB more per node,
# RSS flat (docs/batching.md, "Audits that keep up").
LEAD_CACHE_BYTES = 256 << 20
WARN_EVERY_S = 60.0  # refusals logged at WARNING at most this often (the rest at INFO)


def request_frames(req: VerifyRequest, limits: Limits) -> list[Forward]:
    """The request's frames, each decoded as canonical Forward bytes. Raises ShardError
    (WireError) naming the first frame that is not one."""
    data = req.frames.numpy().tobytes()
    frames, at = [], 0
    for i, n in enumerate(req.frame_bytes):
        msg = decode(data[at:at + n], limits, canonical=True)
        if not isinstance(msg, Forward):
            raise ShardError(f"frame {i} of the verify request is a {type(msg).__name__}, not a Forward")
        frames.append(msg)
        at += n
    return frames


def lead_key(req: VerifyRequest, lead: int, own_slice: bool) -> bytes:
    """A digest of what the replay of `req`'s first `lead` frames depends on: their bytes,
    the slice, its quantisation and the wire formats, and whether the slice is the
    verifier's own copy or the node's warm one (other kernels). (replay_steps keys on the
    lead's pieces and segments too, which follow from the frames and the step's rows.)"""
    if not lead:
        return b""
    h = hashlib.sha256(repr((req.layer_start, req.layer_end, req.quant, req.wire_dtype, req.aux_dtype, own_slice,
                             req.frame_bytes[:lead])).encode())
    h.update(req.frames[:sum(req.frame_bytes[:lead])].numpy().tobytes())
    return h.digest()


def sized_reply(request_id: int, replayed: list[Replayed | None], limits: Limits) -> tuple[VerifyReply, int]:
    """reply_of, and the bytes it encodes to (held to the request's max_reply_bytes)."""
    reply = reply_of(request_id, replayed)
    return reply, len(encode(reply, whole_limits(limits, 1 << 32)))


def reply_of(request_id: int, replayed: list[Replayed | None]) -> VerifyReply:
    """The rows `replay` recomputed, per frame in order, as one VerifyReply."""
    keeps, hiddens, auxes, rows = [], [], [], []
    for r in replayed:
        if r is None:
            rows.append(0)
            continue
        keep, hidden, aux = r  # (K,), (K, H), (K, k*H) or None
        rows.append(int(keep.shape[0]))
        keeps.append(keep.to(torch.int64)), hiddens.append(hidden), auxes.append(aux)
    if not hiddens:
        raise ShardError("no frame of the verify request had a row to recompute")
    aux = None if any(a is None for a in auxes) else torch.cat(auxes).to(torch.float32).contiguous()
    return VerifyReply(request_id=request_id, frame_rows=tuple(rows), keep=torch.cat(keeps),
                       hidden=torch.cat(hiddens).to(torch.float32).contiguous(), aux=aux)


def _step(steps: Generator[bool, None, list[Replayed | None]]) -> tuple[list[Replayed | None] | None, bool]:
    """One forward of a replay: (its result once it is done, else None; whether another
    forward follows)."""
    try:
        more = next(steps)
    except StopIteration as done:
        return done.value, False
    return None, more


def thread_cpu(fn: Callable[[], T]) -> tuple[T, float]:
    """fn's result and the CPU seconds the calling thread spent in it (torch runs one
    thread per node: a forward's CPU is its thread's)."""
    started = time.thread_time()
    return fn(), time.thread_time() - started


class Verifier:
    """Answers VerifyRequests for one node. Loaded slices are kept while their weights fit
    `cache_bytes` (the last one always)."""

    def __init__(self, store: ModelStore, device: str, limiter: trio.CapacityLimiter,
                 fetch: Callable[[LayerRange], Awaitable[object]] | None = None, cache_bytes: int = CACHE_BYTES,
                 step_rows: int = STEP_ROWS, idle: Callable[[float], Awaitable[None]] | None = None,
                 pause_ratio: float = PAUSE_RATIO, low_priority: bool = True,
                 lead_cache_bytes: int = LEAD_CACHE_BYTES) -> None:
        """`fetch(r)`: make the files of layers `r` present in `store` (raising ShardError when
        it cannot); None: the store has what it has. `step_rows`: most rows a replay forward
        holds the node's compute limiter for (the request's max_replay_rows if fewer).
        `idle(max_wait_s)`: returns when the node's own stage has no frame waiting or running
        (shard.stage_scheduler.StageScheduler.idle), or after max_wait_s: replay steps and
        slice loads are background work, started only then (None: at once). `pause_ratio`: after
        each step the node's replays wait that many times its CPU time (PAUSE_RATIO).
        `low_priority`: on a CPU node, a replay longer than one step runs on a thread at the OS's
        lowest priority (shard.low_priority) alongside the node's own forwards instead of holding
        the compute limiter (`_in_background`). `lead_cache_bytes`: forks' lead states kept
        (LEAD_CACHE_BYTES)."""
        self.store, self.device, self.limiter, self.fetch, self.step_rows = store, device, limiter, fetch, step_rows
        self.pause_ratio = pause_ratio
        self.idle = idle
        self._background = trio.Lock()  # one replay step or slice load at a time, each begun on an idle stage
        self._low = LowPriorityThread() if low_priority and torch.device(device).type == "cpu" else None
        self._fetching = trio.Lock()  # one fetch of missing files at a time
        self.leads = LeadCache(lead_cache_bytes)
        # Lead digests being replayed here now -> set when that replay ends. Audits of forks of one
        # source drawn together (a closed loop's clients end in clusters) each replayed the whole
        # lead, ~3.5 CPU-s for a 1.9k-token prompt on a 10-layer slice, before either was kept.
        self._leading: dict[bytes, trio.Event] = {}
        self.slices = SliceCache(store, device, cache_bytes)
        self.answered = 0  # requests answered with rows (not errors)
        self.refused = 0  # requests answered with an error (timing requests aside)
        self._warned_s = -WARN_EVERY_S  # when a refusal was last logged at WARNING (trio's clock)
        self.uploads: Uploads | None = None  # requests arriving in parts (made on the first part)

    def receive(self, msg: VerifyRequest | VerifyPart, limits: Limits, warm: tuple[Stage, str] | None,
                nursery: trio.Nursery, send: Callable[[Message], Awaitable[None]]) -> None:
        """Take one control message from the coordinator: a whole request, or a part of one
        (put back together by `self.uploads`, under upload_cap(limits)). A whole request is
        answered in its own task (it takes a forward's time), its reply sent by `send` whole
        or in parts of the request's max_part_bytes; a part that breaks an upload's rule is
        answered at once with that request's error. Never raises on a message."""
        if isinstance(msg, VerifyPart):
            self.uploads = self.uploads or Uploads(upload_cap(limits))
            try:
                data = self.uploads.add("coordinator", msg)
                if data is None:
                    return
                msg = assemble(data, limits, self.uploads.cap, VerifyRequest, msg.request_id)  # type: ignore[assignment]
            except ShardError as exc:
                nursery.start_soon(send, self._refuse(msg.request_id, str(exc)))
                return
        nursery.start_soon(self._serve, msg, limits, warm, send)

    async def _serve(self, req: VerifyRequest, limits: Limits, warm: tuple[Stage, str] | None,
                     send: Callable[[Message], Awaitable[None]]) -> None:
        reply = await self.answer(req, limits, warm)
        try:
            parts = split(reply, req.max_part_bytes or limits.max_frame_bytes, whole_limits(limits, req.max_reply_bytes))
        except ShardError as exc:  # answer() held it to max_reply_bytes already: a part size too small
            parts = [self._refuse(req.request_id, str(exc), req)]
        for part in parts:
            await send(part)

    async def answer(self, req: VerifyRequest, limits: Limits, warm: tuple[Stage, str] | None = None) -> VerifyReply:
        """Recompute `req` and return the reply (an error reply for anything wrong with it).
        `warm`: the slice this node keeps loaded and the quantisation it was loaded under,
        used when it is exactly the slice asked for in f32. Runs the replay a forward at a
        time, each once the stage is idle (`idle`), on the low-priority thread or in a worker
        thread under the node's compute limiter (`_in_background`).
        A timing request (shard.wire.verify.is_timing: the speed probe's, every probe) is
        answered with its error at once and logged at debug, not as a refusal."""
        if is_timing(req):
            log.debug("verify request %d: a timing request, answered at once", req.request_id)
            return VerifyReply(request_id=req.request_id, error=TIMING_ERROR)
        try:
            # Decoding a request's frames (~0.1-0.5 ms each, hundreds of them) and hashing a lead's
            # bytes run in worker threads: on the node's trio thread they stopped its ring frames
            # for up to 64 ms at 16 streams (issue 21).
            frames = await trio.to_thread.run_sync(request_frames, req, limits)
            stage, load_s = await self._stage(LayerRange(req.layer_start, req.layer_end), req.quant, warm)
            lead = next((i for i, f in enumerate(frames) if f.prefix_job is not None), 0)
            key = await trio.to_thread.run_sync(lead_key, req, lead, warm is None or stage is not warm[0]) if lead else b""
            while key in self._leading:  # the same lead being replayed here: wait, then find its state kept
                await self._leading[key].wait()
            if key:
                self._leading[key] = trio.Event()
            try:
                return await self._replay(req, limits, frames, stage, load_s, lead, key)
            finally:
                if key:
                    self._leading.pop(key).set()
        except ShardError as exc:
            return self._refuse(req.request_id, str(exc), req)
        except Exception as exc:  # a check we missed: this request's error, never the node's
            log.exception("verify request %d raised", req.request_id)
            return self._refuse(req.request_id, f"{type(exc).__name__}: {exc}", req)

    async def _replay(self, req: VerifyRequest, limits: Limits, frames: list[Forward], stage: Stage,
                      load_s: float | None, lead: int, key: bytes) -> VerifyReply:
        """answer's replay of `frames` on `stage` (the first `lead` a fork's source's, under
        digest `key`) and its reply (an error reply past max_reply_bytes). Raises what the
        replay raises."""
        stats = ReplayStats()
        steps = replay_steps(stage, req.wire_dtype, frames, min(req.max_replay_rows, self.step_rows), stats,
                             aux_dtype=req.aux_dtype, frame_by_frame=scheme(req.quant).quantised, lead=lead,
                             lead_key=key, lead_cache=self.leads)
        replayed, cpu_s = None, 0.0
        background = self._in_background(frames, stage, min(req.max_replay_rows, self.step_rows))
        while replayed is None:  # one forward at a time: the node's own frames run between
            async with self._background:
                await self._wait_idle()
                step = lambda: thread_cpu(lambda: _step(steps))  # noqa: E731
                (replayed, more), step_s = await (background.run(step) if background is not None else
                                                  trio.to_thread.run_sync(step, limiter=self.limiter))
                if more:  # paced between forwards, the lock held; a one-forward replay (a speed probe) never
                    await trio.sleep(step_s * self.pause_ratio)
            cpu_s += step_s
        reply, size = await trio.to_thread.run_sync(sized_reply, req.request_id, replayed, limits)
        # Whether the lead was kept comes from this replay's own stats: the cache's counters are
        # shared by requests whose steps interleave, so another's hit read as this one's.
        log.info("verify request %d: %d rows of %d frames replayed on layers [%d, %d) in %.2f CPU-s (%d rows "
                 "recomputed)%s", req.request_id, sum(reply.frame_rows), len(frames), req.layer_start, req.layer_end,
                 cpu_s, stats.rows, ("" if load_s is None else f", after loading the slice ({load_s:.2f} CPU-s)")
                 + (f", the first {lead} (a fork's source, lead {key[:4].hex()}) "
                    + ("kept from an earlier replay" if stats.lead_kept else "replayed") if lead else ""))
        if size > req.max_reply_bytes:
            return self._refuse(req.request_id, f"the recomputed rows take {size} bytes, over the request's "
                                                f"max_reply_bytes {req.max_reply_bytes}", req)
        self.answered += 1
        return reply

    def _refuse(self, request_id: int, why: str, req: VerifyRequest | None = None) -> VerifyReply:
        """At WARNING at most once per WARN_EVERY_S (with the refusals since), else at INFO."""
        self.refused, now = self.refused + 1, trio.current_time()
        loud = now - self._warned_s >= WARN_EVERY_S
        self._warned_s = now if loud else self._warned_s
        where = "" if req is None else f" (layers [{req.layer_start}, {req.layer_end}))"
        log.log(logging.WARNING if loud else logging.INFO, "verify request %d%s not answered (%d refused in all): %s",
                request_id, where, self.refused, why)
        return VerifyReply(request_id=request_id, error=why[:1024])

    async def _stage(self, r: LayerRange, quant: str, warm: tuple[Stage, str] | None) -> tuple[Stage, float | None]:
        """The slice to replay on, and the CPU-s its load for this request took (None: none)."""
        if warm is not None and warm[0].layers == r and warm[1] == quant and warm[0].dtype == torch.float32:
            return warm[0], None
        key = (r, quant)
        if key not in self.slices and self.fetch is not None:
            async with self._fetching:  # not under _background: a fetch waits on peers, not on the CPU
                await self.fetch(r)
        async with self._background:
            return await self._cached(key)

    def _in_background(self, frames: list[Forward], stage: Stage, step_rows: int) -> LowPriorityThread | None:
        """Where a replay's forwards run: on the low-priority thread, not holding the node's
        compute limiter, when the replay is background work there (None: in a worker thread
        under the limiter, never alongside one of the node's own forwards). Background: on a
        CPU node whose thread the OS let lower (a GPU's time is not the OS's to share), a
        replay of more rows than one step (a request of one step's rows is answered in the
        foreground: a newcomer's speed probe times such requests), on a slice of the
        verifier's own (the node's warm slice is its forwards' own objects, used by one
        thread at a time). Measured in shard.low_priority's docstring."""
        if self._low is None or not self.slices.owns(stage):
            return None
        if sum(f.positions.shape[0] for f in frames) <= step_rows:
            return None
        return self._low if self._low.start() else None

    async def _wait_idle(self) -> None:
        if self.idle is not None:
            await self.idle(IDLE_WAIT_S)

    async def _cached(self, key: tuple[LayerRange, str]) -> tuple[Stage, float | None]:
        """The slice from the cache, else loaded once the stage is idle, in a worker thread but
        not under the compute limiter: a load (~0.3-0.7 CPU-s for a 10-layer SmolLM2 slice on
        the dev VM) touches none of the node's state, and held the stage's frames up behind it."""
        stage = self.slices.get(key)
        if stage is not None:
            return stage, None
        await self._wait_idle()
        return await trio.to_thread.run_sync(self.slices.load, key)
