"""coordinator.spec.captured: captured sequences written and read back, row for row."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

from coordinator.spec.captured import UNSEEN_FILE, load_shards, load_unseen, save_sequences, shard_path

HIDDEN, AUX = 4, 3


def captured(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 50, (n,), generator=gen), torch.randn(n, AUX * HIDDEN, generator=gen).half(),
            torch.randint(0, 50, (n,), generator=gen), torch.randn(n, HIDDEN, generator=gen).half())


def test_shards_come_back_as_their_sequences_split_by_heldout(tmp_path):
    # Bug guarded: a sequence cut at the wrong offset (its rows would pair features with
    # another position's label) or held-out sequences leaking into training. Sound: three
    # sequences of different lengths over two shards, each compared field by field.
    seqs = [captured(5, 0), captured(3, 1), captured(7, 2)]
    save_sequences(shard_path(tmp_path, 0), seqs[:2], [False, True], metadata={"aux_layers": "[0, 1, 2]"})
    save_sequences(shard_path(tmp_path, 1), seqs[2:], [False], metadata={"aux_layers": "[0, 1, 2]"})
    train, held = load_shards(tmp_path)
    for got, want in zip(train + held, [seqs[0], seqs[2], seqs[1]]):
        assert list(got) == ["ids", "feats", "labels", "final"]
        for key, tensor in zip(got, want):
            assert torch.equal(got[key].to(tensor.dtype), tensor), key
    assert train[0]["ids"].dtype == torch.int32 and train[0]["feats"].dtype == torch.float16


def test_shards_written_before_soft_labels_read_without_final(tmp_path):
    # Bug guarded: the fit failing on the shipped data's older shards, which have no
    # "final". Sound: the same file with that tensor removed.
    save_sequences(shard_path(tmp_path, 0), [captured(4, 3)], [False], metadata={})
    old = {k: v for k, v in load_file(str(shard_path(tmp_path, 0))).items() if k != "final"}
    save_file(old, str(shard_path(tmp_path, 0)))
    (train,), _ = load_shards(tmp_path)
    assert set(train) == {"ids", "feats", "labels"}


def test_unseen_answers_carry_their_categories(tmp_path):
    save_sequences(tmp_path / UNSEEN_FILE, [captured(2, 4), captured(3, 5)], [True, True],
                   metadata={"categories": json.dumps(["qa", "quoting"])})
    assert [(s["category"], len(s["ids"])) for s in load_unseen(tmp_path)] == [("qa", 2), ("quoting", 3)]
    assert load_unseen(tmp_path / "nowhere") == []
