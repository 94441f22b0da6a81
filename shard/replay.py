"""Recompute a stage's logged frames of one (job, epoch) in as few forwards as is exact.

A decode or verify frame's output depends on the K/V the stage held when it ran, so an
audit replays every frame of the epoch. Frame by frame that costs as many forwards as the
ring spent; instead `plan_replay` follows the stage's KV slots symbolically (which row of
which frame sits in each slot, commits included) and gives every row the set of rows it
attended to. In the frames an engine sends, that set is always one root path: the
committed context is a chain whose every row saw exactly the rows before it, and a tree
node sees that context plus its ancestors. So all rows of all frames, rejected draft nodes
included, form one tree, and one tree-masked forward (Stage.forward with `tree_parents`)
reproduces every frame's output: the same maths, only summed in another order, which the
audit tolerances already allow.

A segment holds at most `max_rows` rows (the mask is rows x rows); the next one starts on
the committed context its first frame sees, gathered to slots [0, C) of the replay cache
by that frame's commit. Frames whose rows would not form such a tree (a slot read before
any frame wrote it, a context that is not one root path, a shrinking context) are
replayed one at a time, as the stage ran them: exact for any frame sequence.

Run by the auditor on its own slice (coordinator.trust.audit) and by a verifier node for it
(shard.verifier). It does not fetch frames, check digests or compare outputs (the auditor does).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Generator
from dataclasses import dataclass

import torch

from shard.activations import from_wire
from shard.stage import Stage
from shard.stage_worker import DRAFT_SLACK_SLOTS, StageWorker, WorkerConfig
from shard.wire.messages import Forward

REPLAY_JOB_ID = "audit"
# A Forward's per-row tensors (one row per position): what cutting or merging frames slices.
_ROW_FIELDS = ("positions", "tokens", "hidden", "hidden_scale", "aux", "aux_scale")


@dataclass(frozen=True)
class Segment:
    """Frames replayed as one forward: their kept rows, in order, as a tree over `gather`."""

    frames: tuple[int, ...]  # indices into the replayed frame list, in order
    keep: tuple[tuple[int, ...], ...]  # per frame: its rows replayed (indices within the frame)
    gather: tuple[int, ...]  # replay-cache slots of the base context rows, moved to [0, C) first
    parents: tuple[int, ...]  # per kept row: parent row within the segment; -1 = sees the whole base


def _merge_key(f: Forward) -> tuple:
    """Frames are concatenated only if their tensors concatenate and want the same aux."""
    return (f.tokens is None, f.want_aux_layers, None if f.hidden is None else f.hidden.dtype,
            None if f.aux is None else (f.aux.dtype, f.aux.shape[1]))


def _trace(frames: list[Forward]) -> tuple[list[int], list[list[int]]] | None:
    """Follow the stage's KV slots through `frames`: each row's parent (global row ids,
    -1: attended to no context) and each frame's context rows; None if some context is
    not one root path (then no single tree reproduces the frames)."""
    parent_of: list[int] = []
    contexts: list[list[int]] = []
    slot_rows: dict[int, int] = {}  # the stage's KV slot -> global row whose K/V is there now
    path_ok = 0  # slots [0, path_ok) hold a checked root path, unchanged since the check
    for f in frames:
        t = f.positions.shape[0]
        if f.commit_src:  # gathered in order, copy first (as JobCache.commit)
            moved = [slot_rows.get(s) for s in f.commit_src]
            for i, g in enumerate(moved):
                if g is None:
                    slot_rows.pop(f.commit_dst + i, None)
                else:
                    slot_rows[f.commit_dst + i] = g
            path_ok = min(path_ok, f.commit_dst)
        ctx = [slot_rows.get(s, -1) for s in range(f.ctx_len)]
        for s in range(path_ok, f.ctx_len):
            if ctx[s] < 0 or parent_of[ctx[s]] != (ctx[s - 1] if s else -1):
                return None
        if t == 0:
            return None
        tree = None if f.tree_parents is None else f.tree_parents.tolist()
        g0 = len(parent_of)
        for j in range(t):
            p = tree[j] if tree is not None else j - 1
            parent_of.append(g0 + p if p >= 0 else (ctx[-1] if ctx else -1))
        for j in range(t):
            slot_rows[f.ctx_len + j] = g0 + j
        path_ok = f.ctx_len
        contexts.append(ctx)
    return parent_of, contexts


def plan_replay(frames: list[Forward], max_rows: int, cut: int = 0) -> list[Segment] | None:
    """Segments that reproduce `frames` (the stage's frames of one epoch, from the first,
    in processing order), or None if their rows do not form one tree. Pure. `cut` > 0: a
    segment starts at frame `cut` (no segment holds frames on both sides of it) and every
    row before it is kept, so the segments before it, and the replay cache they leave,
    depend only on the frames before it (`LeadState`): forks of one source at different
    prefix lengths (prompts that differ only in their last tokens) read the same state.

    Kept rows: every row a later frame attends to as context (prompt rows, roots, accepted
    draft nodes: everything a token or a later K/V depends on) and every row of the last
    frame (what it led to is not in the stage's log). Rejected draft nodes are dropped:
    nothing read them, and the stage could not know they would be rejected when it
    computed them."""
    traced = _trace(frames)
    if traced is None:
        return None
    parent_of, contexts = traced
    needed = {g for ctx in contexts for g in ctx}
    first_row = [0]
    for f in frames:
        first_row.append(first_row[-1] + f.positions.shape[0])
    needed.update(range(first_row[-2], first_row[-1]))
    if cut:  # the lead whole: its state then serves a fork at any prefix length
        needed.update(range(first_row[cut]))
    segments: list[Segment] = []
    seg_frames: list[int] = []
    seg_keep: list[tuple[int, ...]] = []
    seg_gather: tuple[int, ...] = ()
    seg_parents: list[int] = []
    cache_slot: dict[int, int] = {}  # kept global row -> its slot in the replay cache now
    local_of: dict[int, int] = {}  # kept global row -> its row in the current segment (base: < 0)
    base: list[int] = []
    key = None
    for fi, (f, ctx) in enumerate(zip(frames, contexts)):
        keep = [j for j in range(f.positions.shape[0]) if first_row[fi] + j in needed]
        if not keep:
            continue
        extends = not base or (len(ctx) >= len(base) and ctx[len(base) - 1] == base[-1])
        if (not seg_frames or not extends or _merge_key(f) != key or len(seg_parents) + len(keep) > max_rows
                or (cut and fi >= cut > seg_frames[-1])):
            if any(g not in cache_slot for g in ctx):
                return None
            if seg_frames:
                segments.append(Segment(tuple(seg_frames), tuple(seg_keep), seg_gather, tuple(seg_parents)))
            seg_frames, seg_keep, seg_parents, key = [], [], [], _merge_key(f)
            seg_gather = tuple(cache_slot[g] for g in ctx)
            base = ctx
            cache_slot = {g: i for i, g in enumerate(ctx)}
            local_of = {g: i - len(base) for i, g in enumerate(ctx)}
        for j in keep:
            g, gp = first_row[fi] + j, parent_of[first_row[fi] + j]
            if gp == (base[-1] if base else -1):
                local = -1
            else:
                local = local_of.get(gp, -1)
                if local < 0:  # a parent inside the base but not its end: context shrank
                    return None
            cache_slot[g] = len(base) + len(seg_parents)
            local_of[g] = len(seg_parents)
            seg_parents.append(local)
        seg_frames.append(fi)
        seg_keep.append(tuple(keep))
    if seg_frames:
        segments.append(Segment(tuple(seg_frames), tuple(seg_keep), seg_gather, tuple(seg_parents)))
    return segments


def _cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
    return None if ts[0] is None else torch.cat(ts)  # type: ignore[arg-type]


def _rows(t: torch.Tensor | None, keep: tuple[int, ...]) -> torch.Tensor | None:
    return None if t is None else t[list(keep)]


@dataclass
class ReplayStats:
    forwards: int = 0
    rows: int = 0  # rows recomputed (a lead kept from an earlier replay is not)
    lead_kept: bool = False  # the lead's state came from the LeadCache


# Per frame: (rows recomputed, as indices within the frame (K,); hidden (K, H); aux (K, k*H) or None).
Replayed = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


@dataclass(frozen=True)
class LeadState:
    """What replaying a fork's lead frames (its source's, before the job's own: the forked
    job's audit, coordinator.trust.prefix_audit) left: the replay cache's K/V, slots [0, S)
    after the lead's segments (planned with a cut at the job's first frame, every lead row
    kept). The same lead frames, slice and formats replay to the same state, so a verifier
    keeps it for the next fork of that source (shard.verifier), at whatever prefix length,
    and replays only the job's own frames then. The lead's own rows are not kept: an audit
    never compares them (replay_steps does not return them)."""

    k: torch.Tensor  # (layers, kv_heads, S, head_dim)
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class LeadCache:
    """LeadStates kept for later replays, least recently used first out, while they fit
    `max_bytes` (0: none kept). Keys: the caller's digest of the lead frames, slice and
    formats, with the lead's pieces and segments (which rows of it the job reads: replay_steps)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.held = max_bytes, 0
        self._states: OrderedDict[tuple, LeadState] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, key: tuple) -> LeadState | None:
        state = self._states.get(key)
        self.hits, self.misses = self.hits + (state is not None), self.misses + (state is None)
        if state is not None:
            self._states.move_to_end(key)
        return state

    def put(self, key: tuple, state: LeadState) -> None:
        if state.nbytes > self.max_bytes or key in self._states:
            return
        self._states[key], self.held = state, self.held + state.nbytes
        while self.held > self.max_bytes:
            self.held -= self._states.popitem(last=False)[1].nbytes

    def __len__(self) -> int:
        return len(self._states)


def replay(stage: Stage, wire_dtype: str, frames: list[Forward], max_rows: int = 1024,
           stats: ReplayStats | None = None, *, aux_dtype: str | None = None,
           frame_by_frame: bool = False) -> list[Replayed | None]:
    """Recompute `frames` on a fresh cache, in f32, as this slice sends them after the
    wire codec (before a tail's trim); None for a frame none of whose rows are kept.
    `frame_by_frame`: one forward per frame, as the stage ran them, for stages whose maths
    is not stable under re-summation (a quantised stage rounds activations to bf16 in every
    matmul, so the tree forward's last-bit differences grow layer by layer into bf16 steps)."""
    steps = replay_steps(stage, wire_dtype, frames, max_rows, stats, aux_dtype=aux_dtype, frame_by_frame=frame_by_frame)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def split_long(frames: list[Forward], max_rows: int) -> tuple[list[Forward], list[tuple[int, int]]]:
    """`frames` with each one longer than max_rows that is one causal chain (no tree, no
    commit: a prefill chunk, a verify chain) cut into consecutive pieces of at most max_rows
    rows, each writing the slots after the one before it (the same maths as the stage's own
    pieces, shard.batch_plan); and per piece, (its frame's index, the piece's first row)."""
    out: list[Forward] = []
    origin: list[tuple[int, int]] = []
    for i, f in enumerate(frames):
        t = f.positions.shape[0]
        if t <= max_rows or f.tree_parents is not None or f.commit_src:
            out.append(f)
            origin.append((i, 0))
            continue
        for a in range(0, t, max_rows):
            keep = tuple(range(a, min(a + max_rows, t)))
            out.append(dataclasses.replace(f, ctx_len=f.ctx_len + a, **{
                name: _rows(getattr(f, name), keep) for name in _ROW_FIELDS}))
            origin.append((i, a))
    return out, origin


def _joined(pieces: list[Replayed | None], origin: list[tuple[int, int]], n: int) -> list[Replayed | None]:
    """Per frame of `split_long`'s input (n of them), its pieces' replayed rows back together."""
    parts: list[list[Replayed]] = [[] for _ in range(n)]
    for got, (i, a) in zip(pieces, origin):
        if got is not None:
            parts[i].append((got[0] + a, got[1], got[2]))
    return [None if not ps else (torch.cat([p[0] for p in ps]), torch.cat([p[1] for p in ps]),
                                 _cat([p[2] for p in ps])) for ps in parts]


def replay_steps(stage: Stage, wire_dtype: str, frames: list[Forward], max_rows: int = 1024,
                 stats: ReplayStats | None = None, *, aux_dtype: str | None = None, frame_by_frame: bool = False,
                 lead: int = 0, lead_key: bytes = b"",
                 lead_cache: LeadCache | None = None) -> Generator[bool, None, list[Replayed | None]]:
    """`replay`, one forward (a segment of at most max_rows rows, or one frame) per step:
    the generator yields after each (whether another forward follows) and returns replay's list. A caller that shares its
    CPU with other work (a ring stage answering an audit: shard.verifier) runs the steps
    one at a time and lets that work in between. Frames longer than max_rows replay in
    pieces (`split_long`) unless frame_by_frame. Advance it from one thread at a time.
    `lead`: frames before the job's own (a fork's source's), replayed for the K/V they leave
    and returned as None (a fork's audit never compares its source's rows:
    coordinator.trust.compare.Logged.own): the segments are cut there, and with `lead_cache`
    what those frames left in an earlier replay under the same `lead_key` (the caller's
    digest of them and of everything else their result depends on) and the same lead
    segments stands in for replaying them (`LeadState`), or what they leave now is kept
    there. Not for a replay frame by frame (the lead is replayed then as any frame)."""
    whole = len(frames)
    frames, origin = split_long(frames, max_rows) if not frame_by_frame else (frames, [(i, 0) for i in range(whole)])
    cut = next((n for n, (i, _) in enumerate(origin) if i >= lead), len(frames)) if lead else 0
    segments = None if frame_by_frame else plan_replay(frames, max_rows, cut)
    leading = 0 if segments is None or not cut else sum(seg.frames[-1] < cut for seg in segments)
    key = (lead_key, cut, tuple(segments[:leading])) if leading and segments and lead_cache is not None else None
    if segments is None:  # one forward per frame, exactly as the stage ran them
        segments = [Segment((i,), (tuple(range(f.positions.shape[0])),), (), ()) for i, f in enumerate(frames)]
        merged = [dataclasses.replace(f, job_id=REPLAY_JOB_ID, receipts=(), compute_s=(), prefix_job=None, prefix_len=0)
                  for f in frames]
    else:
        merged = []
        for seg in segments:
            parts = [(frames[i], keep) for i, keep in zip(seg.frames, seg.keep)]
            merged.append(dataclasses.replace(
                parts[0][0], job_id=REPLAY_JOB_ID, receipts=(), compute_s=(), phase="verify", prefix_job=None, prefix_len=0,
                ctx_len=len(seg.gather), commit_src=seg.gather, commit_dst=0,
                tree_parents=torch.tensor(seg.parents, dtype=torch.int32),
                **{name: _cat([_rows(getattr(f, name), keep) for f, keep in parts])
                   for name in _ROW_FIELDS}))
    slots = max((m.ctx_len + m.positions.shape[0] for m in merged), default=1)
    worker = StageWorker(stage, WorkerConfig(wire_dtype=wire_dtype, aux_dtype=aux_dtype, is_tail=False,
                                             max_kv_bytes=1 << 40,
                                             max_context_tokens=max(slots - DRAFT_SLACK_SLOTS, 1)))
    out: list[Replayed | None] = [None] * len(frames)
    done = 0
    lead_state = None if key is None or lead_cache is None else lead_cache.get(key)
    if lead_state is not None:  # the key holds the lead's pieces (cut) and segments: it is this plan's
        job = worker.cache.open(REPLAY_JOB_ID, slots)
        held = lead_state.k.shape[2]
        job.ensure(held)
        job.k[:, :, :held], job.v[:, :, :held] = lead_state.k, lead_state.v
        done = leading
        if stats is not None:
            stats.lead_kept = True
    for n, (fwd, seg) in enumerate(zip(merged, segments), start=1):
        if n <= done:
            continue
        res = worker.process(fwd)
        hidden = from_wire(res.hidden, res.hidden_scale, torch.float32)  # (sum K, H)
        aux = None if res.aux is None else from_wire(res.aux, res.aux_scale, torch.float32)
        start = 0
        for i, keep in zip(seg.frames, seg.keep):
            k = len(keep)
            out[i] = (torch.tensor(keep), hidden[start:start + k], None if aux is None else aux[start:start + k])
            start += k
        if stats is not None:
            stats.forwards += 1
            stats.rows += start
        if n == leading and key is not None and lead_cache is not None:
            job, held = worker.cache.get(REPLAY_JOB_ID), max(m.ctx_len + m.positions.shape[0] for m in merged[:n])
            lead_cache.put(key, LeadState(job.k[:, :, :held].clone(), job.v[:, :, :held].clone()))
        yield n < len(segments)
    worker.end_job(REPLAY_JOB_ID)
    out[:cut] = [None] * cut
    return _joined(out, origin, whole)
