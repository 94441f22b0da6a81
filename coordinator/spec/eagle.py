"""The EAGLE-3 draft head and the drafter that runs it on the coordinator.

The head is one Llama-style decoder layer. At position p it reads a *pair*: the feature
of position p-1 (the fused outputs of three target layers, or the head's own output when
drafting further ahead) and the embedding of the token at p; its output is the feature
of position p, and its LM head over a reduced draft vocabulary predicts the token at
p+1. `d2t` maps draft ids back to the target's.

The drafter keeps the head's KV cache for the committed context (every pair whose
feature and token are both committed, the whole prompt included); drafting writes the
tree's pairs after it and never advances the committed length, so speculative K/V is
overwritten by the next observe.

This module does not know the ring, the wire, acceptance, or how features reach it: the
engine hands `observe` committed tokens with their aux rows. Training's unroll
(`coordinator.spec.eagle_train`) composes the same `pair_qkv` / `pair_out` functions.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from coordinator.spec.draft_tree import DraftTree
from coordinator.spec.drafting import DraftBudget
from coordinator.spec.source import DraftSource
from shard.arch import ModelConfig
from shard.linear import Linear
from shard.rope import RotaryTable, apply_rotary
from shard.stage import rms_norm
from coordinator.errors import EagleHeadError

WEIGHTS_FILE = "eagle3.safetensors"
MANIFEST_FILE = "manifest.json"
HEADS_DIR = pathlib.Path(__file__).resolve().parent / "heads"



@dataclass(frozen=True)
class EagleConfig:
    """Shapes of the head; rope, eps and the token embedding come from the target."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    draft_vocab_size: int
    aux_layers: tuple[int, ...]

    @classmethod
    def for_target(cls, target: ModelConfig, aux_layers: Sequence[int], draft_vocab_size: int) -> EagleConfig:
        return cls(target.hidden_size, target.intermediate_size, target.num_heads, target.num_kv_heads,
                   target.head_dim, draft_vocab_size, tuple(int(x) for x in aux_layers))

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        h, d = self.hidden_size, self.head_dim
        qkv = (self.num_heads + 2 * self.num_kv_heads) * d
        return {
            "fc.weight": (h, len(self.aux_layers) * h),  # fuses low, mid, high features
            "input_norm.weight": (h,),  # on the token embedding
            "hidden_norm.weight": (h,),  # on the feature
            "wqkv.weight": (qkv, 2 * h),  # q, k, v from [embedding, feature]
            "wo.weight": (h, self.num_heads * d),
            "post_norm.weight": (h,),
            "w_gate_up.weight": (2 * self.intermediate_size, h),
            "w_down.weight": (h, self.intermediate_size),
            "norm.weight": (h,),
            "lm_head.weight": (self.draft_vocab_size, h),
        }


def init_weights(config: EagleConfig, target_embedding: torch.Tensor, target_norm: torch.Tensor,
                 d2t: torch.Tensor, generator: torch.Generator | None = None) -> dict[str, torch.Tensor]:
    """Fresh weights that start as "the feature is the high aux layer": fc picks the last
    aux block, the final norm and the LM head are the target's (the LM head restricted to
    the draft vocabulary), so the head starts near the target's own prediction from the
    previous position instead of at noise; other matrices are small normal."""
    w = {}
    for name, shape in config.tensor_shapes().items():
        if len(shape) == 1:
            w[name] = target_norm.clone().float() if name == "norm.weight" else torch.ones(shape)
        else:
            w[name] = torch.randn(shape, generator=generator) * 0.02
    h = config.hidden_size
    w["fc.weight"][:, -h:] += torch.eye(h)
    w["lm_head.weight"] = target_embedding[d2t].clone().float()
    return w


# -- the layer, as functions of a weight dict (autograd-friendly; training uses them) -------

# The weights that multiply: tensors when training, shard.linear.Linear in a loaded head.
MATMUL_WEIGHTS = ("fc.weight", "wqkv.weight", "wo.weight", "w_gate_up.weight", "w_down.weight", "lm_head.weight")


def linear(x: torch.Tensor, weight: torch.Tensor | Linear) -> torch.Tensor:
    """x (..., in) -> (..., out) through a weight tensor or a Linear."""
    return weight(x) if isinstance(weight, Linear) else F.linear(x, weight)


def fuse(w: dict[str, torch.Tensor], aux: torch.Tensor) -> torch.Tensor:
    """aux (..., k*H) target-layer outputs -> feature (..., H)."""
    return linear(aux, w["fc.weight"])


def pair_qkv(w, cfg: EagleConfig, eps: float, feat: torch.Tensor, emb: torch.Tensor,
             cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """feat, emb (..., T, H); cos/sin (T, D) -> q (..., Hq, T, D), k and v (..., Hkv, T, D)."""
    d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    x = torch.cat([rms_norm(emb, w["input_norm.weight"], eps), rms_norm(feat, w["hidden_norm.weight"], eps)], -1)  # (..., T, 2H)
    q, k, v = linear(x, w["wqkv.weight"]).split([hq * d, hkv * d, hkv * d], dim=-1)
    lead, t = x.shape[:-2], x.shape[-2]
    q = apply_rotary(q.reshape(*lead, t, hq, d).transpose(-2, -3), cos, sin)  # (..., Hq, T, D)
    k = apply_rotary(k.reshape(*lead, t, hkv, d).transpose(-2, -3), cos, sin)  # (..., Hkv, T, D)
    v = v.reshape(*lead, t, hkv, d).transpose(-2, -3)  # (..., Hkv, T, D)
    return q, k, v


def pair_out(w, eps: float, feat: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """feat (..., T, H), attention output (..., Hq, T, D) -> the pair's output feature (..., T, H).
    The residual stream starts at the feature, not the embedding (EAGLE-3)."""
    t = attn.shape[-2]
    h = feat + linear(attn.transpose(-2, -3).reshape(*attn.shape[:-3], t, -1), w["wo.weight"])
    gate, up = linear(rms_norm(h, w["post_norm.weight"], eps), w["w_gate_up.weight"]).chunk(2, dim=-1)
    return h + linear(F.silu(gate) * up, w["w_down.weight"])


def draft_logits(w, eps: float, g: torch.Tensor) -> torch.Tensor:
    """Output feature (..., H) -> logits over the draft vocabulary (..., Vd)."""
    return linear(rms_norm(g, w["norm.weight"], eps), w["lm_head.weight"])


# -- the head at inference --------------------------------------------------------------------


class PairCache:
    """K/V of one request's pairs, (Hkv, S, D) each, grown by doubling; slot j holds the
    pair at position j + 1. Who wrote which slot is the drafter's bookkeeping."""

    def __init__(self, config: EagleConfig) -> None:
        self.k = torch.zeros(config.num_kv_heads, 0, config.head_dim)
        self.v = self.k

    def reserve(self, slots: int) -> None:
        have = self.k.shape[1]
        if slots > have:
            grow = torch.zeros(self.k.shape[0], max(slots, 2 * have, 256) - have, self.k.shape[2])
            self.k = torch.cat([self.k, grow], dim=1)
            self.v = torch.cat([self.v, grow.clone()], dim=1)


class EagleHead:
    """Weights, the target's frozen embedding and rope; stateless, shared by requests."""

    def __init__(self, config: EagleConfig, target: ModelConfig, weights: dict[str, torch.Tensor],
                 d2t: torch.Tensor, embedding: torch.Tensor) -> None:
        shapes = config.tensor_shapes()
        for name, shape in shapes.items():
            got = tuple(weights[name].shape) if name in weights else None
            if got != shape:
                raise EagleHeadError("weights", name, shape, got)
        if d2t.shape != (config.draft_vocab_size,) or int(d2t.max()) >= target.vocab_size or int(d2t.min()) < 0:
            raise EagleHeadError("weights", "d2t", f"({config.draft_vocab_size},) ids < {target.vocab_size}",
                                 tuple(d2t.shape))
        self.config, self.target = config, target
        self.w = {name: weights[name].float() for name in shapes}  # what training and save_head read
        # The same weights for drafting, the matrices laid out for the device (shard.linear):
        # the engine's 48-node, depth-8 tree drafted in 19-33 ms instead of 38 (1 thread, dev VM).
        self.infer_w = {name: Linear(t) if name in MATMUL_WEIGHTS else t for name, t in self.w.items()}
        self.d2t = d2t.long()
        self.embedding = embedding.float()
        self.eps = target.rms_norm_eps
        self.rotary = RotaryTable(target, torch.float32)

    @classmethod
    def load(cls, path: str | pathlib.Path, target: ModelConfig, embedding: torch.Tensor,
             target_digest: str | None = None) -> EagleHead:
        """Load a head directory, checking the weights' sha256 against its manifest and,
        given `target_digest`, that the head was trained for that target model.

        Error handling: EagleHeadError names the file and the mismatch."""
        from safetensors.torch import load_file

        root = pathlib.Path(path)
        try:
            manifest = json.loads((root / MANIFEST_FILE).read_text())
        except (FileNotFoundError, json.JSONDecodeError) as exc:
            raise EagleHeadError(root / MANIFEST_FILE, "manifest", "a JSON manifest", type(exc).__name__) from None
        weights_path = root / WEIGHTS_FILE
        digest = hashlib.sha256(weights_path.read_bytes()).hexdigest() if weights_path.exists() else None
        if digest != manifest.get("sha256"):
            raise EagleHeadError(weights_path, "sha256", manifest.get("sha256"), digest)
        if target_digest is not None and manifest.get("target_digest") != target_digest:
            raise EagleHeadError(root / MANIFEST_FILE, "target model digest", target_digest, manifest.get("target_digest"))
        c = manifest["config"]
        config = EagleConfig(**{**c, "aux_layers": tuple(c["aux_layers"])})
        tensors = load_file(str(weights_path))
        return cls(config, target, tensors, tensors["d2t"], embedding)

    # Cached forward: pairs at `positions` write K/V at slots [at, at + T) and attend to
    # slots [0, at + T) under `visible` (T, at + T) bool (None: all committed plus causal).
    @torch.inference_mode()
    def forward(self, cache: PairCache, feat: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, at: int,
                visible: torch.Tensor | None = None) -> torch.Tensor:
        """feat (T, H), tokens (T,) target ids -> output features (T, H)."""
        t = tokens.shape[0]
        cos, sin = self.rotary.lookup(positions)  # (T, D) each
        q, k, v = pair_qkv(self.infer_w, self.config, self.eps, feat, F.embedding(tokens, self.embedding), cos, sin)
        cache.reserve(at + t)
        cache.k[:, at:at + t] = k
        cache.v[:, at:at + t] = v
        if visible is None:
            visible = torch.ones(t, at + t, dtype=torch.bool).tril(diagonal=at)
        attn = F.scaled_dot_product_attention(q, cache.k[:, :at + t], cache.v[:, :at + t],
                                              attn_mask=visible, enable_gqa=True)  # (Hq, T, D)
        return pair_out(self.infer_w, self.eps, feat, attn)

    @torch.inference_mode()
    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return draft_logits(self.infer_w, self.eps, g)


# -- the drafter ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EagleDraftConfig:
    """top_k: children each expanded node offers; beam: nodes expanded per depth."""

    top_k: int = 8
    beam: int = 8


class EagleDrafter:
    """Per-request EAGLE drafter: `observe` committed tokens with their aux rows, then
    `propose` below the root (the last committed token, whose features the ring has not
    computed yet)."""

    name = "eagle"
    confidence = True  # draft log-probs estimate the target's choices (the planner sizes by them)

    def __init__(self, head: EagleHead, config: EagleDraftConfig = EagleDraftConfig(), *,
                 keep_features: bool = False) -> None:
        """`keep_features`: keep every observed token's fused feature (H floats a token), so
        that a later job starting with the same tokens can `fork` this one (the prefix cache)."""
        self.head, self.config = head, config
        self.cache = PairCache(head.config)
        self._tokens: list[int] = []  # observed (committed, feature-known) tokens
        self._last_feat: torch.Tensor | None = None  # (H,) fused feature of _tokens[-1]
        self._committed_pairs = 0  # KV slots holding committed pairs; slot j = position j + 1
        self.propose_s: float | None = None  # EWMA of the seconds a non-empty propose took
        self._feats: list[torch.Tensor] | None = [] if keep_features else None  # (n, H) chunks, in order

    def fork(self, n: int) -> "EagleDrafter":
        """A drafter for a job whose first `n` tokens are this one's first `n` (a prefix cache
        hit, coordinator.jobs.prefix_cache): their pairs' K/V and the n-th token's feature
        copied, as if it had observed them itself. Needs keep_features and n <= observed."""
        if self._feats is None or not 1 <= n <= len(self._tokens):
            raise ValueError(f"fork of {n} tokens from a drafter that observed {len(self._tokens)}"
                             f"{'' if self._feats is not None else ' and kept no features'}")
        other = EagleDrafter(self.head, self.config, keep_features=True)
        feats = torch.cat(self._feats)[:n]
        other.cache.reserve(n - 1)
        other.cache.k[:, : n - 1] = self.cache.k[:, : n - 1]
        other.cache.v[:, : n - 1] = self.cache.v[:, : n - 1]
        other._tokens, other._last_feat, other._committed_pairs, other._feats = self._tokens[:n], feats[-1], n - 1, [feats]
        return other

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layers

    @property
    def observed_tokens(self) -> int:
        """How many committed tokens (from the prompt's first) `observe` has seen."""
        return len(self._tokens)

    def observe(self, tokens: Sequence[int], aux: torch.Tensor) -> None:
        """Commit tokens and their aux rows (len(tokens), k*H), in order after those
        already observed. Every pair whose feature and token are now both known enters
        the head's KV cache (the prompt's in one chunk at prefill)."""
        n = len(tokens)
        width = len(self.aux_layers) * self.head.config.hidden_size
        if aux.shape != (n, width):
            raise ValueError(f"observe needs aux of shape ({n}, {width}), got {tuple(aux.shape)}")
        if n == 0:
            return
        with torch.inference_mode():
            feats = fuse(self.head.infer_w, aux.float())  # (n, H)
        # Pairs (feature j, token j+1) for j = s-1 .. s+n-2, where s indexes tokens[0];
        # the first pair needs the previous round's last feature.
        pair_feats = feats[:-1] if self._last_feat is None else torch.cat([self._last_feat[None], feats[:-1]])
        pair_tokens = list(tokens[1:]) if self._last_feat is None else list(tokens)
        at = self._committed_pairs
        if pair_tokens:
            positions = torch.arange(at + 1, at + 1 + len(pair_tokens))
            self.head.forward(self.cache, pair_feats, torch.tensor(pair_tokens), positions, at)
            self._committed_pairs = at + len(pair_tokens)
        self._tokens.extend(int(x) for x in tokens)
        self._last_feat = feats[-1]
        if self._feats is not None:
            self._feats.append(feats)

    def in_sync(self, context_ids: Sequence[int]) -> bool:
        """Whether `context_ids` is the observed tokens plus one root (O(1) check)."""
        seen = len(self._tokens)
        return seen > 0 and len(context_ids) == seen + 1 and int(context_ids[seen - 1]) == self._tokens[-1]

    def propose(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree:
        """A chain (`max_nodes <= max_depth`: the head's argmax at each depth) or a tree
        grown level by level (EAGLE-2): at each depth the `beam` likeliest nodes of the
        level above (by cumulative draft log-prob) are run through the head together,
        each offers its top-k children, and the tree keeps the `max_nodes` likeliest of
        all candidates. One head forward per depth, whatever the tree's width. Children
        are GREEDY picks; `logprobs` hold the head's log q(token | path), which the
        planner reads as the head's confidence."""
        if not self.in_sync(context_ids) or budget.max_nodes == 0 or budget.max_depth == 0:
            return DraftTree.empty(source=DraftSource(self.name, "0"))
        t0 = time.perf_counter()
        tree = self._grow(context_ids, budget)
        took = time.perf_counter() - t0
        self.propose_s = took if self.propose_s is None else 0.7 * self.propose_s + 0.3 * took
        return tree

    def _grow(self, context_ids: Sequence[int], budget: DraftBudget) -> DraftTree:
        head = self.head
        chain = budget.max_nodes <= budget.max_depth
        k = 1 if chain else min(self.config.top_k, budget.max_nodes)
        beam = 1 if chain else min(self.config.beam, budget.max_nodes)
        root_pos, base = len(context_ids) - 1, self._committed_pairs
        # Candidates as parallel lists (parent -1 is the root). Once node i is expanded
        # (its pair ran through the head), slot_of[i] is its KV slot and out_of[i] its output.
        tokens: list[int] = []
        parents: list[int] = []
        logps: list[float] = []
        cums: list[float] = []
        slot_of: dict[int, int] = {}
        out_of: dict[int, torch.Tensor] = {}
        frontier = [-1]
        next_slot = base
        for depth in range(1, budget.max_depth + 1):
            n = len(frontier)
            feat = torch.stack([self._last_feat if f < 0 else out_of[parents[f]] for f in frontier])  # (n, H)
            toks = torch.tensor([int(context_ids[-1]) if f < 0 else tokens[f] for f in frontier])
            at = next_slot
            vis = torch.zeros(n, at + n, dtype=torch.bool)
            vis[:, :base] = True
            for row, f in enumerate(frontier):
                node = parents[f] if f >= 0 else None
                while node is not None:  # the ancestors' slots, the root's included
                    vis[row, slot_of[node]] = True
                    node = parents[node] if node >= 0 else None
                vis[row, at + row] = True
            with torch.inference_mode():
                g = head.forward(self.cache, feat, toks, torch.full((n,), root_pos + depth - 1), at, vis)  # (n, H)
                logp = torch.log_softmax(head.logits(g).float(), dim=-1)  # (n, Vd)
                top = torch.topk(logp, k, dim=-1)
            next_slot = at + n
            level = []
            for row, f in enumerate(frontier):
                slot_of[f], out_of[f] = at + row, g[row]
                base_cum = 0.0 if f < 0 else cums[f]
                for tok, lp in zip(head.d2t[top.indices[row]].tolist(), top.values[row].tolist()):
                    tokens.append(int(tok))
                    parents.append(f)
                    logps.append(float(lp))
                    cums.append(base_cum + float(lp))
                    level.append(len(tokens) - 1)
            if depth == budget.max_depth:
                break
            # Expand the level's likeliest; stop once none of them can still make the cut.
            level.sort(key=lambda i: -cums[i])
            cut = sorted(cums, reverse=True)[budget.max_nodes - 1] if len(cums) >= budget.max_nodes else float("-inf")
            frontier = [i for i in level[:beam] if cums[i] > max(cut, budget.min_logprob)]
            if not frontier:
                break
        # Candidates were made level by level, each node's children likeliest first: a
        # topological order in which the likeliest max_nodes form a tree.
        return DraftTree(torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
                         logprobs=torch.tensor(logps, dtype=torch.float32),
                         source=DraftSource(self.name, "chain" if chain else "tree")).keep_likeliest(budget.max_nodes)


def shipped_head_dir(model_name: str) -> pathlib.Path | None:
    """The head shipped in the package for a target model name, if any."""
    path = HEADS_DIR / model_name
    return path if (path / MANIFEST_FILE).exists() else None
