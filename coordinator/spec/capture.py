"""The EAGLE head's training data: the target answers prompts, and forward hooks capture
what it computed at every fed position (aux layers' outputs, greedy label, final-norm
state), written as captured sequences (coordinator.spec.captured).

Runs a transformers model built from the store's weights (the Llama layout), batched and
left-padded. Knows nothing of which prompts are asked (the scripts hold the prompt sets),
of the ring, or of what is fitted on the data (coordinator.spec.eagle_train).
"""

from __future__ import annotations

import json
import pathlib
import random
import time
from collections.abc import Collection, Sequence

import torch

from coordinator.spec.captured import UNSEEN_FILE, Captured, save_sequences, shard_path
from shard.layers import LayerRange

Prompt = tuple[str, str]  # (category, user message)


def _chat(tokenizer, prompt: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def load_target(store):
    """The store's weights as a transformers Llama model (for batched generation)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**json.loads((store.root / "config.json").read_text()))
    model = LlamaForCausalLM(config)
    state = {"model.embed_tokens.weight": store.load_embedding(), "model.norm.weight": store.load_head()[0]}
    for layer, tensors in store.load_layers(LayerRange(0, store.num_layers)).items():
        state.update({f"model.layers.{layer}.{name}": t for name, t in tensors.items()})
    lm_head = store.load_head()[1]
    state["lm_head.weight"] = lm_head if lm_head is not None else state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    tokenizer = AutoTokenizer.from_pretrained(store.tokenizer_dir)
    tokenizer.padding_side = "left"
    return model.eval(), tokenizer


@torch.inference_mode()
def generate_shards(model, tokenizer, aux_layers, work_dir: pathlib.Path, deadline_s: float,
                    prompts: Sequence[Prompt], *, batch: int, max_new_tokens: int, seed: int) -> None:
    """Answer prompt batches until the deadline, one shard per batch. Each shard holds,
    concatenated over its sequences: ids (N,), feats (N, k*H) f16 of the aux layers at
    each fed position, labels (N,) the target's argmax there, final (N, H) f16 its state
    after the final norm, offsets (S+1,), heldout (S,)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    # Every 25th prompt is held out for evaluation; those are answered greedily, so
    # their continuations are what greedy verification would accept.
    heldout = [i % 25 == 0 for i in range(len(prompts))]
    sampled = [not h and i % 4 == 1 for i, h in enumerate(heldout)]
    texts = [_chat(tokenizer, p) for _, p in prompts]
    lengths = [len(ids) for ids in tokenizer(texts).input_ids]
    # Batches of prompts of similar length (left padding to a batch's longest prompt would
    # otherwise cost a passage prompt's length in every row), greedy and sampled apart,
    # in a seeded order so a run cut short keeps every kind of prompt.
    batches = [order[k:k + batch] for group in (False, True)
               for order in [sorted((i for i in range(len(prompts)) if sampled[i] == group), key=lambda i: lengths[i])]
               for k in range(0, len(order), batch)]
    random.Random(seed).shuffle(batches)
    for n, idx in enumerate(batches):
        path = shard_path(work_dir, n)
        if path.exists():
            continue
        if time.monotonic() > deadline_s:
            print(f"[data] deadline reached after {n} of {len(batches)} batches", flush=True)
            return
        t0 = time.monotonic()
        sampling = dict(do_sample=True, temperature=0.7, top_p=1.0, top_k=0) if sampled[idx[0]] else dict(do_sample=False)
        seqs = answer_batch(model, tokenizer, [texts[i] for i in idx], aux_layers, sampling, max_new_tokens)
        save_sequences(path, seqs, [heldout[i] for i in idx], metadata={
            "categories": json.dumps([prompts[i][0] for i in idx]), "sampled": str(sampled[idx[0]]),
            "aux_layers": json.dumps(list(aux_layers))})
        positions = sum(len(ids) for ids, *_ in seqs)
        print(f"[data] shard {n}: {len(idx)} prompts, {positions} positions, {time.monotonic() - t0:.0f} s", flush=True)


def answer_batch(model, tokenizer, texts: list[str], aux_layers, sampling: dict, max_new_tokens: int
                 ) -> list[Captured]:
    """Answer `texts` in one batched generate; per text (ids, feats f16, labels, final f16)
    over its fed positions (prompt and answer up to, not including, EOS): the aux layers'
    outputs, the target's greedy token there (the hard label) and its hidden state after
    the final norm (its logits, hence the soft label, are that times the LM head)."""
    eos = tokenizer.eos_token_id
    layers = model.model.layers
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in (*aux_layers, -1)}
    hooks = [layers[layer].register_forward_hook(_capture(captured[layer])) for layer in aux_layers]
    hooks.append(model.model.norm.register_forward_hook(_capture(captured[-1])))
    try:
        out = model.generate(**enc, max_new_tokens=max_new_tokens, pad_token_id=eos, **sampling)
    finally:
        for h in hooks:
            h.remove()
    feats = torch.cat([torch.cat(captured[layer], dim=1) for layer in aux_layers], dim=-1)  # (B, T, k*H)
    final = torch.cat(captured[-1], dim=1)  # (B, T, H) after the final norm
    pad = enc.input_ids.shape[1]
    seqs = []
    for row in range(len(texts)):
        start = pad - int(enc.attention_mask[row].sum())  # left padding
        gen = out[row, pad:].tolist()
        stop = gen.index(eos) if eos in gen else len(gen)
        end = min(pad + stop, feats.shape[1])
        seqs.append((out[row, start:end], feats[row, start:end].to(torch.float16),
                     torch.argmax(final[row, start:end] @ model.lm_head.weight.T, dim=-1),
                     final[row, start:end].to(torch.float16)))
    return seqs


UNSEEN_TOKENS = 48  # as the benchmarks answer


@torch.inference_mode()
def generate_unseen(model, tokenizer, aux_layers, work_dir: pathlib.Path, prompts: Sequence[Prompt],
                    groups: Sequence[Collection[str]]) -> None:
    """(category, prompt) pairs answered greedily like the shards, each group of categories
    batched apart (similar lengths): the check of a head on prompts unlike any it was
    trained on (the scripts pass the benchmark's)."""
    texts = [_chat(tokenizer, p) for _, p in prompts]
    seqs = []
    for group in groups:
        idx = [i for i, (c, _) in enumerate(prompts) if c in group]
        seqs += list(zip(idx, answer_batch(model, tokenizer, [texts[i] for i in idx], aux_layers,
                                           dict(do_sample=False), UNSEEN_TOKENS)))
    seqs.sort()
    work_dir.mkdir(parents=True, exist_ok=True)
    save_sequences(work_dir / UNSEEN_FILE, [s for _, s in seqs], [True] * len(seqs), metadata={
        "categories": json.dumps([c for c, _ in prompts]), "aux_layers": json.dumps(list(aux_layers))})


def _capture(sink: list[torch.Tensor]):
    def hook(module, args, output):
        sink.append((output[0] if isinstance(output, tuple) else output).detach().float())
    return hook
