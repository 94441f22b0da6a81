"""Fitting the EAGLE-3 head: the training-time-test unroll, batches, losses, evaluation, and
writing the fitted head (save_head).

Training-time test (EAGLE-3): the head is unrolled `ttt_steps` times over every sequence
at once. Index i holds the pair at position i+1 (feature of i, token i+1) and is trained
to predict the target's greedy token after position i+1. Step 1 reads the target's fused
features; step s reads the step s-1 output one index to the left, and its query at i
sees exactly what drafting at depth s-1 below a root at i-s+1 sees: the step-1 keys up to
that root, then the step-r key at index i-s+r for r = 2..s. The head's own functions
(`coordinator.spec.eagle`: `fuse`, `pair_qkv`, `pair_out`, `draft_logits`) are composed
here as drafting composes them, so training and serving cannot drift apart.

Sequences are `coordinator.spec.captured` dicts ({"ids", "feats", "labels"}, and "final"
for soft labels). This module does not know where sequences come from, the optimiser's
schedule or when to stop (scripts/train_eagle.py runs the fit), nor the target model.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from coordinator.spec.eagle import MANIFEST_FILE, WEIGHTS_FILE, EagleConfig, draft_logits, fuse, pair_out, pair_qkv
from shard.rope import RotaryTable


@dataclass(frozen=True)
class FitConfig:
    """The fit's recipe (written into the head's manifest): target layers, draft
    vocabulary, unroll, optimiser, batching, labels and evaluation cadence."""

    aux_layers: tuple[int, ...] = (2, 15, 27)
    draft_vocab: int = 4096
    ttt_steps: int = 3
    lr: float = 2e-3
    warmup_steps: int = 10
    tokens_per_batch: int = 2048
    max_seq_tokens: int = 512
    train_lm_head: bool = False  # the LM head starts at the target's tied rows
    # Train on the target's whole distribution over the draft vocabulary (soft labels,
    # from the shards' final hidden states) instead of its greedy token alone. Off: on
    # the shipped data it was a wash on unseen prompts (docs/eagle.md).
    soft_labels: bool = False
    eval_every_s: float = 900.0
    eval_stride: int = 8
    seed: int = 0
    init_from: str = ""  # a head directory to continue from (its draft vocabulary is kept)


def ttt_forward(w, cfg: EagleConfig, eps: float, rotary: RotaryTable, embedding: torch.Tensor,
                ids: torch.Tensor, feats: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """ids (B, T), feats (B, T, k*H) -> per step, draft logits (B, T-1, Vd) at indices 0..T-2."""
    hq, hkv, t = cfg.num_heads, cfg.num_kv_heads, ids.shape[1] - 1
    feat = fuse(w, feats[:, :-1].float())  # (B, T', H): feature of position i at index i
    emb = F.embedding(ids[:, 1:], embedding)  # (B, T', H): token at position i+1
    cos, sin = rotary.lookup(torch.arange(1, t + 1))  # (T', D)
    idx = torch.arange(t)
    keys, values, out = [], [], []
    for s in range(1, steps + 1):
        q, k, v = pair_qkv(w, cfg, eps, feat, emb, cos, sin)  # (B, Hq, T', D), (B, Hkv, T', D) x2
        keys.append(k.repeat_interleave(hq // hkv, dim=1))  # (B, Hq, T', D)
        values.append(v.repeat_interleave(hq // hkv, dim=1))
        scale = q.shape[-1] ** -0.5
        first = (q @ keys[0].transpose(-1, -2)) * scale  # (B, Hq, T', T')
        first = first.masked_fill(idx[None, :] > idx[:, None] - (s - 1), float("-inf"))
        # Step r's key for query i sits at i - (s - r): shift it right by s - r.
        shifted_k = [_shift(keys[r - 1], s - r) for r in range(2, s + 1)]
        shifted_v = [_shift(values[r - 1], s - r) for r in range(2, s + 1)]
        diag = [((q * kr).sum(-1) * scale)[..., None] for kr in shifted_k]  # (B, Hq, T', 1) each
        probs = torch.softmax(torch.cat([first, *diag], dim=-1), dim=-1).nan_to_num(0.0)
        attn = probs[..., :t] @ values[0]  # (B, Hq, T', D)
        for j, vr in enumerate(shifted_v):
            attn = attn + probs[..., t + j, None] * vr
        g = pair_out(w, eps, feat, attn)  # (B, T', H)
        out.append(draft_logits(w, eps, g))
        feat = _shift(g, 1, dim=1)  # the next step's feature at i is this step's output at i-1
    return out


def _shift(x: torch.Tensor, n: int, dim: int = 2) -> torch.Tensor:
    """Move entries n places towards higher indices along `dim`, zero-filling the start."""
    if n == 0:
        return x
    pad = torch.zeros_like(x.narrow(dim, 0, n))
    return torch.cat([pad, x.narrow(dim, 0, x.shape[dim] - n)], dim=dim)


def make_batches(seqs: list[dict], cfg: FitConfig, rng: random.Random) -> list[list[dict]]:
    """Length-bucketed batches of about tokens_per_batch positions (right padding)."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]["ids"]), rng.random()))
    batches, cur = [], []
    for i in order:
        cur.append(seqs[i])
        if len(cur) * min(len(cur[-1]["ids"]), cfg.max_seq_tokens) >= cfg.tokens_per_batch:
            batches.append(cur)
            cur = []
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(batch: list[dict], t2d: torch.Tensor, max_len: int):
    """-> ids (B, T), feats (B, T, k*H), draft labels (B, T-1) with -1 where ignored, and
    the target's final hidden states (B, T-1, H) aligned with the labels (None when the
    shards have none)."""
    t = min(max(len(s["ids"]) for s in batch), max_len)
    ids = torch.zeros(len(batch), t, dtype=torch.long)
    feats = torch.zeros(len(batch), t, batch[0]["feats"].shape[-1], dtype=torch.float16)
    labels = torch.full((len(batch), t - 1), -1, dtype=torch.long)
    final = torch.zeros(len(batch), t - 1, batch[0]["final"].shape[-1], dtype=torch.float16) if all(
        "final" in s for s in batch) else None
    for b, s in enumerate(batch):
        n = min(len(s["ids"]), t)
        ids[b, :n] = s["ids"][:n].long()
        feats[b, :n] = s["feats"][:n]
        labels[b, :n - 1] = t2d[s["labels"][1:n].long()]  # target's next token after position i+1
        if final is not None:
            final[b, :n - 1] = s["final"][1:n]  # the target's state there: its logits for that token
    return ids, feats, labels, final


def soft_targets(final: torch.Tensor, draft_rows: torch.Tensor) -> torch.Tensor:
    """The target's distribution renormalised over the draft vocabulary: final (B, T', H)
    after the final norm, draft_rows (Vd, H) its LM head rows -> (B, T', Vd)."""
    return torch.softmax(final.float() @ draft_rows.T, dim=-1)


def step_losses(logits: list[torch.Tensor], labels: torch.Tensor, target_p: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[float]]:
    """Weighted cross-entropy over the unrolled steps (weights 0.8^s): against the greedy
    labels, or against `target_p` (B, T-1, Vd) at the same positions when given; the
    accuracies are top-1 against the greedy labels either way."""
    total, accs = 0.0, []
    for s, lg in enumerate(logits):
        lab = labels.clone()
        lab[:, :s] = -1  # step s+1 at index i needs a root at i - s >= 0
        keep = lab >= 0
        if not keep.any():
            loss = lg.sum() * 0.0
        elif target_p is None:
            loss = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), lab.reshape(-1), ignore_index=-1)
        else:
            loss = -(target_p[keep] * F.log_softmax(lg[keep], dim=-1)).sum(-1).mean()
        total = total + loss * 0.8 ** s
        accs.append(float((lg.argmax(-1)[keep] == lab[keep]).float().mean()) if keep.any() else 0.0)
    return total, accs


def draft_vocabulary(seqs: list[dict], size: int, vocab: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent target labels (ascending ids) and the share of labels they
    cover. Ties (labels never seen) go to tokens seen in the inputs, then to low ids: BPE
    assigns ids in merge order, so low ids are the common tokens."""
    counts = torch.zeros(vocab, dtype=torch.long)
    seen = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["labels"].long(), minlength=vocab)
        seen += torch.bincount(s["ids"].long(), minlength=vocab)
    score = counts.double() * 1e9 + seen.double().clamp(max=1e5) * 1e3 - torch.arange(vocab).double() / vocab
    top = torch.topk(score, size).indices
    return top.sort().values, float(counts[top].sum()) / max(int(counts.sum()), 1)


@torch.no_grad()
def evaluate_steps(w, cfg, eps, rotary, embedding, d2t, seqs, fit: FitConfig) -> list[float]:
    """Top-1 accuracy per TTT step on held-out sequences, against the target's greedy
    token (labels outside the draft vocabulary count as misses)."""
    identity = torch.arange(embedding.shape[0])
    hits, totals = [0] * fit.ttt_steps, [0] * fit.ttt_steps
    for s in seqs:
        ids, feats, labels, _ = collate([s], identity, fit.max_seq_tokens)  # labels in target ids
        for j, lg in enumerate(ttt_forward(w, cfg, eps, rotary, embedding, ids, feats, fit.ttt_steps)):
            pred = d2t[lg.argmax(-1)][0, j:]  # (T'-j,) target ids
            hits[j] += int((pred == labels[0, j:]).sum())
            totals[j] += labels.shape[1] - j
    return [h / max(n, 1) for h, n in zip(hits, totals)]


def save_head(path: str | pathlib.Path, config: EagleConfig, weights: dict[str, torch.Tensor], d2t: torch.Tensor,
              *, target_digest: str, extra: dict | None = None, dtype: torch.dtype = torch.float16) -> None:
    """Write eagle3.safetensors (weights in `dtype`, d2t int64) and manifest.json with its sha256."""
    from safetensors.torch import save_file

    root = pathlib.Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tensors = {name: weights[name].detach().to(dtype).contiguous() for name in config.tensor_shapes()}
    tensors["d2t"] = d2t.long().contiguous()
    tmp = root / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(root / WEIGHTS_FILE)
    manifest = {"format": "shard-eagle3", "config": asdict(config), "target_digest": target_digest,
                "dtype": str(dtype).removeprefix("torch."),
                "sha256": hashlib.sha256((root / WEIGHTS_FILE).read_bytes()).hexdigest(), **(extra or {})}
    (root / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
