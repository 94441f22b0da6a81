"""One stage's frame processing: a decoded Forward in, the next message out.

Synchronous and transport-free (the node runs it in a worker thread): it opens and
frees per-job KV caches, converts activations from and to the wire dtype, runs the
stage forward, attaches EAGLE aux features for the layers it owns, and builds the
Forward for its successor, or the Result for the coordinator when it is the tail;
process_frame also encodes it and has it signed, over the very bytes it received and
the canonical bytes it sends (no re-encoding for the receipt).
A long prefill chunk may run in pieces, rows [start, stop) per forward (the scheduler picks
them, shard.batch_plan): each piece's rows attend to the K/V the earlier ones wrote, the
worker keeps the pieces' outputs and sends the frame's output once, whole, when its last
piece has run (one receipt over the whole frame's bytes, as if it had run in one forward).
It does not know peers, streams or which peer sent the frame (the node checks that).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from shard.activations import from_wire, to_wire
from shard.errors import CacheError, CacheFullError, ShardError
from shard.forward_cpu import ForwardCpu
from shard.kvcache import KVCache
from shard.stage import Stage, StageFrame, StageInputError
from shard.wire.codec import encode_body, encode_trailer
from shard.wire.messages import Forward, Result

log = logging.getLogger("shard.node")

Piece = tuple[int, int]  # rows [start, stop) of a frame, run in one forward

# Extra slots past the model's context so a full-context job can still hold a draft tree.
DRAFT_SLACK_SLOTS = 128
# Job ids whose KV was freed (idle, or dropped with a failed session) that this worker
# remembers, so a late frame of one fails (it would otherwise run on a fresh, empty cache
# and return wrong states).
REMEMBERED_EVICTIONS = 4096


@dataclass(frozen=True)
class WorkerConfig:
    wire_dtype: str = "f32"
    aux_dtype: str | None = None  # the aux features' dtype on the wire (None: wire_dtype)
    is_tail: bool = False
    max_kv_bytes: int = 2 << 30
    max_context_tokens: int = 8192
    # A job that ran no frame for this long has its KV freed (evict_idle): past the
    # coordinator's 120 s frame timeout and its resume wait, no live job sits idle so long.
    job_idle_timeout_s: float = 300.0
    # Jobs holding KV here at once; a frame opening one more fails its job (CacheFullError).
    # A predecessor opening jobs it never ends held ~250 KB each of a 10-layer SmolLM2
    # stage's pages until the idle timeout (+136 MB under bench_hostile_ring's 100k frames);
    # the gateway runs 8 jobs at once by default (ApiConfig.max_concurrent_jobs) and the
    # scheduler is sized for 64, so 128 leaves room for both. A node serves what its
    # Assignment names instead (the coordinator's need) under its own --max-open-jobs
    # (shard.assignment_rules.open_jobs_cap); this is the figure where neither names one.
    max_open_jobs: int = 128


# Called with (frame received, its canonical bytes as received, the canonical bytes about
# to be sent) to produce a signed receipt; None = receipts off. Kept abstract so this
# module stays free of key handling.
ReceiptSigner = Callable[[Forward, "bytes | memoryview", bytes], bytes]
WallClock = Callable[[], float]  # Unix seconds (time.time): where a stage's clock_s stamps and Pongs read the time


@dataclass
class _Pieces:
    """What the pieces run so far of one frame produced: hidden rows, captured layers'
    rows, and the seconds of the forwards they rode in."""

    fwd: Forward
    rows: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)
    captured: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    forward_s: float = 0.0

    def add(self, h: torch.Tensor, captured: dict[int, torch.Tensor], forward_s: float) -> None:
        self.rows += h.shape[0]
        self.hidden.append(h)
        for layer, rows in captured.items():
            self.captured.setdefault(layer, []).append(rows)
        self.forward_s += forward_s

    def whole(self) -> tuple[torch.Tensor, dict[int, torch.Tensor], float]:
        return (torch.cat(self.hidden), {layer: torch.cat(rows) for layer, rows in self.captured.items()},
                self.forward_s)


def splittable(fwd: Forward) -> bool:
    """A frame that may run in pieces: a prefill chunk of several rows at the positions
    right after its context (a causal chain: a piece's rows see the context and the rows
    before them, which is what the earlier pieces leave in the cache; slot = position)."""
    t = fwd.positions.shape[0]
    x = fwd.tokens if fwd.tokens is not None else fwd.hidden
    return (fwd.phase == "prefill" and t > 1 and fwd.tree_parents is None and x is not None and x.shape[0] == t
            and torch.equal(fwd.positions, torch.arange(fwd.ctx_len, fwd.ctx_len + t, dtype=fwd.positions.dtype)))


def _commit_repeats(fwd: Forward) -> bool:
    """Whether applying fwd's commit (slots commit_src moved to [commit_dst, ...)) twice
    leaves what applying it once does: no source slot lies inside the destination range
    (the first application wrote over it) unless it moves onto itself."""
    dst, n = fwd.commit_dst, len(fwd.commit_src)
    return all(s == dst + i or not dst <= s < dst + n for i, s in enumerate(fwd.commit_src))


class StageWorker:
    """`clock()`: seconds, monotonic; when each job last ran a frame (for evict_idle)."""

    def __init__(self, stage: Stage, config: WorkerConfig, signer: ReceiptSigner | None = None,
                 clock: Callable[[], float] = time.monotonic, wall_clock: WallClock = time.time) -> None:
        self.stage, self.config, self.signer, self.clock, self.wall_clock = stage, config, signer, clock, wall_clock
        cfg = stage.cfg
        self.cache = KVCache(len(stage.layers), cfg.num_kv_heads, cfg.head_dim, stage.dtype,
                             config.max_kv_bytes, stage.device)
        self.last_used_s: dict[str, float] = {}
        self.evicted: OrderedDict[str, str] = OrderedDict()  # job id -> why its KV was freed
        self.pieces: dict[str, _Pieces] = {}  # job id -> its part-run frame's outputs so far
        self.cpu = ForwardCpu()  # the forwards' CPU seconds and rows by phase, logged every 10 s
        self.bursts = 0  # the last burst id stamped on outputs sent together (shard.wire.trailer)

    def end_job(self, job_id: str) -> None:
        self.cache.close(job_id)
        self.last_used_s.pop(job_id, None)
        self.pieces.pop(job_id, None)

    def queued_rows(self, msg: object) -> tuple[int, int]:
        """(rows, output bytes per row kept while it runs in pieces; 0: it runs whole) of a
        message queued for this worker (shard.stage_scheduler.Waiting); a job's end has none."""
        if not isinstance(msg, Forward):
            return 0, 0
        rows = msg.positions.shape[0]
        if not splittable(msg):
            return rows, 0
        kept = 1 + sum(layer in self.stage.layers for layer in msg.want_aux_layers)  # hidden + captured rows
        return rows, kept * self.stage.cfg.hidden_size * self.stage.dtype.itemsize

    def evict_idle(self, idle_s: float) -> list[str]:
        """Free the KV of every job that ran no frame for more than `idle_s` (a predecessor
        that opens jobs and never ends them must not hold the budget); return their ids.
        Not thread-safe against process_frame: the caller holds the compute limiter."""
        now = self.clock()
        stale = [job_id for job_id, t in self.last_used_s.items() if now - t > idle_s]
        for job_id in stale:
            self._evict(job_id, f"freed after {now - self.last_used_s[job_id]:.0f} s idle")
        return stale

    def drop_jobs(self, why: str) -> list[str]:
        """Free every job's KV (and part-run frame), remembered as evicted for `why`: a later
        frame of one needing its context fails instead of running on an empty cache."""
        dropped = list(self.cache.jobs)
        for job_id in dropped:
            self._evict(job_id, why)
        self.pieces.clear()
        return dropped

    def _evict(self, job_id: str, why: str) -> None:
        self.evicted[job_id] = why
        self.evicted.move_to_end(job_id)
        self.end_job(job_id)
        while len(self.evicted) > REMEMBERED_EVICTIONS:
            self.evicted.popitem(last=False)

    def process_frame(self, fwd: Forward, received: bytes | memoryview) -> tuple[Forward | Result, bytes]:
        """Run one frame and encode what to send: (message, wire body), the body carrying
        this stage's receipt when a signer is set. `received`: fwd's canonical bytes as
        they arrived (shard.wire.codec.decode_frame).
        Raises ShardError subclasses (CacheFullError, StageInputError, WireError...) for
        frames this stage cannot serve; the caller turns them into a JobError."""
        [out] = self.process_frames([(fwd, received)])
        if isinstance(out, ShardError):
            raise out
        return out

    def process_frames(self, frames: list[tuple[Forward, bytes | memoryview]], pieces: list[Piece | None] | None = None
                       ) -> list[tuple[Forward | Result, bytes] | ShardError | None]:
        """process_frame for frames of distinct jobs in one stage forward (Stage.forward_batch):
        per frame, its (message, wire body), the ShardError it alone raised, or None for a
        piece (`pieces[i]`, rows [start, stop); None: the whole frame) whose frame has rows
        left for later forwards. Each output is encoded and signed on its own, over its own
        whole frame's bytes."""
        outs = self.compute([fwd for fwd, _ in frames], pieces)
        bodies: dict[int, bytes] = {}
        for i, out in enumerate(outs):
            if out is not None and not isinstance(out, ShardError):
                try:
                    bodies[i] = encode_body(out)  # checked: we never send what the successor must refuse
                except ShardError as exc:
                    outs[i] = exc
        # The outputs leave together for one receiver: a burst (shard.wire.trailer) when several.
        # The tail's prefill Results are left out: the gateway asks its head for none but a
        # prompt's last chunk's, so its head would wait for asks that never come.
        grouped = [i for i in bodies if not (self.config.is_tail and frames[i][0].phase == "prefill")]
        self.bursts = (self.bursts + 1) % (1 << 32)
        burst = (self.bursts, len(grouped)) if len(grouped) > 1 else ()
        for i, body in bodies.items():
            fwd, received = frames[i]
            out = outs[i]
            if self.signer is not None:
                receipt = self.signer(fwd, received, body)
                out = dataclasses.replace(out, receipts=(*fwd.receipts, receipt))
            out = dataclasses.replace(out, clock_s=(*out.clock_s, self.wall_clock()),  # handed on now
                                      burst=burst if i in grouped else ())
            outs[i] = (out, body + encode_trailer(out))
        return outs

    def process_frames_alone_on_error(self, frames: list[tuple[Forward, bytes | memoryview]],
                                      pieces: list[Piece | None] | None = None) -> list:
        """process_frames, where any other exception (a bug, or a check we missed) costs only
        the frame that raises it: the batch is run again one frame at a time, the pieces'
        outputs so far as they were before it, and a frame that raises alone gets its
        exception in its place. A frame whose commit cannot be applied twice (a destination
        slot it reads overwritten by an earlier slot's move) is not rerun: it gets the
        batch's exception. A rerun rewrites the K/V slots the batch wrote with the same
        inputs, and its receipt's log entry is the one an audit reads (the last of a round)."""
        pieces = pieces or [None] * len(frames)
        started = time.thread_time()
        try:
            return self._alone_on_error(frames, pieces)
        finally:
            self.cpu.add(frames, pieces, time.thread_time() - started)

    def _alone_on_error(self, frames: list[tuple[Forward, bytes | memoryview]], pieces: list[Piece | None]) -> list:
        kept = {job: dataclasses.replace(p, hidden=list(p.hidden), captured={k: list(v) for k, v in p.captured.items()})
                for job, p in self.pieces.items()}
        try:
            return self.process_frames(frames, pieces)
        except Exception as exc:  # noqa: BLE001 (a bug: never the node's end, nor its batch-mates')
            if len(frames) == 1:
                log.exception("job %s round %d raised", frames[0][0].job_id, frames[0][0].round)
                return [exc]
            log.exception("a batch of %d frames raised; running them one at a time", len(frames))
            failed = exc
        self.pieces = kept
        outs: list = []
        for frame, piece in zip(frames, pieces):
            fwd = frame[0]
            if piece is not None and piece[0] > 0 or _commit_repeats(fwd):
                try:
                    outs += self.process_frames([frame], [piece])
                    continue
                except Exception as exc:  # noqa: BLE001
                    log.exception("job %s round %d raised on its own", fwd.job_id, fwd.round)
                    failed_alone: Exception = exc
            else:
                failed_alone = failed
            outs.append(failed_alone)
            self.pieces.pop(fwd.job_id, None)
        return outs

    def process(self, fwd: Forward) -> Forward | Result:
        """Run one frame: the output message, unsigned and not encoded (audit replays use
        this directly). Raises as process_frame does."""
        [out] = self.compute([fwd])
        if isinstance(out, ShardError):
            raise out
        return out

    def compute(self, fwds: list[Forward], pieces: list[Piece | None] | None = None
                ) -> list[Forward | Result | ShardError | None]:
        """Run frames (or pieces of frames) of distinct jobs in one forward: per frame, its
        output message (unsigned, not encoded), the ShardError it alone raised (which ends
        a part-run frame), or None for a piece whose frame has rows left."""
        pieces = pieces or [None] * len(fwds)
        outs: list = [None] * len(fwds)
        frames, ready = [], []
        for i, (fwd, piece) in enumerate(zip(fwds, pieces)):
            try:
                frames.append(self._stage_frame(fwd, piece))
                ready.append(i)
            except ShardError as exc:
                outs[i] = exc
                self.pieces.pop(fwd.job_id, None)
        started = time.perf_counter()
        results = self.stage.forward_batch(frames) if frames else []
        compute_s = time.perf_counter() - started  # the batch's forward, charged to each of its frames
        for i, result in zip(ready, results):
            fwd, piece = fwds[i], pieces[i]
            if isinstance(result, ShardError):
                outs[i] = result
                self.pieces.pop(fwd.job_id, None)
            elif piece is None:
                outs[i] = self._message(fwd, *result, compute_s)
            else:
                part = self.pieces[fwd.job_id]
                part.add(*result, compute_s)
                if piece[1] == fwd.positions.shape[0]:  # its last piece: the frame's output, whole
                    del self.pieces[fwd.job_id]
                    outs[i] = self._message(fwd, *part.whole())
        return outs

    def _stage_frame(self, fwd: Forward, piece: Piece | None = None) -> StageFrame:
        """fwd's job cache (opened on its first frame) and input (rows `piece` of it), checked."""
        if piece is not None:
            self._check_piece(fwd, piece)
        if fwd.job_id not in self.cache.jobs and fwd.job_id in self.evicted:
            if fwd.ctx_len > 0 and fwd.prefix_job is None:
                raise CacheError(f"KV cache of job {fwd.job_id!r} was {self.evicted[fwd.job_id]}; a frame at ctx_len "
                                 f"{fwd.ctx_len} needs it (re-prefill from 0)")
            del self.evicted[fwd.job_id]
        stage = self.stage
        if stage.is_head:
            if fwd.tokens is None:
                raise StageInputError("head stage input", "token ids", "hidden states")
            x = fwd.tokens
        else:
            if fwd.hidden is None:
                raise StageInputError("stage input", "hidden states", "token ids")
            x = from_wire(fwd.hidden, fwd.hidden_scale, stage.dtype)
        job = self.cache.jobs.get(fwd.job_id)
        if job is None and len(self.cache.jobs) >= self.config.max_open_jobs:
            raise CacheFullError("open jobs (--max-open-jobs)", self.config.max_open_jobs, len(self.cache.jobs) + 1)
        max_slots = self.config.max_context_tokens + DRAFT_SLACK_SLOTS
        if fwd.prefix_job is not None and (piece is None or piece[0] == 0):  # a prefix cache hit: K/V copied
            job = self.cache.fork(fwd.job_id, fwd.prefix_job, fwd.prefix_len, max_slots)
            self.last_used_s[fwd.prefix_job] = self.clock()  # a source in use is not idle
        elif job is None:
            job = self.cache.open(fwd.job_id, max_slots)
        self.last_used_s[fwd.job_id] = self.clock()  # only a job that holds KV (a refused frame's id is no entry)
        wanted = tuple(layer for layer in fwd.want_aux_layers if layer in stage.layers)
        if piece is None:
            return StageFrame(job, x, fwd.ctx_len, fwd.positions, fwd.tree_parents, tuple(fwd.commit_src),
                              fwd.commit_dst, wanted)
        start, stop = piece
        reach = fwd.ctx_len + fwd.positions.shape[0]
        if start == 0:  # the first piece carries the frame's commit; a fresh record of its outputs
            self.pieces[fwd.job_id] = _Pieces(fwd)
            return StageFrame(job, x[:stop], fwd.ctx_len, fwd.positions[:stop], None, tuple(fwd.commit_src),
                              fwd.commit_dst, wanted, reach)
        # A later piece: its rows follow the earlier pieces' in the cache (slot = position).
        return StageFrame(job, x[start:stop], fwd.ctx_len + start, fwd.positions[start:stop], capture=wanted,
                          rope_reach=reach)

    def _check_piece(self, fwd: Forward, piece: Piece) -> None:
        """A piece is rows [start, stop) of a splittable frame, right after the rows run so far."""
        start, stop = piece
        if not splittable(fwd) or not 0 <= start < stop <= fwd.positions.shape[0]:
            raise StageInputError("piece of a prefill chunk (rows)", f"[0, {fwd.positions.shape[0]})", piece)
        part = self.pieces.get(fwd.job_id)
        done = part.rows if part is not None and part.fwd is fwd else 0
        if start != done:
            raise StageInputError("first row of the next piece of a frame", done, start)

    def _message(self, fwd: Forward, h: torch.Tensor, captured: dict[int, torch.Tensor],
                 forward_s: float) -> Forward | Result:
        """The message this stage sends for fwd, given its hidden states and captured layers."""
        aux, aux_scale = self._aux(fwd, captured)
        if self.config.is_tail and fwd.phase == "prefill":
            # The coordinator samples from the last prompt row only; aux features (which the
            # drafter needs for every prompt token) keep all rows.
            h = h[-1:]
        hidden, hidden_scale = to_wire(h, self.config.wire_dtype)
        compute_s = (*fwd.compute_s, forward_s)
        if self.config.is_tail:
            return Result(
                job_id=fwd.job_id, epoch=fwd.epoch, round=fwd.round, hidden=hidden, hidden_scale=hidden_scale,
                aux=aux, aux_scale=aux_scale, receipts=fwd.receipts, compute_s=compute_s, clock_s=fwd.clock_s,
            )
        return Forward(
            job_id=fwd.job_id, epoch=fwd.epoch, round=fwd.round, nonce=fwd.nonce, phase=fwd.phase,
            ctx_len=fwd.ctx_len, positions=fwd.positions, commit_src=fwd.commit_src, commit_dst=fwd.commit_dst,
            tree_parents=fwd.tree_parents, hidden=hidden, hidden_scale=hidden_scale, aux=aux, aux_scale=aux_scale,
            want_aux_layers=fwd.want_aux_layers, receipts=fwd.receipts, compute_s=compute_s,
            clock_s=fwd.clock_s, prefix_job=fwd.prefix_job, prefix_len=fwd.prefix_len,
        )

    def _aux(self, fwd: Forward, captured: dict[int, torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Append this stage's captured layers to the aux features riding the frame,
        in the order the coordinator listed them."""
        if not captured:
            return fwd.aux, fwd.aux_scale
        parts = []
        if fwd.aux is not None:
            parts.append(from_wire(fwd.aux, fwd.aux_scale, torch.float32))
        parts += [captured[layer].float() for layer in fwd.want_aux_layers if layer in captured]
        return to_wire(torch.cat(parts, dim=-1), self.config.aux_dtype or self.config.wire_dtype)

