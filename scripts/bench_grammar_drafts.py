"""Grammar-pruned drafts against unpruned ones on json_schema requests, side by side (issue 23).

One process, the default model (SmolLM2-135M-Instruct, fp32 on CPU) on a 2-stage ring
(scripts/bench_ringkit.py: real nodes on loopback, receipts checked), n-gram drafting, no
round sent ahead. Each prompt asks for a JSON record under a schema whose grammar is
compact (no spaces), after an example written with spaces, so n-gram drafts copied from
the example often carry tokens the grammar forbids. The arms alternate per prompt and
repetition: drafts pruned to the grammar (the engine's default) and the same drafters
unpruned. Reported per arm: tokens per traversal, draft rows sent per traversal, the share
of draft rows the grammar forbids (checked on every verify frame against a fresh matcher),
and decode tokens/s; plus whether both arms wrote the same tokens (they must).

    python scripts/bench_grammar_drafts.py --json OUT [--reps 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from contextlib import aclosing

import llguidance
import torch
import trio

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from coordinator.jobs.engine import encode_chat  # noqa: E402
from coordinator.jobs.engine_config import EngineConfig  # noqa: E402
from coordinator.spec.grammar import json_constraint  # noqa: E402
from coordinator.spec.sampling import SamplingParams  # noqa: E402
from scripts.bench_ringkit import LinkSpec, base_conditions, open_bench_ring  # noqa: E402
from shard.store import open_or_prepare  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "city", "tags"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
EXAMPLE = '{"name": "Ada Lovelace", "city": "London", "tags": ["math", "engines"]}'
PEOPLE = ["Alan Turing", "Grace Hopper", "Marie Curie", "Niels Bohr"]
STAGES = 2


def prompt_messages(person: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Here is a record: {EXAMPLE}\nWrite the same kind of record for {person}."}]


def forbidden(constraint, frames: list[tuple[int, list[int], list[int]]], all_tokens: list[int], prompt_len: int) -> int:
    """Draft nodes in verify frames that the grammar forbids after their committed context."""
    bad = 0
    for root_slot, tokens, parents in frames:
        context = all_tokens[prompt_len: root_slot + 1]
        for j in range(1, len(tokens)):
            path, k = [], j
            while k > 0:
                path.append(tokens[k])
                k = parents[k]
            whole = context + path[::-1]
            bad += llguidance.LLMatcher(constraint.tokenizer, constraint.grammar).validate_tokens(whole) < len(whole)
    return bad


async def one(ring, prompt: list[int], constraint, tokens: int, pruned: bool, eos: int) -> dict:
    """One request in one arm, to `tokens` tokens or the end of the JSON (the grammar's EOS,
    where the gateway's stop rule ends a request)."""
    frames: list[tuple[int, list[int], list[int]]] = []
    sent_before = ring.probe.round_sent

    def round_sent(fwd) -> None:  # the probe's own hook, plus the verify frames' drafts
        sent_before(fwd)
        if fwd.phase == "verify":
            frames.append((int(fwd.positions[0]), fwd.tokens.tolist(), fwd.tree_parents.tolist()))

    ring.probe.round_sent = round_sent
    job = await ring.engine.open_job(prompt, SamplingParams(temperature=0.0, constraint=constraint))
    if not pruned:
        job.drafters = [d.inner for d in job.drafters]
    out: list[int] = []
    t0 = time.perf_counter()
    try:
        async with aclosing(job.next_tokens()) as blocks:
            async for block in blocks:
                out += block
                if eos in out or len(out) >= tokens:
                    break
        stats = job.stats()
    finally:
        await job.aclose()
        ring.probe.round_sent = sent_before
    seconds = time.perf_counter() - t0
    out = out[:min(tokens, out.index(eos) + 1 if eos in out else tokens)]
    rows = sum(len(t) - 1 for _, t, _ in frames)
    return {"tokens": out, "traversals": stats["traversals"], "tokens_per_traversal": stats["tokens_per_traversal"],
            "draft_rows": rows, "forbidden_rows": forbidden(constraint, frames, prompt + out, len(prompt)),
            "seconds": seconds}


def summary(runs: list[dict]) -> dict:
    traversals = sum(r["traversals"] for r in runs)
    rows = sum(r["draft_rows"] for r in runs)
    return {"runs": len(runs), "tokens": sum(len(r["tokens"]) for r in runs), "traversals": traversals,
            "tokens_per_traversal": sum(len(r["tokens"]) for r in runs) / traversals,
            "tokens_per_traversal_per_run": [round(r["tokens_per_traversal"], 3) for r in runs],
            "draft_rows_per_traversal": rows / traversals,
            "forbidden_share_of_draft_rows": sum(r["forbidden_rows"] for r in runs) / rows if rows else 0.0,
            "tokens_per_s_median": statistics.median(len(r["tokens"]) / r["seconds"] for r in runs)}


async def measure(store, tokenizer, prompts: list[list[int]], constraint, reps: int, tokens: int) -> dict:
    eos = tokenizer.eos_token_id
    arms: dict[str, list[dict]] = {"pruned": [], "unpruned": []}
    same = True
    async with open_bench_ring(store, tokenizer, STAGES, LinkSpec(),
                               engine_config=EngineConfig(draft="ngram", max_pipeline_depth=1)) as ring:
        for rep in range(reps):
            for i, prompt in enumerate(prompts):
                order = ("pruned", "unpruned") if (rep + i) % 2 == 0 else ("unpruned", "pruned")
                got = {arm: await one(ring, prompt, constraint, tokens, arm == "pruned", eos) for arm in order}
                same &= got["pruned"]["tokens"] == got["unpruned"]["tokens"]
                for arm in order:
                    arms[arm].append(got[arm])
                print(f"rep {rep} prompt {i}: " + ", ".join(
                    f"{arm} {got[arm]['tokens_per_traversal']:.2f} tok/trav, {got[arm]['draft_rows']} rows "
                    f"({got[arm]['forbidden_rows']} forbidden)" for arm in ("pruned", "unpruned")), flush=True)
    return {"same_tokens_in_both_arms": same, **{arm: summary(runs) for arm, runs in arms.items()},
            "example_output": tokenizer.decode(arms["pruned"][0]["tokens"])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True, help="write results and conditions here")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--reps", type=int, default=2, help="repetitions of every prompt in each arm")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request (fewer if the JSON ends)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (shared by every stage in this process)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    store = open_or_prepare(args.model, progress=False)
    tokenizer = AutoTokenizer.from_pretrained(str(store.tokenizer_dir))
    constraint = json_constraint(tokenizer, SCHEMA)
    prompts = [encode_chat(tokenizer, prompt_messages(p)) for p in PEOPLE]
    conditions = {**base_conditions(store), "stages": STAGES, "link": LinkSpec().describe(), "drafter": "ngram",
                  "max_pipeline_depth": 1, "decoding": "greedy, response_format json_schema (compact grammar)",
                  "schema": SCHEMA, "prompts": [f"chat template: record example with spaces, then {p}" for p in PEOPLE],
                  "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": args.tokens, "reps": args.reps,
                  "arms": "alternating per prompt and rep, same ring", "wire_dtype": "f32"}
    print(f"conditions: {json.dumps(conditions)}", flush=True)
    result = {"conditions": conditions, **trio.run(measure, store, tokenizer, prompts, constraint, args.reps, args.tokens)}
    result["conditions"]["load_avg_1_5_15_at_end"] = list(os.getloadavg())
    for arm in ("pruned", "unpruned"):
        s = result[arm]
        print(f"{arm}: {s['tokens_per_traversal']:.2f} tokens/traversal, {s['draft_rows_per_traversal']:.2f} draft "
              f"rows/traversal, {100 * s['forbidden_share_of_draft_rows']:.0f}% of draft rows forbidden, "
              f"{s['tokens_per_s_median']:.1f} tok/s")
    print(f"same tokens in both arms: {result['same_tokens_in_both_arms']}")
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    return 0 if result["same_tokens_in_both_arms"] else 1


if __name__ == "__main__":
    sys.exit(main())
