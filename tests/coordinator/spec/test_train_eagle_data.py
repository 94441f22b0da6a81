"""coordinator.spec.capture: what the EAGLE head is trained and checked on must line up
with the target, position by position. Sound: a tiny seeded Llama answers real chat
prompts in one left-padded batch; every stored row is compared with a fresh unpadded
forward of that sequence alone, read back through coordinator.spec.captured."""

from __future__ import annotations

import torch

from coordinator.spec.captured import load_shards, load_unseen
from scripts.spec_prompts import GROUNDED, OPEN_ENDED
from coordinator.spec.capture import generate_shards, generate_unseen, load_target

AUX = (0, 2, 3)  # not the last layer: transformers reports that one after the final norm


def test_unseen_answers_store_each_positions_features_and_greedy_label(tiny_llama_store, tmp_path):
    model, tokenizer = load_target(tiny_llama_store)
    # Different lengths, so the batch is left-padded and the padding must be cut away.
    prompts = [(OPEN_ENDED[0], "Tell me about owls."), (OPEN_ENDED[1], "Why is the sky blue, in one line?"),
               (GROUNDED[0], "Summarise: the mill by the river ground wheat for two hundred years.")]
    generate_unseen(model, tokenizer, AUX, tmp_path, prompts, (OPEN_ENDED, GROUNDED))
    seqs = load_unseen(tmp_path)
    assert [s["category"] for s in seqs] == [c for c, _ in prompts]
    for seq, (_, prompt) in zip(seqs, prompts):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
        prompt_ids = tokenizer(text).input_ids
        ids = seq["ids"].long()
        assert ids[:len(prompt_ids)].tolist() == prompt_ids  # no padding kept
        assert len(ids) > len(prompt_ids)  # and the answer follows
        with torch.inference_mode():
            out = model(ids[None], output_hidden_states=True)
        # hidden_states[l + 1] is layer l's output; the label is the greedy next token
        want = torch.cat([out.hidden_states[layer + 1][0] for layer in AUX], dim=-1)
        assert seq["feats"].shape == want.shape
        torch.testing.assert_close(seq["feats"].float(), want, atol=2e-2, rtol=1e-2)  # stored f16
        assert seq["labels"].long().tolist() == out.logits[0].argmax(-1).tolist()
        # the soft label's source: the hidden state after the final norm, whose product
        # with the LM head is the target's logits
        torch.testing.assert_close(seq["final"].float(), out.hidden_states[-1][0], atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(seq["final"].float() @ model.lm_head.weight.T, out.logits[0], atol=5e-2, rtol=1e-2)
        # greedy answers: each answer token is the label of the position before it
        assert ids[len(prompt_ids):].tolist() == seq["labels"].long()[len(prompt_ids) - 1:-1].tolist()


def test_missing_unseen_file_means_no_unseen_check(tmp_path):
    assert load_unseen(tmp_path) == []



def test_data_phase_writes_shards_the_fit_reads(tiny_llama_store, tmp_path):
    # Bug guarded: the data phase unpacked each answered sequence as three fields after
    # answer_batch grew a fourth (the final-norm state), so it crashed after its first
    # shard; only the unseen path was tested. Sound: six prompts in batches of four give
    # two shards, every 25th prompt (the first) held out, each sequence with every field.
    prompts = [(OPEN_ENDED[0], f"Tell me about topic {i}.") for i in range(6)]
    model, tokenizer = load_target(tiny_llama_store)
    generate_shards(model, tokenizer, AUX, tmp_path, float("inf"), prompts, batch=4, max_new_tokens=4, seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard_0000.safetensors", "shard_0001.safetensors"]
    train, held = load_shards(tmp_path)
    assert (len(train), len(held)) == (5, 1)
    for seq in train + held:
        n = len(seq["ids"])
        assert seq["feats"].shape == (n, len(AUX) * model.config.hidden_size)
        assert seq["labels"].shape == (n,) and seq["final"].shape == (n, model.config.hidden_size)
