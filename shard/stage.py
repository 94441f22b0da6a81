"""A stage's forward over its contiguous layers, plus the model's two ends.

Plain decoder maths (RMSNorm, rotary, grouped-query attention, a gated MLP or a mixture
of experts), written to be read in one sitting. Knows nothing of the wire, fp8, peers or
rings: callers hand it tensors and slot bookkeeping, it hands back hidden states. Weights
arrive as the store's per-layer dicts and become LayerWeights at load (shard.layer_weights:
fused matmuls, a family's norm offset folded in, the MLP block it holds), so what differs
between families is data on the layer, not branches in the forward: a norm that is None
is not applied, a sliding layer gets the windowed mask and its own rotary table.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from shard.arch import ModelConfig
from shard.errors import ShardError
from shard.blocks import rms_norm
from shard.kvcache import JobCache
from shard.layer_weights import LayerWeights
from shard.layers import LayerRange
from shard.linear import Linear
from shard.rope import RotaryTable, apply_rotary


class StageInputError(ShardError):
    """A frame's slot bookkeeping or shapes do not fit this stage (what, limit, actual)."""

    def __init__(self, what: str, limit: object, actual: object) -> None:
        self.what, self.limit, self.actual = what, limit, actual
        super().__init__(f"{what} (limit {limit}, got {actual})")


def attention_mask(ctx_len: int, tree_parents: torch.Tensor | None, t: int, device) -> torch.Tensor | None:
    """Bool (T, ctx_len + T): every query sees the whole committed context, plus, among
    this frame's tokens, itself and its ancestors (a causal chain when parents is None)."""
    if t == 1:
        return None  # one query attends to everything: no mask needed
    if tree_parents is None:
        within = torch.ones(t, t, dtype=torch.bool, device=device).tril()
    else:
        within = torch.eye(t, dtype=torch.bool, device=device)
        parents = tree_parents.tolist()
        for i, p in enumerate(parents):
            if p >= 0:
                within[i] |= within[p]  # parents precede children, so row p is final
    ctx = torch.ones(t, ctx_len, dtype=torch.bool, device=device)
    return torch.cat([ctx, within], dim=1)


def window_mask(ctx_len: int, tree_parents: torch.Tensor | None, positions: torch.Tensor, window: int) -> torch.Tensor:
    """Bool (T, ctx_len + T): attention_mask, less the keys `window` or more positions
    behind the query (a sliding-window layer). Committed slots hold their own position."""
    t = positions.shape[0]
    key_pos = torch.cat([torch.arange(ctx_len, device=positions.device), positions])  # (S,)
    near = (positions[:, None] - key_pos[None, :]) < window  # (T, S)
    mask = attention_mask(ctx_len, tree_parents, t, positions.device)
    return near if mask is None else mask & near


@dataclass(frozen=True)
class StageFrame:
    """One job's frame for Stage.forward_batch (the arguments of Stage.forward)."""

    job: JobCache
    x: torch.Tensor  # token ids (T,) on the head stage, else hidden states (T, H)
    ctx_len: int
    positions: torch.Tensor  # (T,)
    tree_parents: torch.Tensor | None = None
    commit_src: tuple[int, ...] = ()
    commit_dst: int = 0
    capture: tuple[int, ...] = ()
    # A piece of a longer prefill chunk (StageWorker): the chunk's end position + 1, by which
    # longrope picks its factors for every piece as for the whole chunk (0: this frame's own).
    rope_reach: int = 0


@dataclass
class _Plan:
    """A checked frame ready to run: its rows of the batch and its attention structure."""

    index: int  # in the batch as given
    job: JobCache
    ctx_len: int
    h: torch.Tensor  # (T, H) input rows
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin (T, D)
    local_rope: tuple[torch.Tensor, torch.Tensor]
    causal: bool
    mask: torch.Tensor | None
    local_mask: torch.Tensor | None
    capture: set[int]
    rows: slice = field(default_factory=lambda: slice(0))  # set by forward_batch: this frame's rows of (T_total, H)
    # The job's cache, every layer at once (views taken once per forward, not per layer):
    # this frame's slots (L, Hkv, T, D) and the slots it attends to, (L, 1, Hkv, S, D).
    k_new: torch.Tensor | None = None
    v_new: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None


class Stage:
    """Layers `layers` of a model, computing frames for many jobs (each with its JobCache)."""

    def __init__(
        self,
        cfg: ModelConfig,
        layers: LayerRange,
        weights: dict[int, dict[str, torch.Tensor]],
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        embedding: torch.Tensor | None = None,
        pack_weights: bool = True,
    ) -> None:
        """`pack_weights=False` keeps the weights in torch's default layout (shard.linear):
        for benchmarks that compare the two."""
        if layers.end > cfg.num_layers:
            raise StageInputError("layer range end", cfg.num_layers, layers.end)
        missing = [i for i in layers if i not in weights]
        if missing:
            raise StageInputError("layers missing from the weights", f"{layers}", missing)
        self.cfg, self.layers, self.dtype, self.device = cfg, layers, dtype, torch.device(device)
        self.blocks = [LayerWeights.load(cfg, i, weights[i], dtype, device, pack=pack_weights) for i in layers]
        self.embedding = embedding.to(device=device, dtype=dtype) if embedding is not None else None
        self.embedding_scale = torch.tensor(cfg.embedding_scale, dtype=dtype, device=device)
        self.rotary = RotaryTable(cfg, dtype, device)
        # Sliding layers may rotate with their own base (Gemma 3's local rope).
        self.local_rotary = self.rotary if cfg.local_rope_theta is None else RotaryTable(
            replace(cfg, rope_theta=cfg.local_rope_theta, rope_type="default", rope_params=()), dtype, device)

    @property
    def is_head(self) -> bool:
        return self.embedding is not None

    def forward(
        self,
        job: JobCache,
        x: torch.Tensor,
        *,
        ctx_len: int,
        positions: torch.Tensor,
        tree_parents: torch.Tensor | None = None,
        commit_src: Sequence[int] = (),
        commit_dst: int = 0,
        capture: Iterable[int] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run this stage on one frame of T tokens: forward_batch of one, its error raised.

        x: token ids (T,) on the head stage, else hidden states (T, H). The commit (slots
        gathered to [commit_dst, ...)) is applied first; the frame's K/V then go to slots
        [ctx_len, ctx_len + T). Returns (hidden (T, H), {layer: output (T, H)} for the
        absolute layer indices in `capture` that this stage owns).
        """
        [out] = self.forward_batch([StageFrame(job, x, ctx_len, positions, tree_parents, tuple(commit_src),
                                               commit_dst, tuple(capture))])
        if isinstance(out, ShardError):
            raise out
        return out

    @torch.inference_mode()
    def forward_batch(self, frames: Sequence[StageFrame]) -> list[tuple[torch.Tensor, dict[int, torch.Tensor]] | ShardError]:
        """Run frames of distinct jobs in one forward: per frame, what forward returns, or
        the ShardError that frame alone raised (the others run as if it were not there).

        The weight-heavy parts (projections, MLP) see all frames' rows as one (T_total, H)
        matmul, reading the weights once; attention runs per job against its own cache,
        with its own positions and mask, so a job's rows never see another's.
        """
        if len({id(f.job) for f in frames}) != len(frames):
            raise ValueError("a batch holds at most one frame per job (a job's frames depend on each other)")
        outputs: list = [None] * len(frames)
        plans: list[_Plan] = []
        for i, frame in enumerate(frames):
            try:
                plans.append(self._plan(i, frame))
            except ShardError as exc:
                outputs[i] = exc
        if plans:
            start = 0
            for p in plans:
                p.rows, start = slice(start, start + p.h.shape[0]), start + p.h.shape[0]
            h = _cat([p.h for p in plans])  # (T_total, H)
            rope = tuple(_cat([p.rope[j] for p in plans]) for j in (0, 1))  # cos, sin: (T_total, D) each
            local_rope = tuple(_cat([p.local_rope[j] for p in plans]) for j in (0, 1))
            captured: list[dict[int, torch.Tensor]] = [{} for _ in plans]
            for local, (layer, w) in enumerate(zip(self.layers, self.blocks)):
                a = self._attention(plans, local, self._norm(h, w.attn_norm), w, local_rope if w.sliding else rope)
                h = h + self._norm(a, w.attn_out_norm)
                h = h + self._norm(w.mlp(self._norm(h, w.mlp_norm)), w.mlp_out_norm)
                for p, caught in zip(plans, captured):
                    if layer in p.capture:
                        caught[layer] = h[p.rows]
            for p, caught in zip(plans, captured):
                outputs[p.index] = (h[p.rows] if len(plans) > 1 else h, caught)
        return outputs

    def _plan(self, index: int, frame: StageFrame) -> _Plan:
        """Check one frame, apply its commit, grow its cache and build its input rows,
        rotary rows and masks. Raises ShardError (StageInputError, CacheError,
        PositionError) before anything of the batch has run."""
        cfg, x, ctx_len, positions, tree_parents = self.cfg, frame.x, frame.ctx_len, frame.positions, frame.tree_parents
        t = x.shape[0]
        if positions.shape != (t,):
            raise StageInputError("positions shape", (t,), tuple(positions.shape))
        if frame.commit_src and frame.commit_dst + len(frame.commit_src) > ctx_len:
            raise StageInputError("committed slots end past ctx_len", ctx_len, frame.commit_dst + len(frame.commit_src))
        if self.is_head:
            if x.dim() != 1:
                raise StageInputError("head stage input rank (token ids)", 1, x.dim())
            if t and (int(x.min()) < 0 or int(x.max()) >= cfg.vocab_size):
                raise StageInputError("token id", cfg.vocab_size - 1, int(x.max()) if int(x.min()) >= 0 else int(x.min()))
        elif x.shape != (t, cfg.hidden_size):
            raise StageInputError("hidden shape", (t, cfg.hidden_size), tuple(x.shape))
        rope = self.rotary.lookup(positions, frame.rope_reach)  # cos, sin: (T, D) each
        local_rope = self.local_rotary.lookup(positions, frame.rope_reach)
        frame.job.ensure(ctx_len + t)
        frame.job.commit(list(frame.commit_src), frame.commit_dst)
        if self.is_head:
            h = F.embedding(x.to(self.device, torch.long), self.embedding) * self.embedding_scale  # (T, H)
        else:
            h = x.to(self.device, self.dtype)
        # A fresh causal chain (prefill from slot 0) can use SDPA's own causal kernel; every
        # other frame shape gets an explicit mask. Sliding layers need the window cut only
        # once some query is `window` positions past slot 0.
        causal = ctx_len == 0 and tree_parents is None and t > 1
        mask = None if causal else attention_mask(ctx_len, tree_parents, t, self.device)
        windowed = cfg.sliding_window is not None and t and int(positions.max()) >= cfg.sliding_window
        local_mask = window_mask(ctx_len, tree_parents, positions.to(self.device), cfg.sliding_window) if windowed else mask
        job, end = frame.job, ctx_len + t
        return _Plan(index, job, ctx_len, h, rope, local_rope, causal, mask, local_mask, set(frame.capture),
                     k_new=job.k[:, :, ctx_len:end], v_new=job.v[:, :, ctx_len:end],
                     keys=job.k[:, None, :, :end], values=job.v[:, None, :, :end])

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return x if weight is None else rms_norm(x, weight, self.cfg.rms_norm_eps)

    def _attention(self, plans: list[_Plan], local: int, x, w: LayerWeights, rope) -> torch.Tensor:
        cfg = self.cfg
        t, d, hq, hkv = x.shape[0], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        cos, sin = rope
        qkv = w.qkv(x)  # (T_total, (Hq + 2 Hkv) D): every job's rows in one matmul
        q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
        q = apply_rotary(self._norm(q.view(t, hq, d), w.q_norm).transpose(0, 1), cos, sin)  # (Hq, T_total, D)
        k = apply_rotary(self._norm(k.view(t, hkv, d), w.k_norm).transpose(0, 1), cos, sin)  # (Hkv, T_total, D)
        v = v.view(t, hkv, d).transpose(0, 1)  # (Hkv, T_total, D)
        rows = [p.h.shape[0] for p in plans]
        qs, ks, vs = (_split(part, rows) for part in (q, k, v))  # each job's rows: one op per layer, not one per job
        outs = []
        for p, q_j, k_j, v_j in zip(plans, qs, ks, vs):  # attention per job, against its own cache and mask
            mask = p.local_mask if w.sliding else p.mask
            p.k_new[local].copy_(k_j)  # this frame's K/V to slots [ctx_len, ctx_len + T)
            p.v_new[local].copy_(v_j)
            outs.append(self._attend(q_j, p.keys[local], p.values[local], mask, p.causal and mask is None))
        out = _cat(outs, dim=1)  # (Hq, T_total, D)
        return w.o(out.transpose(0, 1).reshape(t, hq * d))  # (T_total, H)

    def _attend(self, q, keys, values, mask, causal) -> torch.Tensor:
        """One job's attention core: q (Hq, T, D), keys and values (1, Hkv, S, D) with S =
        ctx_len + T (this frame's own K/V written) -> (Hq, T, D)."""
        cfg = self.cfg
        t, d, hq, hkv = q.shape[1], cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        if t == 1 and hq != hkv:
            # Decode: fold each KV head's G query heads into query rows, (1, Hkv, G, D): the
            # same maths as repeating K/V per query head, without the copy. 4-D, or CPU SDPA
            # runs its reference maths (3-D: 2x slower over 1900 keys). Reshape, not view:
            # CUDA's kernels hand the output back laid out (1, G, Hkv, D) in memory.
            return F.scaled_dot_product_attention(q.reshape(1, hkv, hq // hkv, d), keys, values, attn_mask=mask,
                                                  scale=cfg.attention_scale).reshape(hq, 1, d)  # (Hq, 1, D)
        # A batch dimension of 1: CPU SDPA's fused kernels want 4-D inputs (without it,
        # GQA and masked frames fall back to the slow reference path).
        return F.scaled_dot_product_attention(q[None], keys, values, attn_mask=mask, is_causal=causal,
                                              scale=cfg.attention_scale, enable_gqa=hq != hkv)[0]  # (Hq, T, D)


def _split(x: torch.Tensor, rows: list[int]) -> Sequence[torch.Tensor]:
    """x (heads, T_total, D) -> each job's (heads, T_j, D) view."""
    return (x,) if len(rows) == 1 else x.split(rows, dim=1)


def _cat(parts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


class OutputHead:
    """Final RMSNorm and LM head (tied to the embedding when the model ties them)."""

    def __init__(self, cfg: ModelConfig, norm: torch.Tensor, lm_head: torch.Tensor, *, dtype=torch.float32, device="cpu",
                 pack_weights: bool = True) -> None:
        self.cfg = cfg
        self.norm = (norm.float() + cfg.norm_offset).to(device=device, dtype=dtype)  # Gemma's (1 + w), in fp32
        self.lm_head = Linear(lm_head.to(device=device, dtype=dtype), pack=pack_weights)  # H -> V

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (T, H) -> logits (T, V) in fp32."""
        h = rms_norm(hidden.to(self.norm.dtype), self.norm, self.cfg.rms_norm_eps)
        return self.lm_head(h).float()
