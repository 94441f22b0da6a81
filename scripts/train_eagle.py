"""Train the EAGLE-3 draft head of a model by self-distillation, on CPU, with no downloads.

    python scripts/train_eagle.py --out coordinator/spec/heads/smollm2-135m [--minutes 58]

1. data: the target answers our own prompts (scripts/eagle_prompts.py) with its chat
   template (batched transformers generate, mostly greedy, a quarter at temperature
   0.7); forward hooks capture, at every fed position, the outputs of the three aux
   layers, the target's greedy next token (the distillation label) and its final-norm
   hidden state (for --soft-labels). Shards are captured sequences under --work-dir
   (their format: coordinator/spec/captured.py) and are reused by a later run.
2. train: one EAGLE-3 decoder layer (coordinator/spec/eagle.py) with a training-time-test
   loss unrolled --ttt-steps steps (coordinator/spec/eagle_train.py): step 1 sees the
   target's fused features, step s > 1 the head's own outputs of step s-1, with the
   attention pattern drafting uses.
3. evaluate on held-out prompts: top-1 accuracy per step and simulated tokens per
   traversal of chains and trees against the target's greedy continuation; then the same
   simulation on the benchmark's prompts (scripts/spec_prompts.py: no template, topic or
   passage shared with the training prompts), which is the figure that carries over to
   the ring (held-out prompts share templates and topics with training ones and have
   overstated heads by 0.15-0.7 tokens). Then write the head (f16) and its manifest. A
   checkpoint is written at every evaluation, so a run cut short still leaves a head.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import random
import sys
import time
from dataclasses import asdict

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from coordinator.spec.capture import generate_shards, generate_unseen, load_target  # noqa: E402
from coordinator.spec.captured import UNSEEN_FILE, load_shards, load_unseen  # noqa: E402
from coordinator.spec.drafting import DraftBudget  # noqa: E402
from coordinator.spec.eagle import EagleConfig, EagleHead, init_weights  # noqa: E402
from coordinator.spec.eagle_train import save_head  # noqa: E402
from coordinator.spec.eagle_train import (FitConfig, collate, draft_vocabulary, evaluate_steps,  # noqa: E402
                                          make_batches, soft_targets, step_losses, ttt_forward)
from coordinator.spec.replay import simulate_tau  # noqa: E402
from scripts import spec_prompts  # noqa: E402
from scripts.eagle_prompts import build_prompts  # noqa: E402
from shard.rope import RotaryTable  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402


# -- 2. and 3. fit and evaluate ----------------------------------------------------------


def answer_start(ids: torch.Tensor, marker: list[int]) -> int:
    """Index after the last occurrence of the assistant header `marker` (0 if absent)."""
    seq, m = ids.tolist(), len(marker)
    for i in range(len(seq) - m, -1, -1):
        if seq[i:i + m] == marker:
            return i + m
    return 0


def fit(store, work: pathlib.Path, out: pathlib.Path, deadline_s: float, fit_cfg: FitConfig, *,
        started_s: float, argv: list[str]) -> None:
    """Train until the deadline, evaluating and writing the head every eval_every_s and at the end."""
    from transformers import AutoTokenizer

    rng = random.Random(fit_cfg.seed)
    train_seqs, held = load_shards(work / "data")
    target = store.config
    embedding = store.load_embedding()
    norm, lm_head = store.load_head()
    tied_head = lm_head if lm_head is not None else embedding
    d2t, coverage = draft_vocabulary(train_seqs, fit_cfg.draft_vocab, target.vocab_size)
    start = EagleHead.load(fit_cfg.init_from, target, embedding, store.digest) if fit_cfg.init_from else None
    if start is not None:
        d2t = start.d2t
        counts = torch.zeros(target.vocab_size)
        for s in train_seqs:
            counts += torch.bincount(s["labels"].long(), minlength=target.vocab_size)
        coverage = float(counts[d2t].sum() / counts.sum())
    t2d = torch.full((target.vocab_size,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    cfg = EagleConfig.for_target(target, fit_cfg.aux_layers, fit_cfg.draft_vocab)
    gen = torch.Generator().manual_seed(fit_cfg.seed)
    w = init_weights(cfg, tied_head, norm, d2t, gen) if start is None else {n: t.clone() for n, t in start.w.items()}
    trainable = {n: p.requires_grad_() for n, p in w.items() if n != "lm_head.weight" or fit_cfg.train_lm_head}
    opt = torch.optim.AdamW(trainable.values(), lr=fit_cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rotary = RotaryTable(target, torch.float32)
    tok = AutoTokenizer.from_pretrained(store.tokenizer_dir)
    marker = tok("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    held_greedy = held[:12]
    starts = [answer_start(s["ids"], marker) for s in held_greedy]
    unseen = {}  # group -> (sequences, their answer starts)
    unseen_seqs = load_unseen(work / "data")
    for name, group in (("open_ended", spec_prompts.OPEN_ENDED), ("grounded", spec_prompts.GROUNDED)):
        seqs = [s for s in unseen_seqs if s["category"] in group]
        if seqs:
            unseen[name] = (seqs, [answer_start(s["ids"], marker) for s in seqs])
    n_train = sum(len(s["ids"]) for s in train_seqs)
    soft = fit_cfg.soft_labels and all("final" in s for s in train_seqs)
    draft_rows = tied_head[d2t].float()  # (Vd, H): the target's LM head over the draft vocabulary
    print(f"[fit] {len(train_seqs)} train seqs ({n_train} positions), {len(held)} held out; "
          f"draft vocab {len(d2t)} covers {coverage:.3f} of labels; "
          f"{'soft' if soft else 'greedy'} labels", flush=True)
    if fit_cfg.soft_labels and not soft:
        print("[fit] the shards carry no final hidden states (written before soft labels): greedy labels", flush=True)
    t0 = time.monotonic()
    step, epoch, last_eval = 0, 0, t0
    budget_s = max(deadline_s - t0, 1.0)
    log: list[dict] = []

    def checkpoint(final: bool) -> None:
        accs = evaluate_steps(w, cfg, target.rms_norm_eps, rotary, embedding, d2t, held, fit_cfg)
        head = EagleHead(cfg, target, {n: p.detach().half().float() for n, p in w.items()}, d2t, embedding)
        tau = simulate_tau(head, held_greedy, starts, {
            "chain4": DraftBudget.chain(4), "chain6": DraftBudget.chain(6), "tree32_d6": DraftBudget(32, 6)},
            stride=fit_cfg.eval_stride)
        # Every answer position a root, as bench_wire_tau walks the ring's own answers.
        unseen_tau = {name: simulate_tau(head, seqs, seq_starts, {
            "chain4": DraftBudget.chain(4), "tree32_d6": DraftBudget(32, 6), "tree60_d6": DraftBudget(60, 6)},
            stride=1) for name, (seqs, seq_starts) in unseen.items()}
        record = {"step": step, "epoch": epoch, "train_s": round(time.monotonic() - t0, 1),
                  "heldout_top1_per_step": [round(a, 4) for a in accs], "sim_tau": tau,
                  "unseen_benchmark_prompts_sim_tau": unseen_tau}
        log.append(record)
        print(f"[fit] eval {json.dumps(record)}", flush=True)
        save_head(out, cfg, w, d2t, target_digest=store.digest, extra={
            "target_model": store.manifest.name,
            "recipe": asdict(fit_cfg) | {"argv": argv},
            "data": {"train_sequences": len(train_seqs), "train_positions": n_train,
                     "heldout_sequences": len(held), "draft_vocab_label_coverage": round(coverage, 4)},
            "training": {"steps": step, "epochs": epoch, "final": final,
                         "wall_s_total": round(time.monotonic() - started_s, 1)},
            "offline_eval": record})

    while True:
        for batch in make_batches(train_seqs, fit_cfg, rng):
            now = time.monotonic()
            if now >= deadline_s:
                checkpoint(final=True)
                return
            if now - last_eval >= fit_cfg.eval_every_s:
                checkpoint(final=False)
                last_eval = time.monotonic()
            frac = min((now - t0) / budget_s, 1.0)
            lr = fit_cfg.lr * min(1.0, (step + 1) / fit_cfg.warmup_steps) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
            for group in opt.param_groups:
                group["lr"] = lr
            ids, feats, labels, final = collate(batch, t2d, fit_cfg.max_seq_tokens)
            logits = ttt_forward(w, cfg, target.rms_norm_eps, rotary, embedding, ids, feats, fit_cfg.ttt_steps)
            loss, accs = step_losses(logits, labels, soft_targets(final, draft_rows) if soft else None)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(trainable.values(), 1.0)
            opt.step()
            step += 1
            if step % 10 == 0:
                print(f"[fit] step {step} epoch {epoch} loss {loss.item():.3f} acc {[round(a, 3) for a in accs]} "
                      f"lr {lr:.2e} {time.monotonic() - t0:.0f} s", flush=True)
        epoch += 1


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="coordinator/spec/heads/smollm2-135m", help="head directory to write")
    ap.add_argument("--model", default="smollm2-135m", help="target model (store name or local path)")
    ap.add_argument("--minutes", type=float, default=58.0, help="wall-clock budget for data + training")
    ap.add_argument("--data-share", type=float, default=0.65,
                    help="fraction of the budget spent generating data (answers are the scarce part on a CPU)")
    ap.add_argument("--work-dir", default="/tmp/eagle_work", help="data shards and checkpoints (reused)")
    ap.add_argument("--phase", choices=("all", "data", "train"), default="all")
    ap.add_argument("--aux-layers", default="2,15,27", help="low, middle, high target layers")
    ap.add_argument("--batch", type=int, default=96,
                    help="prompts per generate batch (decoding: ~150 tokens/s at 24, ~240 at 48-96 on 2 cores)")
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--draft-vocab", type=int, default=4096)
    ap.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll (EAGLE-3 uses up to 7)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--init-from", default="", help="continue training this head directory")
    ap.add_argument("--train-lm-head", action="store_true",
                    help="train the draft LM head too (default: frozen at the target's rows for the draft vocabulary)")
    ap.add_argument("--soft-labels", action="store_true",
                    help="train on the target's distribution over the draft vocabulary (default: its greedy tokens)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.monotonic()
    deadline_s = t_start + args.minutes * 60
    work = pathlib.Path(args.work_dir)
    aux_layers = tuple(int(x) for x in args.aux_layers.split(","))
    store = open_or_prepare(args.model, progress=False)
    if args.phase in ("all", "data") or not (work / "data" / UNSEEN_FILE).exists():
        model, tokenizer = load_target(store)
        if not (work / "data" / UNSEEN_FILE).exists():
            t0 = time.monotonic()
            generate_unseen(model, tokenizer, aux_layers, work / "data", spec_prompts.prompt_set(3),
                            (spec_prompts.OPEN_ENDED, spec_prompts.GROUNDED))
            print(f"[data] unseen benchmark answers: {time.monotonic() - t0:.0f} s", flush=True)
        if args.phase in ("all", "data"):
            generate_shards(model, tokenizer, aux_layers, work / "data", t_start + args.minutes * 60 * args.data_share,
                            build_prompts(args.seed), batch=args.batch, max_new_tokens=args.max_new_tokens, seed=args.seed)
        del model
    if args.phase in ("all", "train"):
        fit(store, work, pathlib.Path(args.out), deadline_s, FitConfig(
            aux_layers=aux_layers, draft_vocab=args.draft_vocab, ttt_steps=args.ttt_steps, seed=args.seed,
            lr=args.lr, init_from=args.init_from, train_lm_head=args.train_lm_head, soft_labels=args.soft_labels),
            started_s=t_start, argv=sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
