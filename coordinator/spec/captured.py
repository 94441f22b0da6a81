"""Captured sequences on disk: the target's own answers, with what it computed at every
position, which the EAGLE head is fitted and checked on.

A file is safetensors holding S sequences concatenated row by row (N rows in all):

    ids      (N,)      int32  the tokens fed: prompt, then answer up to (not including) EOS
    feats    (N, k*H)  f16    the k aux layers' outputs at each position, in aux-layer order
    labels   (N,)      int32  the target's greedy next token at each position (the hard label)
    final    (N, H)    f16    its hidden state after the final norm: final @ lm_head.T is its
                              logits, hence the soft label (absent from older shards)
    offsets  (S+1,)    int64  sequence s is rows offsets[s] : offsets[s+1]
    heldout  (S,)      int64  1 where the sequence is held out of training

and string metadata: "aux_layers" (JSON list), "categories" (JSON list, one prompt
category per sequence), and for shards "sampled" ("True" when answered at temperature).
Training shards are `shard_NNNN.safetensors` in a work directory, one per batch of
prompts; the benchmark prompts' answers, the check on prompts unlike any trained on, are
`unseen.safetensors` beside them.

This module does not know how sequences are generated (a transformers model answering
prompts, in scripts/train_eagle.py) nor what is fitted on them.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

import torch

UNSEEN_FILE = "unseen.safetensors"
FIELDS = ("ids", "feats", "labels", "final")  # per-row tensors, in a captured tuple's order

# One answered sequence as written: ids (T,), feats (T, k*H) f16, labels (T,), final (T, H) f16.
Captured = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def shard_path(work_dir: pathlib.Path, n: int) -> pathlib.Path:
    """Where the n-th training shard lives."""
    return work_dir / f"shard_{n:04d}.safetensors"


def save_sequences(path: pathlib.Path, seqs: Sequence[Captured], heldout: Sequence[bool],
                   metadata: dict[str, str]) -> None:
    """Write `seqs` (each held out or not) as one file in the schema above."""
    from safetensors.torch import save_file

    offsets = [0]
    for ids, *_ in seqs:
        offsets.append(offsets[-1] + len(ids))
    save_file({"ids": torch.cat([s[0] for s in seqs]).to(torch.int32),
               "feats": torch.cat([s[1] for s in seqs]).contiguous(),
               "labels": torch.cat([s[2] for s in seqs]).to(torch.int32),
               "final": torch.cat([s[3] for s in seqs]).contiguous(), "offsets": torch.tensor(offsets),
               "heldout": torch.tensor([int(h) for h in heldout])}, str(path), metadata=metadata)


def load_shards(work_dir: pathlib.Path) -> tuple[list[dict], list[dict]]:
    """(train, heldout) sequences of every shard in `work_dir`, each {"ids", "feats",
    "labels"} tensors, and "final" where the shard has it."""
    from safetensors.torch import load_file

    train_seqs, held_seqs = [], []
    for path in sorted(work_dir.glob("shard_*.safetensors")):
        t = load_file(str(path))
        for s, seq in enumerate(_sequences(t)):
            (held_seqs if int(t["heldout"][s]) else train_seqs).append(seq)
    return train_seqs, held_seqs


def load_unseen(work_dir: pathlib.Path) -> list[dict]:
    """The unseen benchmark answers, each sequence with its "category"; [] if absent."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    path = work_dir / UNSEEN_FILE
    if not path.exists():
        return []
    with safe_open(str(path), "pt") as f:
        categories = json.loads(f.metadata()["categories"])
    return [seq | {"category": category} for seq, category in zip(_sequences(load_file(str(path))), categories)]


def _sequences(t: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """A file's concatenated tensors cut back into its sequences."""
    off = t["offsets"].tolist()
    keys = [k for k in FIELDS if k in t]
    return [{k: t[k][off[s]:off[s + 1]] for k in keys} for s in range(len(off) - 1)]
